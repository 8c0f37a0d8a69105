//go:build chaos

package chaos

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/internal/kafka"
)

// arrival is one record read from C.
type arrival struct {
	src    srcKey
	seq    int64
	sent   time.Time // when the producer sent it (from its value)
	cPart  int32
	cOff   int64
	seenAt time.Time // when the observer read it (within about a second of its arrival)
	// producer is the producer session that wrote it to C (its batch's
	// producer id and epoch): one agent process's.
	producer producerSession
}

// srcKey names a source partition: the cluster whose producer wrote it
// and the partition.
type srcKey struct {
	origin    string
	partition int32
}

func (k srcKey) String() string { return fmt.Sprintf("%s:orders/%d", k.origin, k.partition) }

// parseValue reads "<origin>:<partition>:<seq>:<unix ms>".
func parseValue(v []byte) (srcKey, int64, time.Time, bool) {
	f := strings.Split(string(v), ":")
	if len(f) != 4 {
		return srcKey{}, 0, time.Time{}, false
	}
	p, err1 := strconv.ParseInt(f[1], 10, 32)
	seq, err2 := strconv.ParseInt(f[2], 10, 64)
	ms, err3 := strconv.ParseInt(f[3], 10, 64)
	if err1 != nil || err2 != nil || err3 != nil {
		return srcKey{}, 0, time.Time{}, false
	}
	return srcKey{f[0], int32(p)}, seq, time.UnixMilli(ms), true
}

// leaderClaim is an agent's /leader answer naming itself.
type leaderClaim struct {
	agent string
	token int64
	at    time.Time
}

// observer watches the run from outside while it goes: it reads C as it
// fills (read_committed), and polls every live agent's /leader and
// /metrics. It owns two goroutines, ended by stop.
type observer struct {
	agents []*agentProc
	start  time.Time
	cl     sarama.Client
	topic  string
	parts  int32
	cancel context.CancelFunc
	wg     sync.WaitGroup

	readMu sync.Mutex // serialises reads of C
	next   []int64    // per C partition, the next offset to read; under readMu

	mu       sync.Mutex
	got      []arrival
	claims   []leaderClaim
	reorders map[string]float64 // "<agent>#<incarnation>" → kswitch_routing_reordered_total, the highest seen
	crashed  []string           // agents that exited by themselves

	fleet *fleetWatch // etcd's history and the agents' readiness (startFleetWatch); stopped by stop
}

func startObserver(brokers []string, topic string, parts int32, agents []*agentProc, start time.Time) (*observer, error) {
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	sc.Net.DialTimeout, sc.Net.ReadTimeout, sc.Net.WriteTimeout = time.Second, 2*time.Second, time.Second
	sc.Metadata.Retry.Max = 1
	cl, err := sarama.NewClient(brokers, sc)
	if err != nil {
		return nil, fmt.Errorf("chaos: a client of C: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	o := &observer{agents: agents, start: start, cl: cl, topic: topic, parts: parts, cancel: cancel,
		next: make([]int64, parts), reorders: map[string]float64{}}
	o.wg.Go(func() { o.every(ctx, time.Second, func() { _ = o.readC(ctx, 3*time.Second) }) })
	o.wg.Go(func() { o.every(ctx, time.Second, func() { o.pollAgents(ctx) }) })
	return o, nil
}

func (o *observer) every(ctx context.Context, d time.Duration, f func()) {
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		f()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (o *observer) stop() {
	o.cancel()
	o.wg.Wait()
	if o.fleet != nil {
		o.fleet.stop()
	}
	o.cl.Close()
}

// readC reads every partition of C from where the last read ended to its
// end (its last stable offset). Concurrent calls are serialised.
func (o *observer) readC(ctx context.Context, timeout time.Duration) error {
	o.readMu.Lock() // the observer's loop and the checker read
	defer o.readMu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for p := range o.parts {
		var got []arrival
		next, err := kafka.ReadPartition(ctx, o.cl, o.topic, p, o.next[p], func(r kafka.Record) bool {
			src, seq, sent, ok := parseValue(r.Value)
			if ok {
				got = append(got, arrival{src: src, seq: seq, sent: sent, cPart: p, cOff: r.Offset, seenAt: time.Now(),
					producer: producerSession{r.ProducerID, r.ProducerEpoch}})
			}
			return true
		})
		o.next[p] = max(o.next[p], next)
		o.mu.Lock()
		o.got = append(o.got, got...)
		o.mu.Unlock()
		if err != nil {
			return fmt.Errorf("read C's %s/%d from %d: %w", o.topic, p, o.next[p], err)
		}
	}
	return nil
}

// arrivals returns what was read of C so far.
func (o *observer) arrivals() []arrival {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]arrival(nil), o.got...)
}

var pollClient = &http.Client{Timeout: 700 * time.Millisecond}

func (o *observer) pollAgents(ctx context.Context) {
	for _, a := range o.agents {
		p, inc, stopped := a.current()
		if by, err := p.exitedByItself(); by {
			o.mu.Lock()
			o.crashed = append(o.crashed, fmt.Sprintf("%s#%d exited by itself at %.1fs: %v", a.id, inc, time.Since(o.start).Seconds(), err))
			o.mu.Unlock()
			p.mu.Lock()
			p.expected = true // recorded once
			p.mu.Unlock()
			continue
		}
		if stopped || !a.alive() {
			continue
		}
		var v struct {
			Leader string `json:"leader"`
			Self   bool   `json:"self"`
			Token  int64  `json:"fencing_token"`
		}
		if err := getJSON(ctx, "http://"+a.http+"/leader", &v); err == nil && v.Self {
			o.mu.Lock()
			o.claims = append(o.claims, leaderClaim{agent: a.id, token: v.Token, at: time.Now()})
			o.mu.Unlock()
		}
		if n, err := metricSum(ctx, "http://"+a.http+"/metrics", "kswitch_routing_reordered_total"); err == nil {
			k := fmt.Sprintf("%s#%d", a.id, inc)
			o.mu.Lock()
			o.reorders[k] = max(o.reorders[k], n)
			o.mu.Unlock()
		}
	}
}

func getJSON(ctx context.Context, url string, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := pollClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

// metricSum sums every series of the metric name on a Prometheus text page.
func metricSum(ctx context.Context, url, name string) (float64, error) {
	sum := 0.0
	err := scrape(ctx, url, func(line string) bool {
		rest, ok := strings.CutPrefix(line, name)
		if !ok || (rest != "" && rest[0] != ' ' && rest[0] != '{') {
			return true // another metric, or one whose name starts with name
		}
		f := strings.Fields(line)
		if v, err := strconv.ParseFloat(f[len(f)-1], 64); err == nil {
			sum += v
		}
		return true
	})
	return sum, err
}

// scrape reads a Prometheus text page line by line into each, until each
// returns false.
func scrape(ctx context.Context, url string, each func(line string) bool) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := pollClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() && each(sc.Text()) {
	}
	return sc.Err()
}

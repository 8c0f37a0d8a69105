//go:build chaos

package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/IBM/sarama"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// agentStuckAfter is the agents' stall limit (agent.Options.StuckAfter):
// kswitch agent leaves it at its default, 30 s or ten commit intervals,
// whichever is longer, and the chaos configuration's commit interval
// (200 ms) makes it 30 s.
const agentStuckAfter = 30 * time.Second

// stallBound is how long an agent may answer /readyz 200 while a partition
// it owns has records waiting and a committed position that does not move.
// The agent itself reports such a partition after agentStuckAfter (its
// worker checks every commit interval; the end offset it compares with is
// asked for at the first check past the limit). Beyond that the checker's
// view lags the agent's by the commit interval (etcd's position trails the
// agent's committable one), its poll (1 s) and a loaded machine's delays:
// 10 s covers them with room.
const stallBound = agentStuckAfter + 10*time.Second

// endAskAfter: the end offset of a partition is asked for once its
// position has stood still this long (a stall needs records waiting the
// whole time, so the checker must know they were there early).
const endAskAfter = 5 * time.Second

// fleetWatch follows etcd's history (history) and every live agent's
// /readyz, and checks readiness against what it sees: it owns one
// goroutine besides the history's, ended by stop.
type fleetWatch struct {
	hist   *history
	etcd   *clientv3.Client
	agents []*agentProc
	start  time.Time
	kafka  map[string]sarama.Client // source clusters' clients, for end offsets
	cancel context.CancelFunc
	done   chan struct{}

	// Of the poller's goroutine alone:
	alive   map[string]agentLife
	waiting map[clusterPart]waitingAt

	mu     sync.Mutex
	stalls []Violation // readiness violations, the first of each agent and partition
	seen   map[string]bool
	polls  int // /readyz answers checked
}

// agentLife is when an agent process last became able to work: started
// or continued (SIGCONT), as the poller saw it.
type agentLife struct {
	incarnation int
	since       time.Time
}

// waitingAt: since when records have waited past a committed offset.
type waitingAt struct {
	offset int64
	since  time.Time
}

func startFleetWatch(info stackInfo, agents []*agentProc, start time.Time) (*fleetWatch, error) {
	cli, err := clientv3.New(clientv3.Config{Endpoints: info.Etcd, DialTimeout: 2 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("chaos: etcd client: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	f := &fleetWatch{hist: startHistory(cli, keys.New(fleetName)), etcd: cli, agents: agents, start: start,
		kafka: map[string]sarama.Client{}, cancel: cancel, done: make(chan struct{}),
		alive: map[string]agentLife{}, waiting: map[clusterPart]waitingAt{}, seen: map[string]bool{}}
	for _, c := range []string{"A", "B"} {
		sc := sarama.NewConfig()
		sc.Version = sarama.V3_6_0_0
		sc.Net.DialTimeout, sc.Net.ReadTimeout, sc.Net.WriteTimeout = time.Second, 2*time.Second, time.Second
		sc.Metadata.Retry.Max = 1
		kc, err := sarama.NewClient(info.Clusters[c], sc)
		if err != nil {
			f.close()
			return nil, fmt.Errorf("chaos: a client of %s: %w", c, err)
		}
		f.kafka[c] = kc
	}
	go func() {
		defer close(f.done)
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				f.pollReadiness(ctx)
			}
		}
	}()
	return f, nil
}

func (f *fleetWatch) stop() {
	f.cancel()
	<-f.done
	f.close()
}

func (f *fleetWatch) close() {
	f.hist.stop()
	for _, kc := range f.kafka {
		kc.Close()
	}
	f.etcd.Close()
}

// pollReadiness asks every live agent's /readyz and checks a 200 against
// etcd's history: the agent must not own a partition whose records have
// waited, with its committed position standing still, for over
// stallBound. The clock of that rule starts at the latest of: the agent's
// acknowledgement of the first generation of its ownership (it runs the
// partition from then), the last change of the partition's committed
// position, the agent process's start or SIGCONT, its last registration
// (a session lost and registered again runs a new worker, whose stall
// limit starts then: seed 31 saw an agent answer 200 4 s after it
// registered again, owning a partition that had not moved for 67 s while
// it had no session), the end of the last pause signal (a paused partition is not stalled; while any pause signal
// is in force nothing is checked), and the first time records were seen
// waiting past that position.
func (f *fleetWatch) pollReadiness(ctx context.Context) {
	now := time.Now()
	for _, a := range f.agents {
		_, inc, stopped := a.current()
		l, ok := f.alive[a.id]
		if stopped || !a.alive() {
			delete(f.alive, a.id)
			continue
		}
		if !ok || l.incarnation != inc {
			f.alive[a.id] = agentLife{incarnation: inc, since: now}
			continue
		}
		code, reason, err := readyz(ctx, a.http)
		if err != nil {
			continue
		}
		f.checkAgent(ctx, a.id, l.since, now, code, reason)
	}
}

// readyz returns the status code of an agent's /readyz and its reason.
func readyz(ctx context.Context, addr string) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/readyz", nil)
	if err != nil {
		return 0, "", err
	}
	resp, err := pollClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	var body struct {
		Reason string `json:"reason"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&body) // the code decides; the reason is for the report
	return resp.StatusCode, body.Reason, nil
}

// stillPart is a partition an agent owns, and since when the rule's clock
// runs for it (before records are known to wait).
type stillPart struct {
	part      clusterPart
	committed int64
	moved     time.Time // when the position reached committed (zero: never committed)
	from      time.Time
}

// checkAgent checks one /readyz answer of agent id at now.
func (f *fleetWatch) checkAgent(ctx context.Context, id string, aliveSince, now time.Time, code int, reason string) {
	parts := f.stillParts(id, aliveSince)
	var ask []stillPart
	for _, p := range parts {
		if w, ok := f.waiting[p.part]; ok && w.offset != p.committed {
			delete(f.waiting, p.part)
		}
		if _, ok := f.waiting[p.part]; !ok && now.Sub(p.from) > endAskAfter {
			ask = append(ask, p)
		}
	}
	for _, p := range ask {
		end, err := f.end(ctx, p.part)
		if err == nil && end > p.committed {
			f.waiting[p.part] = waitingAt{offset: p.committed, since: now}
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.polls++
	if code != http.StatusOK {
		return
	}
	for _, p := range parts {
		w, ok := f.waiting[p.part]
		if !ok {
			continue
		}
		from := p.from
		if w.since.After(from) {
			from = w.since
		}
		if now.Sub(from) <= stallBound || f.seen[id+" "+p.part.String()] {
			continue
		}
		f.seen[id+" "+p.part.String()] = true
		movedAt := "never committed in this run"
		if !p.moved.IsZero() {
			movedAt = fmt.Sprintf("there since %.1fs", p.moved.Sub(f.start).Seconds())
		}
		f.stalls = append(f.stalls, Violation{Invariant: "readiness", At: now.Sub(f.start),
			Record: fmt.Sprintf("%s /readyz 200 at %.1fs owning %s, committed %d (%s), records waiting past it since %.1fs; the rule's clock ran from %.1fs (ownership, position, start or pause, whichever latest)",
				id, now.Sub(f.start).Seconds(), p.part, p.committed, movedAt, w.since.Sub(f.start).Seconds(), p.from.Sub(f.start).Seconds()),
			Detail: fmt.Sprintf("an agent whose partition has not moved for over its stall limit (%v; the checker allows %v) while records wait must not answer ready (reason it gave: %q)",
				agentStuckAfter, stallBound, reason)})
	}
}

// stillParts returns the partitions agent id owns in the assignment in
// force, with their committed offsets and since when the rule's clock
// runs; none while a pause signal is in force.
func (f *fleetWatch) stillParts(id string, aliveSince time.Time) []stillPart {
	h := f.hist
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.pauses) > 0 || len(h.assignments) == 0 {
		return nil
	}
	cur := h.assignments[len(h.assignments)-1].a
	var out []stillPart
	for cluster, tps := range cur.OwnedBy(id) {
		for _, tp := range tps {
			part := clusterPart{cluster, tp.Topic, tp.Partition}
			owned, ok := h.ownedSince(id, cluster, tp)
			if !ok {
				continue
			}
			committed, moved := h.position(part)
			from := owned
			for _, t := range []time.Time{moved, aliveSince, h.lastPause, h.registered[id]} {
				if t.After(from) {
					from = t
				}
			}
			out = append(out, stillPart{part: part, committed: committed, moved: moved, from: from})
		}
	}
	return out
}

// ownedSince returns when agent id acknowledged the first generation of
// its present ownership of tp on cluster (the generations since all give
// it tp), or false if it has not acknowledged one. Called with h.mu held.
func (h *history) ownedSince(id, cluster string, tp state.TopicPartition) (time.Time, bool) {
	first := int64(-1)
	for i := len(h.assignments) - 1; i >= 0; i-- {
		a := h.assignments[i].a
		if !slices.Contains(a.Section(cluster).Owned[id], tp) {
			break
		}
		first = a.Generation
	}
	if first < 0 {
		return time.Time{}, false
	}
	for _, k := range h.acks {
		if k.agent == id && k.generation >= first {
			return k.seen, true
		}
	}
	return time.Time{}, false
}

// position returns part's committed offset (0 if none) and when it last
// changed (zero if never committed). Called with h.mu held.
func (h *history) position(part clusterPart) (int64, time.Time) {
	var off int64
	var moved time.Time
	found := false
	for i := len(h.commits) - 1; i >= 0; i-- {
		c := h.commits[i]
		if c.part != part {
			continue
		}
		if found && c.offset != off {
			break
		}
		off, moved, found = c.offset, c.seen, true
	}
	return off, moved
}

// end returns part's end offset on its cluster.
func (f *fleetWatch) end(ctx context.Context, part clusterPart) (int64, error) {
	kc, ok := f.kafka[part.cluster]
	if !ok {
		return 0, fmt.Errorf("no client of %s", part.cluster)
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	return kafka.ListOffset(ctx, kc, part.topic, part.partition, sarama.OffsetNewest)
}

// checkReadiness adds the readiness violations seen during the run.
func (f *fleetWatch) checkReadiness(res *Result) {
	f.mu.Lock()
	defer f.mu.Unlock()
	res.ReadyzChecked = f.polls
	res.Violations = append(res.Violations, f.stalls...)
}

package routing

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/kafka"
)

// producerKey identifies a producer: the cluster, and the acks, which a
// producer applies to all it sends (the compression is per batch).
type producerKey struct {
	cluster, acks string
}

func (k producerKey) String() string {
	if k.acks != "all" {
		return fmt.Sprintf("%s (acks %s)", k.cluster, k.acks)
	}
	return k.cluster
}

// errClosed is returned once the router is closing.
var errClosed = errors.New("routing: router closed")

// producer is one kafka.Producer and the count of the messages it holds.
// A producer is closed only when its count is 0, and the count is raised
// under the pool's read lock, so nothing is sent to a closed producer.
type producer struct {
	key producerKey
	// kp is the producer, and roundRobin its per-topic counters (topic →
	// *atomic.Uint32).
	kp         *kafka.Producer
	roundRobin sync.Map
	// users counts the messages given to kp (or about to be) whose fate
	// is not settled: not yet acknowledged, or failed and waiting to be
	// sent again to kp.
	users atomic.Int64
	// sendMu is held (read) while producing to kp, and (write) to close
	// it: a belt and braces for Close after a drain timeout.
	sendMu sync.RWMutex
	closed bool          // under sendMu
	done   chan struct{} // closed when kp.Close returned
	// retired is set when the definition of the producer's cluster
	// changed: messages it failed are sent again through a new producer.
	retired atomic.Bool
	// gone is set once the pool closes the producer or is about to (see
	// acquireFor).
	gone atomic.Bool
	// The producer's counters at the router's last sample, when
	// it last took a new producer id, and when it took one less than
	// bumpRepeat after the one before (unix ns; 0: never): on the loop
	// (sampleProducers) but bumpRepeated, read by DeliveryProblem.
	seen         kafka.ProducerStats
	bumpAt       time.Time
	bumpRepeated atomic.Int64
}

// opening is a producer being opened in the background, or the failure
// of the last attempt.
type opening struct {
	done chan struct{} // closed when the attempt ended
	err  error         // set before done is closed
	at   time.Time     // when it ended
}

// closeAbortWait bounds how long a producer's Close may take when the
// caller has no deadline of its own (sweep, or an opening that finished
// after the pool closed), and how long the pool's close waits for its
// goroutines after its ctx ended.
const closeAbortWait = 5 * time.Second

// openRetry is how long after a failed attempt to open a producer the next
// attempt may start; meanwhile acquire fails at once with the same error.
const openRetry = time.Second

// pool holds the producers of a router. Its methods are safe for
// concurrent use.
type pool struct {
	log *zap.Logger
	// opened is told about each producer opened and closed.
	opened func(k producerKey, open bool)
	// handler returns the handler of each producer opened.
	handler func() *produceHandler
	// ctx ends when the pool closes: it bounds the opening of producers.
	ctx    context.Context
	cancel context.CancelFunc

	mu       sync.RWMutex
	clusters map[string]config.Cluster
	live     map[producerKey]*producer
	// retired are producers to a cluster whose definition changed: no new
	// message goes to them, and sweep closes each once it holds none.
	retired []*producer
	opening map[producerKey]*opening
	closed  bool
	wg      sync.WaitGroup // the opening and closing goroutines
}

// newPool returns a pool whose producers report to the handlers handler
// returns, one per producer.
func newPool(clusters map[string]config.Cluster, log *zap.Logger, handler func() *produceHandler) *pool {
	ctx, cancel := context.WithCancel(context.Background())
	return &pool{clusters: clusters, log: log, live: map[producerKey]*producer{}, opening: map[producerKey]*opening{},
		opened: func(producerKey, bool) {}, handler: handler, ctx: ctx, cancel: cancel}
}

// acquire returns the producer of k with its user count raised by n,
// opening it in the background if needed: it waits at most wait (or until
// ctx ends) for an opening, then fails, and an attempt that failed less
// than openRetry ago fails at once with that attempt's error.
func (p *pool) acquire(ctx context.Context, k producerKey, n int64, wait time.Duration) (*producer, error) {
	var timeout <-chan time.Time
	for {
		p.mu.RLock()
		if pr := p.live[k]; pr != nil {
			pr.users.Add(n)
			p.mu.RUnlock()
			return pr, nil
		}
		p.mu.RUnlock()

		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			return nil, errClosed
		}
		if pr := p.live[k]; pr != nil {
			pr.users.Add(n)
			p.mu.Unlock()
			return pr, nil
		}
		o := p.startOpening(k)
		p.mu.Unlock()

		if timeout == nil {
			t := time.NewTimer(wait)
			defer t.Stop()
			timeout = t.C
		}
		select {
		case <-o.done:
			if o.err != nil {
				return nil, o.err
			}
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-timeout:
			return nil, fmt.Errorf("routing: the producer for cluster %s is still connecting", k)
		}
	}
}

// acquireFor is acquire(ctx, ch.pkey, 1, wait), first trying without a
// lock the producer ch had last: its user count is raised, and then it is
// used unless it is gone (closed by sweep or close) or retired. sweep
// marks a producer gone before it reads the count that lets it close it,
// and the count is raised here before gone is read, so one of the two
// sees the other.
func (p *pool) acquireFor(ctx context.Context, ch *channel, wait time.Duration) (*producer, error) {
	if pr := ch.pr.Load(); pr != nil {
		pr.users.Add(1)
		if !pr.gone.Load() && !pr.retired.Load() {
			return pr, nil
		}
		pr.users.Add(-1)
	}
	pr, err := p.acquire(ctx, ch.pkey, 1, wait)
	if err == nil {
		ch.pr.Store(pr)
	}
	return pr, err
}

// startOpening returns the opening of k, starting one unless one is under
// way or failed less than openRetry ago. The caller holds p.mu and has
// checked that k is not live.
func (p *pool) startOpening(k producerKey) *opening {
	o := p.opening[k]
	if o != nil && (o.err == nil || time.Since(o.at) < openRetry) {
		return o
	}
	o = &opening{done: make(chan struct{})}
	p.opening[k] = o
	p.wg.Add(1)
	go p.open(k, o)
	return o
}

// warm starts opening the producer of k in the background, unless it is
// open or startOpening would not start it.
func (p *pool) warm(k producerKey) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.closed && p.live[k] == nil {
		p.startOpening(k)
	}
}

// release lowers pr's user count by n.
func (p *pool) release(pr *producer, n int64) { pr.users.Add(-n) }

// setClusters puts new cluster definitions in force: the producers of a
// cluster whose definition changed are retired (the next message opens a
// producer with the new definition; the retired one is closed once the
// messages it holds are settled), and failed openings are forgotten.
func (p *pool) setClusters(clusters map[string]config.Cluster) {
	p.mu.Lock()
	defer p.mu.Unlock()
	old := p.clusters
	p.clusters = clusters
	for k, pr := range p.live {
		if !reflect.DeepEqual(old[k.cluster], clusters[k.cluster]) {
			delete(p.live, k)
			pr.retired.Store(true)
			p.retired = append(p.retired, pr)
			p.log.Info("cluster definition changed: the producer is replaced", zap.Stringer("producer", k))
			// It never gives up a record: closed now, what it did not
			// finish comes back (Unfinished) and is sent again through
			// the new producer, in order.
			ctx, cancel := context.WithTimeout(p.ctx, retireWait)
			p.shut(ctx, pr, cancel)
		}
	}
	for k, o := range p.opening {
		if o.err != nil {
			delete(p.opening, k)
		}
	}
}

// openTimeout bounds the opening of a producer (its
// metadata, then InitProducerID retried): acquire gives up waiting after
// Options.OpenWait, and the next attempt starts openRetry after a failure.
const openTimeout = 10 * time.Second

// open opens the producer of k; its outcome is in o and, on success, in
// p.live.
func (p *pool) open(k producerKey, o *opening) {
	defer p.wg.Done()
	p.mu.RLock()
	cl, ok := p.clusters[k.cluster]
	p.mu.RUnlock()
	h := p.handler()
	var kp *kafka.Producer
	err := fmt.Errorf("cluster %q is not configured", k.cluster)
	if ok {
		cfg := kafka.DefaultProducerConfig()
		cfg.Acks = acksOf(k.acks)
		cfg.Logger = p.log
		ctx, cancel := context.WithTimeout(p.ctx, openTimeout)
		kp, err = kafka.NewProducer(ctx, k.cluster, cl, cfg, h)
		cancel()
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	defer close(o.done)
	o.at = time.Now()
	if err != nil {
		o.err = fmt.Errorf("routing: open a producer for cluster %s: %w", k, err)
		p.log.Warn("cannot open producer; records for its channels wait", zap.Stringer("producer", k), zap.Error(err))
		return
	}
	if p.closed {
		o.err = errClosed
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), closeAbortWait)
			defer cancel()
			_ = kp.Close(ctx)
		}()
		return
	}
	pr := &producer{key: k, kp: kp, done: make(chan struct{})}
	h.pr = pr
	p.live[k] = pr
	delete(p.opening, k)
	p.opened(k, true)
	p.log.Info("producer opened", zap.Stringer("producer", k))
}

// sweep closes, and waits for, the producers that used does not name and
// that hold no message, and forgets failed openings of unused producers.
func (p *pool) sweep(used map[producerKey]bool) {
	var idle []*producer
	p.mu.Lock()
	for k, pr := range p.live {
		if used[k] {
			continue
		}
		pr.gone.Store(true) // before the count is read: see acquireFor
		if pr.users.Load() != 0 {
			pr.gone.Store(false)
			continue
		}
		delete(p.live, k)
		idle = append(idle, pr)
	}
	for k, o := range p.opening {
		if !used[k] && o.err != nil {
			delete(p.opening, k)
		}
	}
	p.retired = slices.DeleteFunc(p.retired, func(pr *producer) bool {
		if pr.users.Load() == 0 {
			idle = append(idle, pr)
			return true
		}
		return false
	})
	p.mu.Unlock()
	for _, pr := range idle {
		ctx, cancel := context.WithTimeout(context.Background(), closeAbortWait)
		p.shut(ctx, pr, cancel)
		<-pr.done
		p.opened(pr.key, false)
		p.log.Info("producer closed: no channel uses it any more", zap.Stringer("producer", pr.key))
	}
}

// retireWait bounds how long a retired producer may go on with what it
// holds before the rest is sent again through the new producer.
const retireWait = 5 * time.Second

// shut starts closing pr: pr.done is closed once pr.kp.Close(ctx)
// returned, and cancel is called then (at once when pr was shut already).
func (p *pool) shut(ctx context.Context, pr *producer, cancel context.CancelFunc) {
	pr.sendMu.Lock()
	defer pr.sendMu.Unlock()
	if pr.closed {
		cancel()
		return
	}
	pr.closed = true
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		defer close(pr.done)
		defer cancel()
		_ = pr.kp.Close(ctx)
	}()
}

// all returns the producers open now, retired ones included.
func (p *pool) all() []*producer {
	p.mu.RLock()
	defer p.mu.RUnlock()
	out := slices.Collect(maps.Values(p.live))
	return append(out, p.retired...)
}

// keys returns the producers open now.
func (p *pool) keys() []producerKey {
	p.mu.RLock()
	defer p.mu.RUnlock()
	out := make([]producerKey, 0, len(p.live))
	for k := range p.live {
		out = append(out, k)
	}
	return out
}

// close closes every producer and waits for the pool's goroutines, or
// until ctx ends.
func (p *pool) close(ctx context.Context) error {
	p.mu.Lock()
	p.closed = true
	p.cancel()
	live := slices.Collect(maps.Values(p.live))
	live = append(live, p.retired...)
	for _, pr := range live {
		pr.gone.Store(true)
	}
	p.live, p.retired = map[producerKey]*producer{}, nil
	p.mu.Unlock()
	for _, pr := range live {
		p.shut(ctx, pr, func() {})
	}
	done := make(chan struct{})
	go func() {
		p.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
	}
	// Each producer's Close returns once ctx ended: what it held is not
	// acknowledged (its records are consumed again by the next owner).
	select {
	case <-done:
	case <-time.After(closeAbortWait):
	}
	return fmt.Errorf("routing: close producers: %w", ctx.Err())
}

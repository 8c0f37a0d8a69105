package routing

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/signals"
)

// The headers of a dead-lettered record, added to its own.
const (
	HeaderError  = "kswitch-error"  // why: the evaluation or produce error
	HeaderRule   = "kswitch-rule"   // the rule evaluated, or that routed it ("default" for the default route)
	HeaderSource = "kswitch-source" // topic/partition@offset where it was consumed
	// HeaderSourceCluster is the cluster it was consumed from.
	HeaderSourceCluster = "kswitch-source-cluster"
)

// Options are the parts of a router that are not configuration. The zero
// value is usable: static routing only, nothing paused, no metrics
// exported, no logs.
type Options struct {
	// Etcd, when set, is the client Run follows the dynamic layer with
	// (routes and channels/ of the configuration's fleet). Nil: the
	// configuration file's routing only, ready at once.
	Etcd *clientv3.Client
	// Registerer receives the router's metrics. Default: a registry of
	// its own, not exported.
	Registerer prometheus.Registerer
	// Logger receives the router's logs. Default: none.
	Logger *zap.Logger
	// OpenWait bounds how long Handle waits for a producer that is being
	// opened before it returns an error (the agent offers the record
	// again). Default 2s.
	OpenWait time.Duration
	// RetryBackoff is the wait before a failed produce is sent again; it
	// doubles with each failure of the same record up to RetryBackoffMax.
	// Defaults 100ms and 5s.
	RetryBackoff, RetryBackoffMax time.Duration
	// OnAck, when set, is called after each record is acknowledged, from
	// the goroutine that acknowledged it. It must not block. For tests.
	OnAck func(*record.Record)
}

// Router is the routing sink, an record.Handler. New starts its one
// background goroutine (retries and closing idle producers); Run follows
// etcd; Close drains and ends everything. Handle, Status and Version may
// be called from any goroutine, before, during and after Run.
type Router struct {
	clusters map[string]config.Cluster
	static   Config
	keys     keys.Fleet
	timeout  time.Duration
	opts     Options
	signals  func() signals.State
	log      *zap.Logger
	m        *metrics
	pool     *pool
	txns     *txnSet

	cur     atomic.Pointer[Version]
	ready   chan struct{}
	started atomic.Bool
	closed  atomic.Bool

	// deadMu guards deadBy: records dead-lettered by logical topic
	// (DeadLettered).
	deadMu sync.Mutex
	deadBy map[string]int64

	loopCtx    context.Context // cancelled by Close to end the loop
	loopCancel context.CancelFunc
	loopOnce   sync.Once // starts the loop (Run), or rules it out (Close first)
	loopDone   chan struct{}
	closeOnce  sync.Once
	closeErr   error
	sweepKick  chan struct{}
	retryKick  chan struct{}

	// mu guards the fields below it.
	mu      sync.Mutex
	dests   map[dest]*destState
	retries []*outMsg
	blocked map[source]*blockedSource // partitions held by a record refused for good
	// recovering are the destinations whose failed produces are held
	// and sent again in order (recovery.go).
	recovering map[*destState]bool

	health deliveryHealth
	// samples counts the loop's health samples (sampleHealth): a test
	// that asserts what sampling does not do waits for samples, not time.
	samples atomic.Int64
	// breaches counts records the router produced behind an earlier
	// record of their partition that was held (recovery.go): never, by
	// design; the tests read it.
	breaches atomic.Int64
	nblock   atomic.Int32 // len(blocked), read without mu
	refusal  *Refusal
	layer    layer
}

// source is a consumed partition.
type source struct {
	cluster, topic string
	partition      int32
}

type blockedSource struct {
	n   int // messages held
	err error
}

// destState is the delivery state of one destination, shared by the
// versions that route to it.
type destState struct {
	dest     dest
	inFlight atomic.Int64
	failing  atomic.Pointer[failure] // nil while it works
	rec      recovery                // under Router.mu, while failing
	acked    atomic.Int64            // produces acknowledged
	health   destHealth              // under Router.mu

	// sending is the producer the destination's produces go through (nil:
	// none yet, or the exactly_once path); it changes only while nothing
	// of the destination is in flight (enter).
	enterMu sync.Mutex
	sending *producer

	routed   prometheus.Counter
	latency  prometheus.Observer
	failures prometheus.Counter
}

type failure struct {
	err   error
	since time.Time
}

// New checks cfg.Routing (the static layer), compiling its expressions,
// and returns a router in force with it. sig returns the signals in force,
// for channel pauses; nil means nothing is paused. cfg is copied; it must
// be valid (config.Validate). New starts no goroutine: Run runs the
// router (its retries, producer sweeps and health samples, and the etcd
// layer), Close ends it; a router that is not running sends each record
// once and retries nothing.
func New(cfg config.Config, sig func() signals.State, opts Options) (*Router, error) {
	cfg = cfg.Clone()
	v, err := Compile(cfg.Routing, cfg.Clusters)
	if err != nil {
		return nil, fmt.Errorf("routing: the configuration file's routing section is invalid:\n%w", err)
	}
	if opts.OpenWait <= 0 {
		opts.OpenWait = 2 * time.Second
	}
	if opts.RetryBackoff <= 0 {
		opts.RetryBackoff = 100 * time.Millisecond
	}
	if opts.RetryBackoffMax <= 0 {
		opts.RetryBackoffMax = 5 * time.Second
	}
	opts.RetryBackoffMax = max(opts.RetryBackoffMax, opts.RetryBackoff)
	if opts.Registerer == nil {
		opts.Registerer = prometheus.NewRegistry()
	}
	if sig == nil {
		sig = func() signals.State { return signals.State{} }
	}
	log := opts.Logger
	if log == nil {
		log = zap.NewNop()
	}
	log = log.Named("routing")
	m, err := newMetrics(opts.Registerer)
	if err != nil {
		return nil, err
	}
	r := &Router{
		clusters: cfg.Clusters, static: cfg.Routing, timeout: cfg.Etcd.RequestTimeout, opts: opts, signals: sig, log: log, m: m,
		ready: make(chan struct{}), loopDone: make(chan struct{}),
		sweepKick: make(chan struct{}, 1), retryKick: make(chan struct{}, 1),
		dests: map[dest]*destState{}, blocked: map[source]*blockedSource{},
	}
	if cfg.Fleet != "" {
		r.keys = keys.New(cfg.Fleet)
	} else if opts.Etcd != nil {
		return nil, errors.New("routing: the configuration has no fleet, whose etcd keys to follow")
	}
	if err := opts.Registerer.Register(inFlightCollector{r}); err != nil {
		return nil, fmt.Errorf("routing: register kswitch_routing_in_flight: %w", err)
	}
	for name, cl := range cfg.Clusters {
		if cl.ExactlyOnce() && cfg.Fleet == "" {
			return nil, fmt.Errorf("routing: cluster %s is exactly_once, whose transactional ids and positions are the fleet's: set fleet", name)
		}
	}
	r.txns = newTxnSet(r, cfg.Fleet, cfg.Clusters)
	r.pool = newPool(cfg.Clusters, log, func() *produceHandler { return &produceHandler{r: r} })
	r.pool.opened = func(_ producerKey, open bool) {
		if open {
			m.producers.Inc()
		} else {
			m.producers.Dec()
		}
	}
	r.loopCtx, r.loopCancel = context.WithCancel(context.Background())
	r.install(v, 0, "file")
	if opts.Etcd == nil {
		close(r.ready)
	}
	return r, nil
}

// Ready is closed once the router routes: at once without etcd, else once
// Run has read the dynamic layer for the first time. Until then Handle
// returns ErrNotReady, so that an agent restarting does not route a record
// by the file's rules when etcd's say otherwise.
func (r *Router) Ready() <-chan struct{} { return r.ready }

// Version returns the version in force.
func (r *Router) Version() *Version { return r.cur.Load() }

// ErrNotReady is returned by Handle before the first read of etcd.
var ErrNotReady = errors.New("routing: waiting for the first read of the routes and channels in etcd")

// WaitError is returned by Handle for a record that must wait: the agent
// offers it again after a backoff.
type WaitError struct {
	// Channel is the channel the record waits for ("" when it is the
	// partition that waits).
	Channel string
	// Reason is "paused", "failing", "opening", "redefined" or "blocked".
	Reason string
	Err    error
}

func (e *WaitError) Error() string {
	switch {
	case e.Reason == "paused":
		return fmt.Sprintf("routing: channel %s paused", e.Channel)
	case e.Channel == "":
		return fmt.Sprintf("routing: %s: %v", e.Reason, e.Err)
	default:
		return fmt.Sprintf("routing: channel %s %s: %v", e.Channel, e.Reason, e.Err)
	}
}

func (e *WaitError) Unwrap() error { return e.Err }

// Handle routes r: it evaluates the rules of the version in force and
// hands r to the producers of its channels, or drops it. It acknowledges r
// once every produce is acknowledged. It returns an error when r must be
// offered again: see WaitError, ErrNotReady, and EvalError when there is
// no dead-letter channel. It blocks at most Options.OpenWait (a producer
// opening; on an exactly_once cluster, also the partition count of a topic
// its Producer has not seen), and never past ctx.
func (r *Router) Handle(ctx context.Context, rec *record.Record) error {
	if r.closed.Load() {
		return errClosed
	}
	select {
	case <-r.ready:
	default:
		r.m.waits.WithLabelValues("not_ready").Inc()
		return ErrNotReady
	}
	if r.nblock.Load() > 0 {
		if err := r.blockedBy(rec); err != nil {
			r.m.waits.WithLabelValues("blocked").Inc()
			return err
		}
	}
	v := r.cur.Load()
	d, e, err := v.decide(rec)
	if err != nil {
		return r.deadLetter(ctx, v, rec, err)
	}
	if len(d.targets) == 0 {
		r.countRules(d.matched)
		r.m.dropped.WithLabelValues(d.drop).Inc()
		r.ack(rec)
		return nil
	}
	var buf [4]*outMsg // most records go to few channels: no allocation
	out := buf[:0]
	for _, t := range d.targets {
		key, err := t.ch.keyOf(&e, v, rec)
		if err != nil {
			return r.deadLetter(ctx, v, rec, &EvalError{Rule: cmp.Or(t.rule, "default"), Channel: t.ch.Name, Err: err})
		}
		out = append(out, r.newMsg(rec, t.ch, t.rule, key, nil))
	}
	if err := r.submit(ctx, rec, out); err != nil {
		return err
	}
	r.countRules(d.matched)
	return nil
}

func (r *Router) countRules(rules []*rule) {
	for _, rl := range rules {
		if c := rl.matches; c != nil {
			c.Inc()
		} else { // a rule of a version not installed by this router
			r.m.rules.WithLabelValues(rl.name).Inc()
		}
	}
}

// Release drops what the router holds of a partition its agent gave up
// (agent.Options.Released): on each exactly_once cluster, the stream's
// transactional producer of that owner stops without committing again.
// The records of its open transaction are never acknowledged (the
// partition's next owner consumes them again and its producer, opened
// with the same transactional.id, aborts that transaction), and it is
// never opened again for that owner, which would fence the next one.
// It waits, at most releaseWait, for a commit or an opening in progress.
func (r *Router) Release(p record.Owned) {
	r.dropHeld(func(om *outMsg) bool {
		rec := om.d.rec
		return rec.Cluster == p.Cluster && rec.Topic == p.Topic && rec.Partition == p.Partition &&
			rec.Generation == p.Generation && rec.Session == p.Session && rec.Token == p.Token
	})
	r.txns.release(p)
}

// This conversion does not compile unless record.Header and
// sarama.RecordHeader have the same fields, in the same order, of the
// same types, as newMsg's cast of a []record.Header needs.
var _ = sarama.RecordHeader(record.Header{})

// inFlight returns the produces not settled, across destinations.
func (r *Router) inFlight() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	var n int64
	for _, ds := range r.dests {
		n += ds.inFlight.Load()
	}
	return n
}

// ack acknowledges rec.
func (r *Router) ack(rec *record.Record) {
	rec.Ack()
	if r.opts.OnAck != nil {
		r.opts.OnAck(rec)
	}
}

// destState returns the state of d, creating it on first use.
func (r *Router) destState(d dest) *destState {
	r.mu.Lock()
	defer r.mu.Unlock()
	ds := r.dests[d]
	if ds == nil {
		ds = &destState{dest: d,
			routed:   r.m.routed.WithLabelValues(d.channel),
			latency:  r.m.latency.WithLabelValues(d.channel),
			failures: r.m.failures.WithLabelValues(d.channel),
		}
		r.dests[d] = ds
	}
	return ds
}

// blockedBy returns an error when rec's partition is held by an earlier
// record refused for good with no dead-letter channel to take it.
func (r *Router) blockedBy(rec *record.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	b := r.blocked[source{rec.Cluster, rec.Topic, rec.Partition}]
	if b == nil {
		return nil
	}
	return &WaitError{Reason: "blocked", Err: fmt.Errorf("partition %s/%d holds %d earlier record(s) that the destination refused and no dead-letter channel takes (configure routing.dead_letter): %w",
		rec.Topic, rec.Partition, b.n, b.err)}
}

// install puts v in force.
func (r *Router) install(v *Version, number int64, src string) {
	v.Number, v.Since, v.Source = number, time.Now(), src
	for _, ch := range v.channels {
		ch.ds = r.destState(ch.dest)
	}
	for _, rl := range v.rules {
		rl.matches = r.m.rules.WithLabelValues(rl.name)
	}
	r.cur.Store(v)
	r.m.version.Set(float64(number))
	// The version's producers are opened now, not by its first records,
	// which then do not wait for a connection; a destination that cannot
	// be reached is logged before any record waits for it.
	for k := range v.producers() {
		r.pool.warm(k)
	}
	select {
	case r.sweepKick <- struct{}{}:
	default:
	}
}

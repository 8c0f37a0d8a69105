package routing

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/IBM/sarama"
	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/kafka"
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

// delivery is one record on its way to its channels.
type delivery struct {
	rec     *record.Record
	pending atomic.Int32 // produces not yet acknowledged
}

// outMsg is one produce of a record to one channel.
type outMsg struct {
	d    *delivery
	ch   *channel
	rule string // "" for the default route
	dead bool   // a dead-letter produce
	ds   *destState
	pr   *producer
	tp   *txnProducer // instead of pr, on an exactly_once cluster
	// km is what the producer is given (newMsg; its partition is chosen
	// when it is sent, direct.go): its Ref is the outMsg.
	km           kafka.Message
	srcPartition int32
	sent         time.Time // first handed to a producer
	failures     int
	lastErr      error
	blocks       *source // set while it holds its partition
	due          time.Time
	resent       bool // sent again by a recovery round, not yet settled (under Router.mu)
	heldAt       time.Time
	overtaken    bool // a later record of its partition reached the channel first (under Router.mu)
	// deadReason is the reason a dead-letter produce is counted under
	// once the dead-letter channel acknowledges it; reference is set on
	// the reference that stands for a record the dead-letter channel
	// refused too (refused.go).
	deadReason string
	reference  bool
	// own is the delivery of a record's first produce, allocated with
	// it: the others of the same record share it.
	own delivery
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

// deadLetter sends rec to the dead-letter channel of v because of the
// evaluation error err, or returns err when v has none.
func (r *Router) deadLetter(ctx context.Context, v *Version, rec *record.Record, err error) error {
	var ee *EvalError
	rule := "?"
	if errors.As(err, &ee) {
		rule = ee.Rule
	}
	if v.deadLetter == nil {
		r.m.waits.WithLabelValues("evaluation").Inc()
		return fmt.Errorf("%w (no dead-letter channel: the partition waits for a version that routes this record)", err)
	}
	m := r.newMsg(rec, v.deadLetter, rule, rec.Key, deadHeaders(rec, rule, err))
	r.health.deadLetterCause(err)
	m.dead, m.deadReason = true, "evaluation"
	if errors.Is(err, ErrBudget) {
		m.deadReason = "budget"
	}
	if err := r.submit(ctx, rec, []*outMsg{m}); err != nil {
		return err
	}
	r.log.Debug("record sent to the dead-letter channel", zap.String("source", sourceOf(rec)), zap.String("rule", rule), zap.Error(err))
	return nil
}

// countDead counts a record sent to the dead-letter channel by its
// logical topic.
func (r *Router) countDead(rec *record.Record) {
	r.deadMu.Lock()
	if r.deadBy == nil {
		r.deadBy = map[string]int64{}
	}
	r.deadBy[rec.SourceTopic]++
	r.deadMu.Unlock()
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

// DeadLettered returns, by logical topic, the records sent to the
// dead-letter channel since the router was created
// (record.DeadLetterCounter).
func (r *Router) DeadLettered() map[string]int64 {
	r.deadMu.Lock()
	defer r.deadMu.Unlock()
	return maps.Clone(r.deadBy)
}

func sourceOf(rec *record.Record) string {
	return rec.Topic + "/" + strconv.Itoa(int(rec.Partition)) + "@" + strconv.FormatInt(rec.Offset, 10)
}

func deadHeaders(rec *record.Record, rule string, err error) []sarama.RecordHeader {
	return []sarama.RecordHeader{
		{Key: []byte(HeaderError), Value: []byte(err.Error())},
		{Key: []byte(HeaderRule), Value: []byte(rule)},
		{Key: []byte(HeaderSource), Value: []byte(sourceOf(rec))},
		{Key: []byte(HeaderSourceCluster), Value: []byte(rec.Cluster)},
	}
}

// This conversion does not compile unless record.Header and
// sarama.RecordHeader have the same fields, in the same order, of the
// same types, as newMsg's cast of a []record.Header needs.
var _ = sarama.RecordHeader(record.Header{})

// newMsg builds the produce of rec to ch: one allocation, the outMsg with
// its kafka.Message, whose key and value are rec's (or key) without a
// copy.
func (r *Router) newMsg(rec *record.Record, ch *channel, rule string, key []byte, extra []sarama.RecordHeader) *outMsg {
	ds := ch.ds
	if ds == nil { // a channel of a version not installed by this router
		ds = r.destState(ch.dest)
	}
	om := &outMsg{ch: ch, rule: rule, ds: ds, srcPartition: rec.Partition}
	m := &om.km
	*m = kafka.Message{Topic: ch.Topic, Key: key, Value: rec.Value, Timestamp: rec.Timestamp, Codec: codecOf(ch.Compression), Ref: om}
	switch n := len(rec.Headers) + len(extra); {
	case n == 0:
	case extra == nil:
		// The producer only reads them: the record's own, not a
		// copy (record.Header has sarama.RecordHeader's layout: the
		// conversion above newMsg compiles only so).
		m.Headers = unsafe.Slice((*sarama.RecordHeader)(unsafe.Pointer(unsafe.SliceData(rec.Headers))), len(rec.Headers))
	default:
		m.Headers = make([]sarama.RecordHeader, 0, n)
		for _, h := range rec.Headers {
			m.Headers = append(m.Headers, sarama.RecordHeader{Key: h.Key, Value: h.Value})
		}
		m.Headers = append(m.Headers, extra...)
	}
	return om
}

// submit hands the produces of one record to their producers: all of them
// or, when one must wait, none.
func (r *Router) submit(ctx context.Context, rec *record.Record, msgs []*outMsg) error {
	st := r.signals()
	for _, m := range msgs {
		if st.ChannelPaused(m.ch.Name) {
			r.m.waits.WithLabelValues("paused").Inc()
			return &WaitError{Channel: m.ch.Name, Reason: "paused"}
		}
		if f := m.ds.failing.Load(); f != nil {
			r.m.waits.WithLabelValues("failing").Inc()
			return &WaitError{Channel: m.ch.Name, Reason: "failing",
				Err: fmt.Errorf("cluster %s topic %s failing since %s: %w", m.ch.Cluster, m.ch.Topic, f.since.Format(time.RFC3339), f.err)}
		}
	}
	for i, m := range msgs {
		var err error
		if r.txns.exactlyOnce(m.ch.Cluster) {
			if m.tp, err = r.txns.acquire(ctx, txnKeyOf(m.ch.Cluster, rec), ownerOf(rec), r.opts.OpenWait); err == nil {
				err = m.tp.place(ctx, m, r.opts.OpenWait)
			}
		} else {
			m.pr, err = r.pool.acquireFor(ctx, m.ch, r.opts.OpenWait)
		}
		if err != nil {
			for _, done := range msgs[:i] {
				if done.pr != nil {
					r.pool.release(done.pr, 1)
				}
			}
			if errors.Is(err, ctx.Err()) || errors.Is(err, errClosed) {
				return err
			}
			r.m.waits.WithLabelValues("opening").Inc()
			return &WaitError{Channel: m.ch.Name, Reason: "opening", Err: err}
		}
	}
	for i, m := range msgs {
		if !m.ds.enter(m.pr) {
			for _, done := range msgs[:i] {
				done.ds.inFlight.Add(-1)
			}
			for _, m := range msgs {
				if m.pr != nil {
					r.pool.release(m.pr, 1)
				}
			}
			r.m.waits.WithLabelValues("redefined").Inc()
			return &WaitError{Channel: m.ch.Name, Reason: "redefined",
				Err: fmt.Errorf("channel %s changed producer (cluster %s redefined, or its acks): its records wait until the %d produces inside the previous producer return",
					m.ch.Name, m.ch.Cluster, m.ds.inFlight.Load())}
		}
	}
	d := &msgs[0].own
	d.rec = rec
	d.pending.Store(int32(len(msgs)))
	now := time.Now()
	for i, m := range msgs {
		m.d, m.sent = d, now
		var err error
		switch {
		case m.tp == nil:
			err = r.send(m)
		case m.tp.covers(rec):
			// An earlier owner's transaction produced it: this owner
			// consumes it again from etcd's older position.
			r.skip(m)
			continue
		default:
			if err = m.tp.add(m); err != nil {
				// Its producer is fenced or being opened again.
				r.m.waits.WithLabelValues("failing").Inc()
				err = &WaitError{Channel: m.ch.Name, Reason: "failing", Err: err}
			}
		}
		if err != nil {
			// The record will not be acknowledged: its producer is
			// closing (the router is), or its exactly_once producer
			// failed (the agent offers it again). Neither waits on ctx.
			for _, rest := range msgs[i:] {
				r.settle(rest)
			}
			return err
		}
	}
	return nil
}

// enter counts a produce of ds through pr (nil: an exactly_once stream's)
// as in flight, and reports whether it may go. A destination's produces go
// through one producer at a time: a produce through another (its channel
// redefined with other acks, its cluster redefined, or
// moved between delivery modes) waits until every produce of the
// destination has returned, since each producer keeps only its own order:
// a record sent through the new producer would overtake an earlier record
// of its source partition that the previous one still holds or retries
// (chaos seed 51: the routes in force changed while the channel's cluster
// was down).
func (ds *destState) enter(pr *producer) bool {
	ds.enterMu.Lock()
	defer ds.enterMu.Unlock()
	if ds.sending != pr {
		if ds.inFlight.Load() > 0 {
			return false
		}
		ds.sending = pr
	}
	ds.inFlight.Add(1)
	return true
}

// settle forgets m, acknowledged or not: it no longer counts as in flight
// on its producer and destination.
func (r *Router) settle(m *outMsg) {
	if m.pr != nil {
		r.pool.release(m.pr, 1)
	}
	m.ds.inFlight.Add(-1)
}

// skip settles a produce to an exactly_once cluster that an earlier
// transaction made, as if it were acknowledged now.
func (r *Router) skip(m *outMsg) {
	r.m.skipped.Inc()
	r.settle(m)
	if m.d.pending.Add(-1) == 0 {
		r.ack(m.d.rec)
	}
}

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

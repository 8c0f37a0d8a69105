package kafka

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"
)

// The fetch path of the agents (docs/RELAY.md §2): one Fetcher per cluster
// consumed, one goroutine per source broker owning a dedicated Conn and
// sending multi-partition Fetch requests, each response decoded into one
// Chunk per partition that a FetchPartition queues for its consumer.

// FetchConfig tunes a Fetcher. The zero value of a field means its default.
type FetchConfig struct {
	// MaxWait is how long a broker may hold a fetch that has no record to
	// return (the request's MaxWaitTime). Default 250 ms. It must stay
	// below the client's Net.ReadTimeout.
	MaxWait time.Duration
	// PartitionMaxBytes bounds the bytes asked of one partition in one
	// request (Kafka's max.partition.fetch.bytes). Default 1 MiB. It is
	// doubled, up to 64 MiB, for a partition whose next batch came back
	// cut off, and reset after the batch.
	PartitionMaxBytes int32
	// MaxBytes bounds the bytes asked in one request. Default 16 MiB.
	MaxBytes int32
	// MaxPartitions bounds the partitions named in one request; which ones
	// rotates from request to request, so every partition is named in
	// turn. Default 32.
	MaxPartitions int
	// Budget bounds the bytes of the responses whose chunks are not yet
	// released, over every broker of the Fetcher (and over every Fetcher
	// sharing it). A broker's loop sends no request while the budget has
	// less than PartitionMaxBytes free; a response is charged whole when
	// it arrives (its size, or its records' when larger: compressed
	// batches, small records). A request asks for no more than the
	// budget has free (Free, scaled by the last response's weight
	// decoded), so the bytes held exceed the bound by about one batch
	// (KIP-74: a first batch larger than asked comes whole) per broker
	// loop. Default nil: unbounded.
	Budget Budget
	// RecordOverhead is what a record is charged beyond its key, value
	// and headers: the memory that the Fetcher and the consumer hold per
	// record while it is not released. Default 64 (the Fetcher's Record
	// and sarama's decoded record); a consumer that keeps more per record
	// says so here, so that the budget bounds memory for small records
	// too.
	RecordOverhead int
	// Logger receives the Fetcher's logs. Default zap.NewNop().
	Logger *zap.Logger
}

// Defaults of FetchConfig.
const (
	DefaultFetchMaxWait           = 250 * time.Millisecond
	DefaultFetchPartitionMaxBytes = 1 << 20
	DefaultFetchMaxBytes          = 16 << 20
	DefaultFetchMaxPartitions     = 32
	DefaultFetchRecordOverhead    = 64
)

// Backoffs of the fetch path: after a failed request or a partition error,
// and between metadata refreshes for partitions whose leader moved.
const (
	fetchRetryMin = 100 * time.Millisecond
	fetchRetryMax = time.Second
	// heldFactor × PartitionMaxBytes of unreleased chunks leaves a
	// partition out of requests: a slow consumer stalls only its own.
	heldFactor = 2
)

// DefaultFetchConfig returns the defaults, filled in.
func DefaultFetchConfig() FetchConfig {
	return FetchConfig{MaxWait: DefaultFetchMaxWait, PartitionMaxBytes: DefaultFetchPartitionMaxBytes,
		MaxBytes: DefaultFetchMaxBytes, MaxPartitions: DefaultFetchMaxPartitions, RecordOverhead: DefaultFetchRecordOverhead}
}

func (c FetchConfig) withDefaults() FetchConfig {
	d := DefaultFetchConfig()
	if c.MaxWait == 0 {
		c.MaxWait = d.MaxWait
	}
	if c.PartitionMaxBytes == 0 {
		c.PartitionMaxBytes = d.PartitionMaxBytes
	}
	if c.MaxBytes == 0 {
		c.MaxBytes = d.MaxBytes
	}
	if c.MaxPartitions == 0 {
		c.MaxPartitions = d.MaxPartitions
	}
	if c.RecordOverhead == 0 {
		c.RecordOverhead = d.RecordOverhead
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return c
}

// Validate checks c with its defaults filled in.
func (c FetchConfig) Validate() error {
	c = c.withDefaults()
	switch {
	case c.MaxWait < 0 || c.MaxWait > time.Duration(math.MaxInt32)*time.Millisecond:
		return fmt.Errorf("kafka: fetch MaxWait %v is out of range", c.MaxWait)
	case c.PartitionMaxBytes < 0 || c.PartitionMaxBytes > fetchMaxBytesCap:
		return fmt.Errorf("kafka: fetch PartitionMaxBytes %d is not within 1..%d", c.PartitionMaxBytes, fetchMaxBytesCap)
	case c.MaxBytes < c.PartitionMaxBytes:
		return fmt.Errorf("kafka: fetch MaxBytes %d is below PartitionMaxBytes %d", c.MaxBytes, c.PartitionMaxBytes)
	case c.MaxPartitions < 0:
		return fmt.Errorf("kafka: fetch MaxPartitions %d is negative", c.MaxPartitions)
	case c.RecordOverhead < 0:
		return fmt.Errorf("kafka: fetch RecordOverhead %d is negative", c.RecordOverhead)
	}
	return nil
}

// Budget bounds bytes held, shared by goroutines: every method is safe for
// concurrent use and none blocks. ByteBudget implements it.
type Budget interface {
	// Charge takes n bytes, beyond the bound if need be.
	Charge(n int64)
	// Give gives n bytes back.
	Give(n int64)
	// Room returns nil when at least n bytes are free; otherwise a channel
	// closed by a later Give (which may not free n bytes: ask again).
	Room(n int64) <-chan struct{}
	// Free returns the bytes free now (0 or less when none are): a
	// request asks for no more, on the wire, than Free divided by how
	// much more the last response weighed decoded.
	Free() int64
}

// ByteBudget is a Budget of max bytes.
type ByteBudget struct {
	max     int64
	used    atomic.Int64
	waiting atomic.Bool // a Room found too little since the last Give
	mu      sync.Mutex
	room    chan struct{} // closed by the next Give after a Room found too little
}

// NewByteBudget returns a budget of max bytes.
func NewByteBudget(max int64) *ByteBudget { return &ByteBudget{max: max} }

// Charge implements Budget.
func (b *ByteBudget) Charge(n int64) { b.used.Add(n) }

// Give implements Budget.
func (b *ByteBudget) Give(n int64) {
	b.used.Add(-n)
	if !b.waiting.Load() {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.waiting.Store(false)
	if b.room != nil {
		close(b.room)
		b.room = nil
	}
}

// Room implements Budget.
func (b *ByteBudget) Room(n int64) <-chan struct{} {
	if b.used.Load()+n <= b.max {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.room == nil {
		b.room = make(chan struct{})
	}
	b.waiting.Store(true)
	// A Give between the first look and waiting's store found nobody
	// waiting: look again, now that a Give will close room.
	if b.used.Load()+n <= b.max {
		return nil
	}
	return b.room
}

// Free implements Budget.
func (b *ByteBudget) Free() int64 { return b.max - b.used.Load() }

// InUse returns the bytes charged and not given back.
func (b *ByteBudget) InUse() int64 { return b.used.Load() }

// Max returns the bound.
func (b *ByteBudget) Max() int64 { return b.max }

// FetchStats are a Fetcher's counters since it was made.
type FetchStats struct {
	// Requests is the number of Fetch requests answered.
	Requests int64
	// Throttled is the time brokers asked the Fetcher to wait (the
	// responses' ThrottleTime), summed.
	Throttled time.Duration
	// Errors counts failed requests (transport errors, timeouts) and
	// partition errors other than leader moves.
	Errors int64
	// Moves counts partitions sent to look for their leader again.
	Moves int64
}

// Fetcher consumes partitions of one cluster with Fetch requests of its
// own: per source broker a goroutine owning a dedicated Conn sends one
// request at a time (read_committed, MinBytes 1), naming up to
// MaxPartitions of its ready partitions, in rotation. Partitions move
// between brokers as their leaders do; a hung broker stalls only its own.
//
// It uses the sarama.Client it is given for metadata only (leaders and
// their epochs, refreshes), and its Config for the connections (TLS, SASL,
// dialer or proxy, timeouts). The client must outlive the Fetcher.
type Fetcher struct {
	name    string
	client  sarama.Client
	conf    *sarama.Config
	cfg     FetchConfig
	log     *zap.Logger
	ceiling int16 // FetchVersion of the cluster's configured version

	ctx       context.Context
	cancel    context.CancelFunc
	loops     sync.WaitGroup // the broker loops, waited for by Close
	moverDone chan struct{}  // closed when the mover returned
	done      chan struct{}  // closed when every goroutine returned
	moverKick chan struct{}

	requests  atomic.Int64
	throttled atomic.Int64 // nanoseconds
	// inflation is the last response's charge per byte on the wire
	// (float64 bits, at least 1): compressed batches, and every record's
	// RecordOverhead, make the records weigh more than the response.
	inflation atomic.Uint64
	errs      atomic.Int64
	moves     atomic.Int64

	mu       sync.Mutex
	closed   bool
	brokers  map[int32]*fetchBroker
	homeless map[*FetchPartition]bool // waiting for a leader: value true when metadata must be refreshed first
	active   map[fetchTP]*FetchPartition
}

type fetchTP struct {
	topic     string
	partition int32
}

// NewFetcher returns a Fetcher of the cluster named name (for logs and
// errors) that client connects to. It starts the goroutine that finds
// partitions their leaders; broker goroutines start with their first
// partition. Close stops them.
func NewFetcher(name string, client sarama.Client, cfg FetchConfig) (*Fetcher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("kafka: cluster %s: %w", name, err)
	}
	cfg = cfg.withDefaults()
	conf := client.Config()
	if conf.Net.ReadTimeout <= cfg.MaxWait {
		return nil, fmt.Errorf("kafka: cluster %s: fetch MaxWait %v must be below Net.ReadTimeout %v, or every long poll times out", name, cfg.MaxWait, conf.Net.ReadTimeout)
	}
	ctx, cancel := context.WithCancel(context.Background())
	f := &Fetcher{name: name, client: client, conf: conf, cfg: cfg, ceiling: FetchVersion(conf.Version),
		log: cfg.Logger.With(zap.String("cluster", name)), ctx: ctx, cancel: cancel,
		moverDone: make(chan struct{}), done: make(chan struct{}), moverKick: make(chan struct{}, 1),
		brokers: map[int32]*fetchBroker{}, homeless: map[*FetchPartition]bool{}, active: map[fetchTP]*FetchPartition{}}
	go f.mover()
	go func() {
		<-f.moverDone
		f.loops.Wait()
		close(f.done)
	}()
	return f, nil
}

// ErrFetcherClosed is returned by ConsumePartition after Close.
var ErrFetcherClosed = errors.New("kafka: the fetcher is closed")

// ConsumePartition starts fetching topic/partition at offset (>= 0: the
// caller resolves OffsetOldest and OffsetNewest). It does not wait for the
// network: the partition joins its leader's requests once the leader is
// known. A partition is consumed once at a time: it fails while a previous
// FetchPartition of it is neither closed nor ended.
func (f *Fetcher) ConsumePartition(topic string, partition int32, offset int64) (*FetchPartition, error) {
	if offset < 0 {
		return nil, fmt.Errorf("kafka: cluster %s: fetch %s/%d at %d: resolve the offset first", f.name, topic, partition, offset)
	}
	p := &FetchPartition{f: f, topic: topic, partition: partition, offset: offset, maxBytes: f.cfg.PartitionMaxBytes,
		ready: make(chan struct{}, 1), done: make(chan struct{})}
	p.hwm.Store(-1)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return nil, ErrFetcherClosed
	}
	tp := fetchTP{topic, partition}
	if old := f.active[tp]; old != nil && !old.stopped.Load() {
		return nil, fmt.Errorf("kafka: cluster %s: %s/%d is already being fetched: close it first", f.name, topic, partition)
	}
	f.active[tp] = p
	f.homeless[p] = false
	kick(f.moverKick)
	return p, nil
}

// Stats returns the Fetcher's counters.
func (f *Fetcher) Stats() FetchStats {
	return FetchStats{Requests: f.requests.Load(), Throttled: time.Duration(f.throttled.Load()), Errors: f.errs.Load(), Moves: f.moves.Load()}
}

// Close stops fetching and closes every partition (their queued chunks
// released). It closes the broker connections, so it does not wait for
// responses in flight, and waits only for the broker goroutines, which
// then return at once (but for a dial through a Dialer that takes no
// context, Options.Dialer: it ends within that dialer's own timeout). A
// metadata refresh in flight is not waited for: it ends within the
// client's Metadata.Timeout, and Done is closed then. Safe to call more
// than once.
func (f *Fetcher) Close() {
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return
	}
	f.closed = true
	parts := make([]*FetchPartition, 0, len(f.active))
	for _, p := range f.active {
		parts = append(parts, p)
	}
	f.mu.Unlock()
	f.cancel()
	for _, p := range parts {
		p.Close()
	}
	f.loops.Wait()
}

// Done is closed once every goroutine of the Fetcher has returned, after
// Close.
func (f *Fetcher) Done() <-chan struct{} { return f.done }

// homeward hands p, which left its broker (or never had one), to the mover
// to find its leader; refresh asks for fresh metadata first.
func (f *Fetcher) homeward(p *FetchPartition, refresh bool) {
	f.moves.Add(1)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed || p.stopped.Load() {
		return
	}
	f.homeless[p] = f.homeless[p] || refresh
	kick(f.moverKick)
}

// mover finds the leaders of the partitions that have none: after a leader
// move or a broker failure, with a metadata refresh, coalesced and at most
// one per fetchRetryMin; new partitions from the client's cache.
func (f *Fetcher) mover() {
	defer close(f.moverDone)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	var lastRefresh time.Time
	for {
		select {
		case <-f.ctx.Done():
			return
		case <-f.moverKick:
		case <-timer.C:
		}
		f.mu.Lock()
		if f.closed {
			f.mu.Unlock()
			return
		}
		var topics []string
		seen := map[string]bool{}
		parts := make([]*FetchPartition, 0, len(f.homeless))
		var stale []*FetchPartition // waiting for a refresh
		for p, refresh := range f.homeless {
			if refresh {
				stale = append(stale, p)
				if !seen[p.topic] {
					seen[p.topic] = true
					topics = append(topics, p.topic)
				}
				continue
			}
			parts = append(parts, p)
		}
		f.mu.Unlock()
		var next time.Time
		if wait := fetchRetryMin - time.Since(lastRefresh); len(topics) > 0 && wait > 0 {
			// Refreshed less than fetchRetryMin ago: the others are
			// placed now, these at the next refresh.
			next = time.Now().Add(wait)
		} else if len(topics) > 0 {
			lastRefresh = time.Now()
			if err := f.client.RefreshMetadata(topics...); err != nil {
				f.log.Debug("metadata refresh for partitions without a leader failed", zap.Strings("topics", topics), zap.Error(err))
			}
			f.mu.Lock()
			for _, p := range stale {
				if _, ok := f.homeless[p]; ok {
					f.homeless[p] = false
				}
			}
			f.mu.Unlock()
			parts = append(parts, stale...)
		}
		for _, p := range parts {
			if wake := f.place(p); !wake.IsZero() && (next.IsZero() || wake.Before(next)) {
				next = wake
			}
		}
		if !next.IsZero() {
			timer.Reset(time.Until(next))
		}
	}
}

// place assigns homeless p to its leader's broker loop, or returns when to
// try again.
func (f *Fetcher) place(p *FetchPartition) (retryAt time.Time) {
	if p.stopped.Load() {
		f.mu.Lock()
		delete(f.homeless, p)
		f.mu.Unlock()
		return time.Time{}
	}
	now := time.Now()
	if now.Before(p.notBefore) {
		return p.notBefore
	}
	leader, epoch, err := f.client.LeaderAndEpoch(p.topic, p.partition)
	if err != nil {
		p.failures++
		p.notBefore = now.Add(backoff(p.failures))
		f.log.Debug("no leader for partition yet", zap.String("topic", p.topic), zap.Int32("partition", p.partition), zap.Error(err))
		f.mu.Lock()
		if _, ok := f.homeless[p]; ok {
			f.homeless[p] = true
		}
		f.mu.Unlock()
		return p.notBefore
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return time.Time{}
	}
	if refresh, ok := f.homeless[p]; !ok || refresh {
		// Stopped meanwhile, or failed again: the next round.
		return time.Time{}
	}
	delete(f.homeless, p)
	b := f.brokers[leader.ID()]
	if b == nil {
		b = &fetchBroker{f: f, id: leader.ID(), kick: make(chan struct{}, 1)}
		f.brokers[b.id] = b
		f.loops.Add(1)
		go b.run()
	}
	b.mu.Lock()
	b.addr = leader.Addr()
	p.epoch = epoch
	b.parts = append(b.parts, p)
	b.mu.Unlock()
	p.broker.Store(b)
	kick(b.kick)
	return time.Time{}
}

func backoff(failures int) time.Duration {
	d := fetchRetryMin
	for i := 1; i < failures && d < fetchRetryMax; i++ {
		d *= 2
	}
	return min(d, fetchRetryMax)
}

// kick wakes the owner of ch, a 1-buffered channel, unless already woken.
func kick(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// fetchBroker is the loop of one source broker: the only goroutine that
// sends requests on its Conn and the owner of its partitions' fetch
// state while they are assigned to it.
type fetchBroker struct {
	f    *Fetcher
	id   int32
	kick chan struct{}

	mu     sync.Mutex
	addr   string
	parts  []*FetchPartition
	cursor int // where the next request's partitions start
}

func (b *fetchBroker) run() {
	f := b.f
	defer f.loops.Done()
	log := f.log.With(zap.Int32("broker", b.id))
	var conn *Conn
	defer func() {
		if conn != nil {
			conn.Close()
		}
	}()
	var version int16
	failures := 0
	for f.ctx.Err() == nil {
		parts, wake := b.pick()
		if len(parts) == 0 {
			b.sleep(wake, nil)
			continue
		}
		if f.cfg.Budget != nil {
			if room := f.cfg.Budget.Room(int64(f.cfg.PartitionMaxBytes)); room != nil {
				b.sleep(time.Time{}, room)
				continue
			}
		}
		if conn == nil {
			b.mu.Lock()
			addr := b.addr
			b.mu.Unlock()
			var err error
			if conn, err = DialConn(f.ctx, f.conf, addr); err == nil {
				if version, err = conn.Negotiate(APIKeyFetch, f.ceiling, 4); err != nil {
					conn.Close()
					conn = nil
					log.Error("cannot fetch from broker", zap.Error(err))
					b.endAll(err)
					continue
				}
				log.Info("fetch connection opened", zap.String("addr", addr), zap.Int16("fetch_version", version), zap.Int16("ceiling", f.ceiling))
			}
			if err != nil {
				conn = nil
				if f.ctx.Err() != nil {
					return // closed while dialling
				}
				failures++
				b.failed(log, err, failures)
				continue
			}
		}
		req := b.request(version, parts, f.maxBytes())
		before := conn.BytesRead()
		resp, err := conn.Broker().Fetch(req)
		if err != nil {
			conn.Close()
			conn = nil
			if f.ctx.Err() != nil {
				return
			}
			failures++
			b.failed(log, err, failures)
			continue
		}
		f.requests.Add(1)
		if resp.ErrorCode != 0 {
			// A request-level error (v7+: fetch sessions, which we
			// do not open; or the broker shutting down) answers no
			// partition: back off as after a failed request.
			failures++
			b.failed(log, fmt.Errorf("broker %d: %w", b.id, sarama.KError(resp.ErrorCode)), failures)
			continue
		}
		failures = 0
		b.handle(log, parts, resp, conn.BytesRead()-before)
		if t := resp.ThrottleTime; t > 0 {
			// sarama delays the next request on this connection by
			// this much, holding the broker's lock; wait here, where
			// Close interrupts the wait, so that sarama finds the time
			// over.
			f.throttled.Add(int64(t))
			b.wait(t)
		}
	}
}

// sleep waits for a kick, the end of the Fetcher, until (if not zero) or
// ch (if not nil).
func (b *fetchBroker) sleep(until time.Time, ch <-chan struct{}) {
	var tc <-chan time.Time
	if !until.IsZero() {
		t := time.NewTimer(time.Until(until))
		defer t.Stop()
		tc = t.C
	}
	select {
	case <-b.f.ctx.Done():
	case <-b.kick:
	case <-tc:
	case <-ch:
	}
}

// failed handles a request that failed as a whole: every partition of the
// broker goes back to the mover (the leader may have moved to a broker we
// can reach), and the loop waits out its backoff before it connects again.
func (b *fetchBroker) failed(log *zap.Logger, err error, failures int) {
	b.f.errs.Add(1)
	d := backoff(failures)
	log.Warn("fetch failed; its partitions look for their leader again", zap.Error(err), zap.Int("failures", failures), zap.Duration("backoff", d))
	b.mu.Lock()
	parts := b.parts
	b.parts, b.cursor = nil, 0
	b.mu.Unlock()
	for _, p := range parts {
		p.broker.Store(nil)
		b.f.homeward(p, true)
	}
	b.wait(d)
}

// wait waits for d or the end of the Fetcher, whatever the kicks.
func (b *fetchBroker) wait(d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-b.f.ctx.Done():
	case <-t.C:
	}
}

// endAll ends every partition of the broker with err.
func (b *fetchBroker) endAll(err error) {
	b.mu.Lock()
	parts := b.parts
	b.parts, b.cursor = nil, 0
	b.mu.Unlock()
	for _, p := range parts {
		p.end(fmt.Errorf("kafka: cluster %s: fetch %s/%d: %w", b.f.name, p.topic, p.partition, err))
	}
}

// pick returns the partitions of the next request: up to MaxPartitions of
// the ready ones (not paused, not holding too many unreleased chunks, not
// backing off after an error), starting after the last one picked. With
// none ready it returns when the earliest backoff ends (zero: none).
func (b *fetchBroker) pick() (parts []*FetchPartition, wake time.Time) {
	f := b.f
	now := time.Now()
	b.mu.Lock()
	defer b.mu.Unlock()
	kept := b.parts[:0]
	for i, p := range b.parts {
		if p.stopped.Load() {
			if i < b.cursor {
				b.cursor--
			}
			p.broker.Store(nil)
			continue
		}
		kept = append(kept, p)
	}
	clear(b.parts[len(kept):])
	b.parts = kept
	n := len(b.parts)
	if b.cursor >= n {
		b.cursor = 0
	}
	limit := int64(heldFactor) * int64(f.cfg.PartitionMaxBytes)
	last := -1
	for i := range n {
		j := (b.cursor + i) % n
		p := b.parts[j]
		switch {
		case p.paused.Load() || p.held.Load() >= limit:
		case now.Before(p.notBefore):
			if wake.IsZero() || p.notBefore.Before(wake) {
				wake = p.notBefore
			}
		default:
			parts = append(parts, p)
			last = j
		}
		if len(parts) == f.cfg.MaxPartitions {
			break
		}
	}
	if last >= 0 {
		b.cursor = (last + 1) % n
	}
	return parts, wake
}

// maxBytes is the MaxBytes of the next request: MaxBytes, cut to what
// the budget has free (Room found PartitionMaxBytes free before the
// request) divided by the last response's inflation, so that the
// response's charge fits: MaxBytes bounds the bytes on the wire, and a
// compressed response can weigh many times more once decoded (zeros: 15
// times). Asking for MaxBytes whatever the budget held let one response
// overshoot the budget by up to MaxBytes (default 16 MiB; the agent's is
// a quarter of its budget), times its inflation. At least 1 byte: a
// broker returns the first batch whole whatever the bound (KIP-74).
func (f *Fetcher) maxBytes() int32 {
	if f.cfg.Budget == nil {
		return f.cfg.MaxBytes
	}
	free := float64(f.cfg.Budget.Free())
	if bits := f.inflation.Load(); bits != 0 {
		free /= math.Float64frombits(bits)
	}
	return int32(max(min(free, float64(f.cfg.MaxBytes)), 1))
}

// request builds the Fetch of parts. The request holds each partition
// once: ConsumePartition refuses a second FetchPartition of a partition
// until the first is stopped, and pick drops stopped ones.
func (b *fetchBroker) request(version int16, parts []*FetchPartition, maxBytes int32) *sarama.FetchRequest {
	cfg := b.f.cfg
	req := &sarama.FetchRequest{
		Version:      version,
		MaxWaitTime:  int32(cfg.MaxWait / time.Millisecond),
		MinBytes:     1,
		MaxBytes:     maxBytes,
		Isolation:    sarama.ReadCommitted,
		SessionID:    0,
		SessionEpoch: -1, // no fetch session
	}
	for _, p := range parts {
		req.AddBlock(p.topic, p.partition, p.offset, p.maxBytes, p.epoch)
	}
	return req
}

// handle applies a response of size bytes to the partitions it answers.
func (b *fetchBroker) handle(log *zap.Logger, parts []*FetchPartition, resp *sarama.FetchResponse, size int64) {
	f := b.f
	ref := &fetchResponse{budget: f.cfg.Budget, size: size}
	ref.refs.Store(1)
	if ref.budget != nil {
		ref.budget.Charge(size)
	}
	// The records of a compressed batch slice its decompressed buffer,
	// not the response: the response is charged the larger of its size
	// and its records' (the chunks hold the last reference until the
	// loop is done with the response, so the size may still change).
	var decoded int64
	defer func() {
		if extra := decoded - ref.size; extra > 0 && ref.budget != nil {
			ref.budget.Charge(extra)
			ref.size = decoded
		}
		if decoded > 0 && size > 0 {
			f.inflation.Store(math.Float64bits(max(1, float64(decoded)/float64(size))))
		}
		ref.unref()
	}()
	for _, p := range parts {
		block := resp.GetBlock(p.topic, p.partition)
		if block == nil {
			continue // not answered: in the next request again
		}
		switch err := block.Err; {
		case errors.Is(err, sarama.ErrNoError):
			p.failures = 0
			decoded += b.accept(p, block, ref)
		case errors.Is(err, sarama.ErrOffsetOutOfRange):
			b.remove(p)
			p.end(fmt.Errorf("kafka: cluster %s: fetch %s/%d at %d (log %d-%d): %w", f.name, p.topic, p.partition, p.offset, block.LogStartOffset, block.HighWaterMarkOffset, err))
		case leaderMoved(err):
			log.Debug("partition moves", zap.String("topic", p.topic), zap.Int32("partition", p.partition), zap.Error(err))
			b.remove(p)
			b.f.homeward(p, true)
		default:
			f.errs.Add(1)
			p.failures++
			p.notBefore = time.Now().Add(backoff(p.failures))
			log.Warn("partition fetch error; retrying", zap.String("topic", p.topic), zap.Int32("partition", p.partition),
				zap.Int64("offset", p.offset), zap.Error(err), zap.Int("failures", p.failures))
		}
	}
}

// leaderMoved reports whether a partition error says to look for the
// partition's leader again.
func leaderMoved(err error) bool {
	return errors.Is(err, sarama.ErrNotLeaderForPartition) ||
		errors.Is(err, sarama.ErrFencedLeaderEpoch) ||
		errors.Is(err, sarama.ErrUnknownLeaderEpoch) ||
		errors.Is(err, sarama.ErrLeaderNotAvailable) ||
		errors.Is(err, sarama.ErrReplicaNotAvailable) ||
		errors.Is(err, sarama.ErrUnknownTopicOrPartition) ||
		errors.Is(err, sarama.ErrKafkaStorageError) ||
		errors.Is(err, sarama.ErrOffsetNotAvailable)
}

// remove takes p out of the broker's partitions.
func (b *fetchBroker) remove(p *FetchPartition) {
	b.mu.Lock()
	for i, q := range b.parts {
		if q == p {
			b.parts = append(b.parts[:i], b.parts[i+1:]...)
			if i < b.cursor {
				b.cursor--
			}
			break
		}
	}
	b.mu.Unlock()
	p.broker.Store(nil)
}

// accept decodes p's block and queues its records; it returns their size.
func (b *fetchBroker) accept(p *FetchPartition, block *sarama.FetchResponseBlock, ref *fetchResponse) int64 {
	p.hwm.Store(block.HighWaterMarkOffset)
	recs, next := DecodeBlockInto(block, p.offset, math.MaxInt64, nil)
	if next == p.offset {
		if partialBlock(block) {
			if p.maxBytes >= fetchMaxBytesCap {
				b.remove(p)
				p.end(fmt.Errorf("kafka: cluster %s: fetch %s/%d at %d: record batch larger than %d bytes", b.f.name, p.topic, p.partition, p.offset, p.maxBytes))
				return 0
			}
			p.maxBytes = min(2*p.maxBytes, fetchMaxBytesCap)
		}
		return 0
	}
	p.maxBytes = b.f.cfg.PartitionMaxBytes
	if len(recs) == 0 {
		p.offset = next // control records, aborted ones, compaction gaps
		return 0
	}
	held := recordsSize(recs)
	c := &Chunk{Records: recs, Next: next, HighWaterMark: block.HighWaterMarkOffset, p: p, resp: ref,
		size: held + int64(len(recs))*int64(b.f.cfg.RecordOverhead-DefaultFetchRecordOverhead), held: held}
	ref.refs.Add(1)
	if !p.enqueue(c) {
		// Paused or stopped meanwhile: dropped, fetched again from
		// the same offset after a resume.
		ref.unref()
		return 0
	}
	p.offset = next
	return c.size
}

// recordsSize is what recs weigh to the Fetcher: their keys, values and
// headers, and DefaultFetchRecordOverhead each.
func recordsSize(recs []Record) int64 {
	const overhead = DefaultFetchRecordOverhead
	n := int64(0)
	for i := range recs {
		r := &recs[i]
		n += overhead + int64(len(r.Key)+len(r.Value))
		for _, h := range r.Headers {
			if h != nil {
				n += int64(len(h.Key) + len(h.Value))
			}
		}
	}
	return n
}

// fetchResponse counts the chunks of one response not yet released; the
// last release gives the response's bytes back to the budget.
type fetchResponse struct {
	budget Budget
	size   int64
	refs   atomic.Int32
}

func (r *fetchResponse) unref() {
	if r.refs.Add(-1) == 0 && r.budget != nil {
		r.budget.Give(r.size)
	}
}

// Chunk is the records of one partition from one response, in offset
// order. Its records' keys, values and headers are slices of the response:
// the bytes of the whole response count against the Fetcher's Budget until
// every chunk of it is released. Release drops Records, so that a chunk
// kept after it does not keep the response; the keys, values and headers
// taken from them stay valid (and keep the response's memory while they
// are held).
type Chunk struct {
	// Records holds at least one record.
	Records []Record
	// Next is the partition's fetch position after the chunk: the offset
	// after its last batch, past the last record when the batch ended
	// with records not passed on (transaction markers, aborted records).
	Next int64
	// HighWaterMark is the partition's high watermark in the response.
	HighWaterMark int64

	p    *FetchPartition
	resp *fetchResponse
	// size is what the chunk is charged against the Budget (RecordOverhead
	// a record); held what it counts against its partition's
	// heldFactor × PartitionMaxBytes (DefaultFetchRecordOverhead a record:
	// a byte count of the fetch's, as PartitionMaxBytes is, so that a
	// consumer's larger overhead does not shrink each partition's share).
	size, held int64
	released   atomic.Bool
}

// Release tells the Fetcher the consumer is done with the chunk, and
// drops Records: read them before. Calling it again does nothing. Safe
// from any goroutine.
func (c *Chunk) Release() {
	if c.released.Swap(true) {
		return
	}
	c.Records = nil
	limit := int64(heldFactor) * int64(c.p.f.cfg.PartitionMaxBytes)
	if after := c.p.held.Add(-c.held); after < limit && after+c.held >= limit {
		if b := c.p.broker.Load(); b != nil {
			kick(b.kick)
		}
	}
	c.resp.unref()
}

// FetchPartition is the fetching of one partition, from ConsumePartition
// until Close or until it ends on its own (Err). Its records come as
// Chunks, queued in offset order: Ready signals that Poll has chunks to
// take, or that the partition ended. Its methods are safe for concurrent
// use; none waits on the network.
type FetchPartition struct {
	f         *Fetcher
	topic     string
	partition int32
	ready     chan struct{}
	done      chan struct{}

	hwm     atomic.Int64
	held    atomic.Int64 // the size of the chunks queued or polled, not released
	paused  atomic.Bool
	stopped atomic.Bool                 // closed or ended
	broker  atomic.Pointer[fetchBroker] // the loop it is assigned to, nil while homeless

	// Fetch state, owned by the loop the partition is assigned to or by
	// the mover while it has none (handed over under Fetcher.mu and
	// fetchBroker.mu).
	offset    int64
	maxBytes  int32
	epoch     int32
	failures  int
	notBefore time.Time

	mu     sync.Mutex
	queue  []*Chunk
	err    error
	closed bool
}

// Topic returns the partition's topic.
func (p *FetchPartition) Topic() string { return p.topic }

// Partition returns the partition's number.
func (p *FetchPartition) Partition() int32 { return p.partition }

// Ready receives a value when chunks were queued or the partition ended
// since the last Poll (at most one value is pending).
func (p *FetchPartition) Ready() <-chan struct{} { return p.ready }

// Done is closed when the partition ends on its own or is closed.
func (p *FetchPartition) Done() <-chan struct{} { return p.done }

// Poll appends the queued chunks to dst, in offset order, and returns it.
// When none is queued and the partition ended on its own, it returns why
// (Err); every chunk queued before the end is returned first. The caller
// owns the chunks returned and must Release each, also after Close.
func (p *FetchPartition) Poll(dst []*Chunk) ([]*Chunk, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.queue) == 0 {
		return dst, p.err
	}
	dst = append(dst, p.queue...)
	clear(p.queue)
	p.queue = p.queue[:0]
	return dst, nil
}

// Err returns why the partition ended on its own: an error satisfying
// errors.Is(err, sarama.ErrOffsetOutOfRange) when its fetch position left
// the log (retention, deletion, or a start beyond the end); a batch too
// large to fetch; a broker below the protocol floor. Nil while it runs.
func (p *FetchPartition) Err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// HighWaterMark returns the partition's high watermark as of the latest
// response, -1 before the first.
func (p *FetchPartition) HighWaterMark() int64 { return p.hwm.Load() }

// Pause leaves the partition out of requests until Resume. Chunks already
// queued stay queued; a response in flight when Pause is called queues
// nothing (its records are fetched again after Resume), so no chunk is
// queued between Pause and Resume. Other partitions keep flowing.
func (p *FetchPartition) Pause() {
	p.mu.Lock()
	p.paused.Store(true)
	p.mu.Unlock()
}

// Resume undoes Pause: the partition fetches on from its position.
func (p *FetchPartition) Resume() {
	p.paused.Store(false)
	if b := p.broker.Load(); b != nil {
		kick(b.kick)
	}
}

// Close stops fetching the partition at once and releases the chunks
// queued; a response in flight for it is dropped when it arrives. Chunks
// taken by Poll are the caller's to Release. Safe to call more than once.
func (p *FetchPartition) Close() {
	p.mu.Lock()
	if p.closed || p.stopped.Load() {
		p.closed = true
		p.mu.Unlock()
		p.releaseQueued()
		return
	}
	p.closed = true
	p.stopped.Store(true)
	close(p.done)
	p.mu.Unlock()
	p.releaseQueued()
	if b := p.broker.Load(); b != nil {
		kick(b.kick) // drops it from its list, so a restart is not refused
	}
}

func (p *FetchPartition) releaseQueued() {
	p.mu.Lock()
	q := p.queue
	p.queue = nil
	p.mu.Unlock()
	for _, c := range q {
		c.Release()
	}
}

// enqueue queues c, unless the partition is paused or stopped.
func (p *FetchPartition) enqueue(c *Chunk) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped.Load() || p.paused.Load() {
		return false
	}
	p.held.Add(c.held)
	p.queue = append(p.queue, c)
	kick(p.ready)
	return true
}

// end ends the partition on its own with err.
func (p *FetchPartition) end(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped.Load() {
		return
	}
	p.err = err
	p.stopped.Store(true)
	close(p.done)
	kick(p.ready)
}

package kafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
)

// The idempotent producer of docs/RELAY.md §3, on sarama's protocol layer:
// a sink goroutine per destination broker sends ProduceRequests (one v2
// RecordBatch per partition) on a connection of its own, up to
// MaxInFlight requests at a time; a resolver goroutine finds leaders and
// bumps the producer id when a partition's sequence is lost. Batches keep
// their sequence across resends and there is no retry limit: a record is
// reported acknowledged or refused for good, in order per partition, or
// not at all (Close).

// Message is one record to produce. The Producer keeps the pointer and
// reads Key, Value and Headers when it encodes a request: the caller must
// not change them until the message is reported.
type Message struct {
	Topic     string
	Partition int32
	Key       []byte
	Value     []byte
	Headers   []sarama.RecordHeader
	// Timestamp is the record's create time, in milliseconds on the wire;
	// the zero time means when Produce is called.
	Timestamp time.Time
	// Codec compresses the batch the message is in: messages of one
	// partition with different codecs go in different batches, in order.
	Codec sarama.CompressionCodec
	// CompressionLevel is the codec's level; 0 means the codec's default.
	CompressionLevel int
	// Ref is the caller's; the Producer does not touch it.
	Ref any
}

// ProduceHandler receives the outcome of every message given to a
// Producer. Its methods are called from the Producer's sink goroutines,
// never concurrently for one partition, and for each partition in the
// order the messages were given. They must not block (hand work to a
// queue) and must not call Flush or Close; they may call Produce.
type ProduceHandler interface {
	// Acked reports msgs, consecutive messages of one partition,
	// written at offsets offset, offset+1, ... offset is -1 when the
	// broker answered DUPLICATE_SEQUENCE_NUMBER (it had them, at an
	// offset it did not say).
	Acked(msgs []*Message, offset int64)
	// Refused reports m refused for good by its destination: a single
	// record too large for the topic, or invalid (err is or wraps the
	// sarama.KError). Nothing of it was written, unless err says it may
	// have been (a resend refused after an earlier send of it went
	// unanswered); the messages after it are not affected.
	Refused(m *Message, err error)
}

// UnfinishedHandler is implemented by a ProduceHandler that wants to be
// told, at Close, of the messages that were neither acknowledged nor
// refused: they may or may not have been written.
type UnfinishedHandler interface {
	Unfinished(msgs []*Message)
}

// ErrProducerClosed is returned by Produce after Close.
var ErrProducerClosed = errors.New("kafka: producer closed")

// ProducerStats counts what a Producer did besides sending.
type ProducerStats struct {
	Bumps       int64 // new producer ids after a lost sequence (drain-and-bump)
	Duplicates  int64 // batches answered DUPLICATE_SEQUENCE_NUMBER
	Splits      int64 // batches split after MESSAGE_TOO_LARGE or a refusal
	Refused     int64 // messages refused for good
	Retries     int64 // rounds of a partition's batches sent again
	Reconnected int64 // broker connections opened after the first

	// BumpsDelayed counts bumps wanted within BumpInterval of the one
	// before, which waited for it: a broker that keeps losing producer
	// state.
	BumpsDelayed int64
}

// Stall is what Stalled reports about a topic whose records wait.
type Stall struct {
	// Since is when the longest-waiting partition last had a batch
	// acknowledged, or when its records started waiting.
	Since time.Time
	// Err is that partition's last error, nil if none.
	Err error
}

// topicPartition names a destination partition.
type topicPartition struct {
	topic     string
	partition int32
}

// partState is a destination partition's producing state, under
// Producer.mu.
type partState struct {
	topicPartition
	// sink is the partition leader's; nil while the resolver looks it
	// up (then nothing of the partition is in flight).
	sink *sink
	open *batch // filling; never sent
	// queue holds sealed batches in order; its first ones may carry a
	// sequence (sent before, to be sent again).
	queue []*batch
	// inflight are the batches sent in the current round, in sequence
	// order; unanswered how many of them have no answer yet.
	inflight   []*batch
	unanswered int
	// failed: the round's head was not acknowledged; the answers of
	// the batches behind it decide nothing, and the round's batches go
	// back to the queue once every one is answered.
	failed bool
	// refresh: look the leader up again once the round drained.
	refresh bool
	// gate: one batch at a time until one is acknowledged (a new
	// leader, or a resend round).
	gate     bool
	retryAt  time.Time
	retries  int
	nextSeq  int32
	pending  int       // messages given and not yet reported
	since    time.Time // see Stall.Since; zero when nothing waits
	lastErr  error
	reported int // reports being made outside the lock: the partition does not move meanwhile
	// txn is the transactional stream the partition's batches belong to
	// (its producer id, sequences and transactional id); nil for the
	// Producer's own. A stream's partitions are not in Producer.parts.
	txn *TxnStream
}

// Producer produces to one cluster, idempotent with acks all. Its
// methods are safe for concurrent use.
type Producer struct {
	name   string
	cfg    ProducerConfig
	log    *zap.Logger
	h      ProduceHandler
	client sarama.Client  // metadata, InitProducerID
	sc     *sarama.Config // the sinks' connections
	ver    int16          // Produce request version

	quit     chan struct{}   // closed when Close gives up waiting: every goroutine returns
	ctx      context.Context // ends with quit: interrupts the sinks' dials
	cancel   context.CancelFunc
	kick     chan struct{} // wakes the resolver
	resolved chan struct{} // closed when the resolver returned (and closed the client if it had to)

	topics topicCounts // Partitions' cache, its refresher's

	mu       sync.Mutex
	pid      int64
	epoch    int16
	bump     string // why a bump is wanted; "" when none is
	parts    map[topicPartition]*partState
	sinks    map[int32]*sink // by broker id: the sink of its current address
	allSinks []*sink         // every sink started, for Close
	pending  int             // messages given and not reported
	drained  chan struct{}   // closed when pending drops to 0
	requests int             // requests in flight, all sinks
	quiet    chan struct{}   // closed when requests drops to 0 while closing
	closing  bool
	// streams are the open transactional streams: the resolver finds
	// their partitions' leaders too. running are the streams whose
	// goroutine has not returned yet (a closed stream's may still be in a
	// coordinator request): Close waits for them, and each is a user of
	// the client (clientUsers).
	streams, running map[*TxnStream]struct{}
	// maxPartInflight is the most batches one partition had in flight
	// (for tests).
	maxPartInflight int
	// gapAt makes the next batch numbered of each partition it holds skip
	// one sequence, as a broker that lost the producer's state sees it
	// (for tests: RELAY.md §6 F8; SkipSequence).
	gapAt map[topicPartition]bool
	// clientUsers counts the resolver, the count refresher, the streams'
	// goroutines and Close while each may still use the client: the last
	// to stop closes it.
	clientUsers int
	closeOnce   sync.Once
	closeErr    error
	// bumpedAt is when the last bump took its producer id (zero: none
	// yet); bumpDelayed: the wanted bump waits for BumpInterval and was
	// counted so.
	bumpedAt    time.Time
	bumpDelayed bool

	stats struct {
		bumps, bumpsDelayed, duplicates, splits, refused, retries, reconnected atomic.Int64
	}
}

// NewProducer opens a producer to cluster c (name is for errors and
// logs): a metadata client and, with acks all, a producer id from
// InitProducerID, which it retries until ctx ends. Nothing else is
// connected until messages come. The caller must Close it.
func NewProducer(ctx context.Context, name string, c config.Cluster, cfg ProducerConfig, h ProduceHandler) (*Producer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if h == nil {
		return nil, errors.New("kafka: producer: the ProduceHandler is nil")
	}
	sc, err := Config(c)
	if err != nil {
		return nil, fmt.Errorf("kafka: producer for cluster %s: %w", name, err)
	}
	ver := ProduceVersion(sc.Version)
	if ver < 3 {
		return nil, fmt.Errorf("kafka: producer for cluster %s: Kafka version %s has no record batches (Produce v3, Kafka 0.11): raise the cluster's version", name, sc.Version)
	}
	if cfg.Dialer != nil {
		sc.Net.Proxy.Enable = true
		sc.Net.Proxy.Dialer = cfg.Dialer
	}
	sc.Net.MaxOpenRequests = cfg.MaxInFlight
	sc.Net.ReadTimeout += cfg.Timeout
	client, err := NewClientWith(name, c, Options{Dialer: cfg.Dialer})
	if err != nil {
		return nil, err
	}
	pctx, cancel := context.WithCancel(context.Background())
	p := &Producer{
		ctx: pctx, cancel: cancel,
		name: name, cfg: cfg, log: cfg.Logger.With(zap.String("cluster", name)), h: h,
		client: client, sc: sc, ver: ver,
		quit: make(chan struct{}), kick: make(chan struct{}, 1), resolved: make(chan struct{}),
		parts: map[topicPartition]*partState{}, sinks: map[int32]*sink{},
		clientUsers: 3,
	}
	p.topics.init(client)
	pid, epoch := int64(-1), int16(-1)
	if cfg.Acks == sarama.WaitForAll {
		if pid, epoch, err = p.initProducerID(ctx); err != nil {
			cancel()
			_ = client.Close()
			return nil, err
		}
	}
	p.pid, p.epoch = pid, epoch
	go p.resolve()
	go p.refreshCounts()
	p.log.Info("producer opened", zap.Int16("acks", int16(cfg.Acks)), zap.Int64("producer_id", pid), zap.Int16("epoch", epoch))
	return p, nil
}

// Produce hands m to the producer; it does not block. Its outcome is
// reported to the handler. The partition is the caller's choice
// (HashPartition for keys as sarama's murmur2 partitioner places them).
func (p *Producer) Produce(m *Message) error {
	if m.Timestamp.IsZero() {
		m.Timestamp = time.Now()
	}
	size := messageSize(m)
	k := topicPartition{m.Topic, m.Partition}
	p.mu.Lock()
	if p.closing {
		p.mu.Unlock()
		return ErrProducerClosed
	}
	ps := p.parts[k]
	if ps == nil {
		ps = &partState{topicPartition: k, gate: true}
		p.parts[k] = ps
		p.kickResolver()
	}
	if ps.open != nil && !ps.open.fits(m, size, p.cfg.BatchBytes, p.cfg.BatchRecords) {
		ps.queue = append(ps.queue, ps.open)
		ps.open = nil
	}
	if ps.open == nil {
		ps.open = newBatch(m)
	}
	ps.open.add(m, size)
	if ps.pending == 0 {
		ps.since = time.Now()
	}
	ps.pending++
	if p.pending == 0 {
		p.drained = make(chan struct{})
	}
	p.pending++
	s := ps.sink
	p.mu.Unlock()
	if s != nil {
		s.wake()
	}
	return nil
}

// Flush waits until every message given so far is reported, or ctx
// ends.
func (p *Producer) Flush(ctx context.Context) error {
	p.mu.Lock()
	if p.pending == 0 {
		p.mu.Unlock()
		return nil
	}
	ch := p.drained
	p.mu.Unlock()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Stalled reports whether a partition of topic has had records waiting
// for longer than after without an acknowledgement, and since when.
func (p *Producer) Stalled(topic string, after time.Duration) (Stall, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var st Stall
	for k, ps := range p.parts {
		if k.topic != topic || ps.pending == 0 {
			continue
		}
		if st.Since.IsZero() || ps.since.Before(st.Since) {
			st = Stall{Since: ps.since, Err: ps.lastErr}
		}
	}
	return st, !st.Since.IsZero() && time.Since(st.Since) > after
}

// Stats returns the producer's counters.
func (p *Producer) Stats() ProducerStats {
	return ProducerStats{
		Bumps: p.stats.bumps.Load(), BumpsDelayed: p.stats.bumpsDelayed.Load(), Duplicates: p.stats.duplicates.Load(), Splits: p.stats.splits.Load(),
		Refused: p.stats.refused.Load(), Retries: p.stats.retries.Load(), Reconnected: p.stats.reconnected.Load(),
	}
}

// Close stops the producer: Produce fails from now on, nothing more is
// sent, the requests in flight get until ctx ends to be answered (and
// reported), then every connection is closed and every goroutine has
// returned. Messages not reported by then go to the handler's
// Unfinished, if it has one. It returns ctx.Err() if ctx ended first.
// Close may be called more than once.
func (p *Producer) Close(ctx context.Context) error {
	p.closeOnce.Do(func() { p.closeErr = p.close(ctx) })
	return p.closeErr
}

func (p *Producer) close(ctx context.Context) error {
	p.mu.Lock()
	p.closing = true
	quiet := make(chan struct{})
	if p.requests == 0 {
		close(quiet)
	} else {
		p.quiet = quiet // closed by the sink that settles the last one
	}
	sinks := slices.Clone(p.allSinks) // no sink starts once closing
	p.mu.Unlock()
	var err error
	select {
	case <-quiet:
	case <-ctx.Done():
		err = ctx.Err()
	}
	close(p.quit)
	p.cancel()
	for _, s := range sinks {
		<-s.done
	}
	// The resolver, the count refresher and the streams' goroutines may
	// be in a metadata refresh or a coordinator request on a hung
	// cluster: each call is bounded by the client's timeouts (5 s reads),
	// not by ctx, and each returns at its next check of quit (p.ctx for a
	// stream). Close waits for them only until ctx ends; then whichever
	// is last closes the client. No stream opens once closing.
	p.mu.Lock()
	dones := []chan struct{}{p.resolved, p.topics.done}
	for t := range p.running {
		dones = append(dones, t.done)
	}
	p.mu.Unlock()
	for _, done := range dones {
		select {
		case <-done:
		case <-ctx.Done():
			err = ctx.Err()
		}
	}
	p.releaseClient()
	p.mu.Lock()
	var left []*Message
	for _, ps := range p.parts {
		for _, b := range ps.inflight {
			left = append(left, b.msgs...)
		}
		for _, b := range ps.queue {
			left = append(left, b.msgs...)
		}
		if ps.open != nil {
			left = append(left, ps.open.msgs...)
		}
	}
	p.mu.Unlock()
	if u, ok := p.h.(UnfinishedHandler); ok && len(left) > 0 {
		u.Unfinished(left)
	}
	p.log.Info("producer closed", zap.Int("unfinished", len(left)))
	return err
}

// releaseClient is called once by each user of the client (clientUsers)
// when it no longer uses it; the last closes it.
func (p *Producer) releaseClient() {
	p.mu.Lock()
	p.clientUsers--
	last := p.clientUsers == 0
	p.mu.Unlock()
	if last {
		_ = p.client.Close()
	}
}

func (p *Producer) isClosing() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closing
}

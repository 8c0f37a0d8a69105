package agent

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

	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/state"
)

// partitionRun consumes one partition and hands its records to the
// handler. Its goroutine is owned by the worker, which stops it with stop.
type partitionRun struct {
	tp         state.TopicPartition
	cluster    string
	generation int64
	token      int64  // the fencing token of generation's term
	logical    string // the topic's logical name
	origin     string // the cluster whose producers write the topic
	// topicID is the id of the topic as it was when the partition
	// started ("" unknown), committed with each position and carried by
	// each record: a position of another id is of a topic deleted since
	// (lifecycle.go), and so is a sink's (routing's exactly_once done).
	topicID string
	// cause is why the partition's FetchPartition ended on its own
	// (offset out of range, an error it does not retry); set by the loop
	// before done is closed, nil when the worker stopped it.
	cause error
	// movedAt is when the committable position last moved (or the
	// partition started), next that position: owned by the worker's loop.
	movedAt time.Time
	next    int64
	// end is the partition's end offset as last asked at endAt by the
	// stall check (-1: not asked since the position last moved).
	end   int64
	endAt time.Time
	// committedAt is when its position was last committed (zero: not
	// by this run), for the commit budget's order.
	committedAt time.Time
	fp          *kafka.FetchPartition
	// chunks are the chunks polled from fp whose records are not all
	// acknowledged, oldest first: owned by the loop, then by stop, which
	// releases them.
	chunks []*chunkRef
	t      *tracker
	cancel context.CancelFunc
	done   chan struct{}
	gate   *gate
}

// gate holds a partition's delivery while it is paused. The worker sets
// it; the partition loop waits at it before handing each record on. Its
// methods are safe for concurrent use.
type gate struct {
	// held mirrors paused, for wait's check without the lock on every
	// record.
	held   atomic.Bool
	mu     sync.Mutex
	paused bool
	open   chan struct{} // closed while not paused
	// parked is closed once the loop waits at the gate after a pause: no
	// record is being handed to the handler any more.
	parked chan struct{}
	// kick wakes a loop that waits for records, so that it parks at once.
	kick chan struct{}
}

func newGate(paused bool) *gate {
	g := &gate{open: make(chan struct{}), parked: make(chan struct{}), kick: make(chan struct{}, 1)}
	if paused {
		g.paused = true
		g.held.Store(true)
	} else {
		close(g.open)
	}
	return g
}

// set pauses or resumes; it returns a channel closed once the loop has
// stopped delivering (at once when resuming or unchanged).
func (g *gate) set(paused bool) <-chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	if paused == g.paused {
		return g.parked
	}
	g.paused = paused
	g.held.Store(paused)
	if paused {
		g.open = make(chan struct{})
		g.parked = make(chan struct{})
		select {
		case g.kick <- struct{}{}:
		default:
		}
		return g.parked
	}
	close(g.open)
	return closedChan
}

func (g *gate) isPaused() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.paused
}

var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// wait returns at once when not paused; otherwise it reports being parked
// and waits for a resume or ctx.
func (g *gate) wait(ctx context.Context) error {
	if !g.held.Load() {
		return nil
	}
	g.mu.Lock()
	if !g.paused {
		g.mu.Unlock()
		return nil
	}
	open, parked := g.open, g.parked
	select {
	case <-parked:
	default:
		close(parked)
	}
	g.mu.Unlock()
	select {
	case <-open:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// maxInFlight bounds the records of one partition handed to the handler
// and not yet acknowledged: a handler that stops acknowledging stops its
// partition instead of growing memory.
const maxInFlight = 4096

// partitionStart is a partition to start, and how.
type partitionStart struct {
	tp state.TopicPartition
	// gen and token are the generation it runs under and the fencing
	// token of the leader's term that made it.
	gen, token int64
	// offset is where it starts (>= 0, resolved by the caller).
	offset  int64
	topicID string
	paused  bool
	// ended is why the partition's previous run ended (nil: none).
	ended error
}

// startPartition starts consuming ps.tp of k's cluster and returns the
// running partition. A start out of the partition's range is moved
// (intoRange) when the partition's previous run ended out of range, as
// the Fetcher finds it out only when it fetches. The agent's byte budget
// is charged by the Fetcher, per response, not per record.
func (w *worker) startPartition(ctx context.Context, k *kafkaConn, ps partitionStart) (*partitionRun, error) {
	tp, start := ps.tp, ps.offset
	var err error
	if errors.Is(ps.ended, sarama.ErrOffsetOutOfRange) {
		if start, err = w.intoRange(k, tp, start); err != nil {
			return nil, err
		}
	}
	fp, err := k.fetcher.ConsumePartition(tp.Topic, tp.Partition, start)
	if err != nil {
		return nil, err
	}
	pctx, cancel := context.WithCancel(ctx)
	s := w.naming.Stream(k.name, tp.Topic)
	r := &partitionRun{tp: tp, cluster: k.name, logical: s.Logical, origin: s.Origin, topicID: ps.topicID, generation: ps.gen, token: ps.token, fp: fp,
		t: newTracker(start, maxInFlight), cancel: cancel, done: make(chan struct{}), gate: newGate(ps.paused)}
	if ps.paused {
		// Stop fetching too, so a long pause holds no records in memory.
		r.fp.Pause()
	}
	go func() {
		defer close(r.done)
		r.cause = w.consume(pctx, r)
	}()
	return r, nil
}

// consume hands the partition's records to the handler, in order: it
// polls the chunks the Fetcher queued for the partition and hands their
// records on (gate, hold, tracker, handler), until ctx ends (nil) or the
// partition ends on its own: then it returns why, every chunk queued
// before the end delivered, and the worker starts the partition again
// (restartEnded). It waits on nothing but the Fetcher's kick, the gate's
// and ctx: never on the network.
func (w *worker) consume(ctx context.Context, r *partitionRun) error {
	log := w.log.With(zap.Stringer("partition", r.tp), zap.Int64("generation", r.generation))
	var polled []*kafka.Chunk
	for {
		// A paused partition hands nothing on: its chunks polled wait
		// here, unacknowledged, so nothing is committed past them.
		if r.gate.wait(ctx) != nil || w.hold.wait(ctx) != nil {
			return nil
		}
		var err error
		polled, err = r.fp.Poll(polled[:0])
		if len(polled) == 0 {
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				log.Warn("partition fetch ended; the worker starts it again", zap.Error(err))
				return err
			}
			select {
			case <-r.fp.Done():
				// Ended (Poll says why next) or closed: by stop, or by
				// the Fetcher's Close, which ends it for good.
				if ctx.Err() == nil && r.fp.Err() == nil {
					return fmt.Errorf("agent: the fetch of %s on cluster %s was closed", r.tp, r.cluster)
				}
			case <-ctx.Done():
				return nil
			case <-r.gate.kick:
			case <-r.fp.Ready():
			}
			continue
		}
		// Polled chunks are the loop's: held from here until their
		// records are acknowledged, or stop releases them.
		r.chunks = slices.DeleteFunc(r.chunks, (*chunkRef).done)
		first := len(r.chunks)
		for _, c := range polled {
			r.chunks = append(r.chunks, newChunkRef(c))
		}
		clear(polled)
		for _, ref := range r.chunks[first:] {
			if !w.deliverChunk(ctx, log, r, ref) {
				return nil
			}
		}
	}
}

// deliverChunk hands the records of ref's chunk on, in order; false means
// ctx ended. The records' deliveries, and their headers, are allocated
// once for the chunk.
func (w *worker) deliverChunk(ctx context.Context, log *zap.Logger, r *partitionRun, ref *chunkRef) bool {
	recs := ref.c.Records
	ds := make([]delivery, len(recs))
	ref.ds = ds
	nh := 0
	for i := range recs {
		nh += len(recs[i].Headers)
	}
	var hs []record.Header
	if nh > 0 {
		hs = make([]record.Header, 0, nh)
	}
	for i := range recs {
		m, d := &recs[i], &ds[i]
		d.chunk = ref
		d.rec = record.Record{
			Cluster: r.cluster, Topic: r.tp.Topic, SourceTopic: r.logical, Origin: r.origin, TopicID: r.topicID, Partition: r.tp.Partition, Offset: m.Offset,
			Key: m.Key, Value: m.Value, Timestamp: m.Timestamp, Generation: r.generation, Session: int64(w.lease), Token: r.token,
		}
		if len(m.Headers) > 0 {
			from := len(hs)
			for _, h := range m.Headers {
				if h != nil {
					hs = append(hs, record.Header{Key: h.Key, Value: h.Value})
				}
			}
			d.rec.Headers = hs[from:len(hs):len(hs)]
		}
		if ctx.Err() != nil || !w.deliver(ctx, log, r, d) {
			return false
		}
	}
	return true
}

// deliver hands d's record to the handler, once a slot is free and the
// gate open; false means ctx ended.
func (w *worker) deliver(ctx context.Context, log *zap.Logger, r *partitionRun, d *delivery) bool {
	for {
		// A pause, or a hold of delivery while commits fail, that came
		// while this record was read (the loop waited for it in a select)
		// holds it too.
		if r.gate.wait(ctx) != nil || w.hold.wait(ctx) != nil {
			return false
		}
		full := r.t.deliver(d)
		if full == nil {
			break
		}
		select { // maxInFlight records wait for the handler's acks
		case <-full:
		case <-ctx.Done():
			return false
		}
	}
	if !w.handle(ctx, log, &d.rec) {
		return false
	}
	w.metrics.records.Inc()
	if w.rate != nil {
		w.rate.n.Add(1)
	}
	return true
}

// handle offers rec to the handler until it takes it or ctx ends.
func (w *worker) handle(ctx context.Context, log *zap.Logger, rec *record.Record) bool {
	backoff := 50 * time.Millisecond
	for {
		err := w.handler.Handle(ctx, rec)
		if err == nil {
			return true
		}
		w.metrics.handlerErrors.Inc()
		log.Warn("handler refused record; retrying", zap.Int64("offset", rec.Offset), zap.Error(err), zap.Duration("backoff", backoff))
		select {
		case <-ctx.Done():
			return false
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}

// stop ends the partition's consumption: no record is handed to the
// handler after it returns. It then waits up to drain for the handler to
// acknowledge what it was given. Nothing waits for the network: the
// FetchPartition closes at once, and the chunks still held are released
// after the drain (their records acknowledged later give nothing back
// twice).
func (r *partitionRun) stop(drain time.Duration) (drained bool) {
	r.cancel()
	r.fp.Close()
	<-r.done
	drained = r.t.waitDrained(drain)
	for _, ref := range r.chunks {
		ref.c.Release()
	}
	r.chunks = nil
	return drained
}

package agent

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/coordinator"
	"github.com/kswitch/kswitch/record"
)

// partitionRun consumes one partition and hands its records to the
// handler. Its goroutine is owned by the worker, which stops it with stop.
type partitionRun struct {
	tp         coordinator.TopicPartition
	cluster    string
	generation int64
	logical    string // the topic's logical name
	origin     string // the cluster whose producers write the topic
	// topicID is the id of the topic as it was when the partition
	// started ("" unknown), committed with each position and carried by
	// each record: a position of another id is of a topic deleted since
	// (lifecycle.go), and so is a sink's (routing's exactly_once done).
	topicID string
	// cause is why sarama's partition consumer ended on its own (offset
	// out of range, retries exhausted); set by the loop before done is
	// closed, nil when the worker stopped it.
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
	pc          sarama.PartitionConsumer
	t           *tracker
	cancel      context.CancelFunc
	done        chan struct{}
	gate        *gate
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

// startPartition starts consuming tp, of topic id topicID, at start (an
// offset >= 0, resolved by the caller) and returns the running partition.
// A start out of the partition's range is moved (outOfRange).
func (w *worker) startPartition(ctx context.Context, k *kafkaConn, gen int64, tp coordinator.TopicPartition, start int64, paused bool, topicID string) (*partitionRun, error) {
	pc, err := k.consumer.ConsumePartition(tp.Topic, tp.Partition, start)
	if errors.Is(err, sarama.ErrOffsetOutOfRange) {
		if start, err = w.outOfRange(k, tp, start); err != nil {
			return nil, err
		}
		pc, err = k.consumer.ConsumePartition(tp.Topic, tp.Partition, start)
	}
	if err != nil {
		return nil, err
	}
	pctx, cancel := context.WithCancel(ctx)
	s := w.naming.Stream(k.name, tp.Topic)
	r := &partitionRun{tp: tp, cluster: k.name, logical: s.Logical, origin: s.Origin, topicID: topicID, generation: gen, pc: pc, t: newTracker(start, maxInFlight, w.budget),
		cancel: cancel, done: make(chan struct{}), gate: newGate(paused)}
	if paused {
		// Stop fetching too, so a long pause holds no records in memory.
		pc.Pause()
	}
	go func() {
		defer close(r.done)
		r.cause = w.consume(pctx, r)
	}()
	return r, nil
}

// consume hands the partition's records to the handler, in order, until
// ctx ends (nil) or sarama's partition consumer ends on its own: then it
// returns why (its last error), and the worker starts the partition
// again (restartEnded).
func (w *worker) consume(ctx context.Context, r *partitionRun) error {
	log := w.log.With(zap.Stringer("partition", r.tp), zap.Int64("generation", r.generation))
	var last error
	ended := func() error {
		if ctx.Err() != nil {
			return nil
		}
		// sarama closes the errors after the messages: the error that
		// ended it (offset out of range) is among them.
		for err := range r.pc.Errors() {
			last = err
		}
		if last == nil {
			last = errors.New("the partition consumer closed")
		}
		log.Warn("partition consumer ended; the worker starts it again", zap.Error(last))
		return last
	}
	for {
		// A paused partition hands nothing on: records sarama already
		// fetched wait here, unacknowledged, so nothing is committed past
		// them.
		if r.gate.wait(ctx) != nil || w.hold.wait(ctx) != nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-r.gate.kick:
			continue // to the gate
		case err, ok := <-r.pc.Errors():
			if ok {
				last = err
				log.Warn("partition consumer error", zap.Error(err))
				w.metrics.consumeErrors.Inc()
			}
		case msg, ok := <-r.pc.Messages():
			// The records sarama already holds are handed on without a
			// select over every channel for each: a receive that does
			// not wait is far cheaper. A record received is always
			// delivered or the loop ends: one dropped while later ones
			// are acknowledged would be committed past, and lost.
			for n := 1; ; n++ {
				if !ok {
					return ended()
				}
				if !w.deliver(ctx, log, r, msg) {
					return nil
				}
				if n == burst || ctx.Err() != nil {
					break
				}
				select {
				case msg, ok = <-r.pc.Messages():
					continue
				default:
				}
				break
			}
		}
	}
}

// burst bounds the records the partition loop hands on between two looks
// at its other channels (errors, the gate's kick).
const burst = 256

// deliver hands msg to the handler, once a slot is free and the gate
// open; false means ctx ended.
func (w *worker) deliver(ctx context.Context, log *zap.Logger, r *partitionRun, msg *sarama.ConsumerMessage) bool {
	d := &delivery{rec: record.Record{
		Cluster: r.cluster, Topic: msg.Topic, SourceTopic: r.logical, Origin: r.origin, TopicID: r.topicID, Partition: msg.Partition, Offset: msg.Offset,
		Key: msg.Key, Value: msg.Value, Timestamp: msg.Timestamp, Generation: r.generation, Session: int64(w.lease),
	}}
	if len(msg.Headers) > 0 {
		d.rec.Headers = make([]record.Header, 0, len(msg.Headers))
		for _, h := range msg.Headers {
			if h != nil {
				d.rec.Headers = append(d.rec.Headers, record.Header{Key: h.Key, Value: h.Value})
			}
		}
	}
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
		select { // maxInFlight records, or the agent's byte budget, wait for the handler's acks
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
// acknowledge what it was given. What sarama still holds is drained in a
// goroutine added to bg, so that its goroutines can end: sarama closes the
// partition's channels only after the fetch in flight returns (up to
// Consumer.MaxWaitTime), which the final commit need not wait for.
func (r *partitionRun) stop(drain time.Duration, bg *sync.WaitGroup) (drained bool) {
	r.cancel()
	r.pc.AsyncClose()
	<-r.done
	bg.Add(1)
	go func() {
		defer bg.Done()
		for range r.pc.Messages() {
		}
		for range r.pc.Errors() {
		}
	}()
	drained = r.t.waitDrained(drain)
	r.t.close()
	return drained
}

package routing

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/record"
)

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
	if err := r.mayGo(msgs); err != nil {
		return err
	}
	if err := r.acquire(ctx, rec, msgs); err != nil {
		return err
	}
	if err := r.enterAll(msgs); err != nil {
		return err
	}
	return r.sendAll(rec, msgs)
}

// mayGo returns the WaitError of the first of msgs whose channel is paused
// or failing.
func (r *Router) mayGo(msgs []*outMsg) error {
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
	return nil
}

// acquire gives each of msgs its producer (its transactional stream on an
// exactly_once cluster), or none of them.
func (r *Router) acquire(ctx context.Context, rec *record.Record, msgs []*outMsg) error {
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
	return nil
}

// enterAll counts each of msgs in flight at its destination (enter), or
// none of them, releasing their producers.
func (r *Router) enterAll(msgs []*outMsg) error {
	for i, m := range msgs {
		if m.ds.enter(m.pr) {
			continue
		}
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
	return nil
}

// sendAll sends msgs, one delivery of rec. On an error the produces not
// sent are settled: the record will not be acknowledged.
func (r *Router) sendAll(rec *record.Record, msgs []*outMsg) error {
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

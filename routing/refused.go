package routing

import (
	"cmp"
	"strconv"

	"github.com/IBM/sarama"
	"go.uber.org/zap"
)

// The policies for a record that the dead-letter channel refuses for good
// too (routing.refused).
const (
	// RefusedReference sends the dead-letter channel a reference to the
	// record instead, cut to fit, and moves on (the default).
	RefusedReference = "reference"
	// RefusedBlock stops the record's partition until the record is taken.
	RefusedBlock = "block"
)

// The cuts of a reference: what of a refused record the dead-letter
// channel receives. A reference is at most about 34 KiB, which any topic
// takes (Kafka's default limit is 1 MiB).
const (
	refValueMax   = 16 << 10
	refKeyMax     = 1 << 10
	refHeadersMax = 16 << 10
)

// The headers a reference adds to the dead-letter headers.
const (
	HeaderSize      = "kswitch-size"      // the record's value size in bytes
	HeaderTruncated = "kswitch-truncated" // "true": the value (or key, or headers) was cut
)

// refused returns the version's policy for records the dead-letter
// channel refuses.
func (v *Version) refused() string { return cmp.Or(v.spec.Refused, RefusedReference) }

// refusedForGood settles a produce that its destination refused for good:
// it goes to the dead-letter channel, as a reference when that is what
// refused it and the policy says so; it blocks its partition when there
// is nowhere to put it; a reference that is refused too is dropped.
func (r *Router) refusedForGood(om *outMsg, err error) {
	v := r.cur.Load()
	switch {
	case v.deadLetter != nil && (!om.dead || !om.reference && v.refused() == RefusedReference):
		r.enqueue(om, 0) // resend sends it, or a reference to it, to the dead-letter channel
		return
	case om.reference:
		r.log.Error("the dead-letter channel refused even the reference to a record; the record is dropped",
			zap.Stringer("destination", om.ds.dest), zap.String("source", sourceOf(om.d.rec)),
			zap.Int("size", len(om.d.rec.Value)), zap.Error(err))
		r.m.dead.WithLabelValues("dropped").Inc()
		r.settle(om)
		if om.blocks != nil {
			r.unblock(om)
		}
		if om.d.pending.Add(-1) == 0 {
			r.ack(om.d.rec)
		}
		return
	}
	if om.blocks == nil {
		r.block(om, err)
		msg := "destination refused a record and there is no dead-letter channel; its partition stops"
		if om.dead {
			msg = "the dead-letter channel refused a record too, and routing.refused is block; its partition stops"
		}
		r.log.Error(msg, zap.Stringer("destination", om.ds.dest), zap.String("source", sourceOf(om.d.rec)), zap.Error(err))
	}
	r.enqueue(om, r.backoff(om.failures))
}

// toDeadLetter turns om, refused for good by its destination, into its
// record's produce to the dead-letter channel dl: the record, or a
// reference to it. It returns false when om was queued again because
// dl's producer cannot be had now.
func (r *Router) toDeadLetter(om *outMsg, dl *channel, reference bool) bool {
	pr, err := r.pool.acquire(r.loopCtx, dl.pkey, 1, r.opts.OpenWait)
	if err != nil {
		r.requeue(om)
		return false
	}
	rec := om.d.rec
	rule := cmp.Or(om.rule, "default")
	r.health.deadLetterCause(om.lastErr)
	var dm *outMsg
	if reference {
		r.log.Warn("the dead-letter channel refused a record for good; sending it a reference to the record instead",
			zap.String("source", sourceOf(rec)), zap.String("dead_letter", dl.Name), zap.Int("size", len(rec.Value)), zap.Error(om.lastErr))
		dm = r.referenceMsg(om, dl, rule)
	} else {
		r.log.Warn("destination refused a record for good; sending it to the dead-letter channel",
			zap.Stringer("destination", om.ds.dest), zap.String("source", sourceOf(rec)), zap.String("dead_letter", dl.Name), zap.Error(om.lastErr))
		dm = r.newMsg(rec, dl, rule, rec.Key, deadHeaders(rec, rule, om.lastErr))
		om.deadReason = "produce"
	}
	r.settle(om)
	if om.blocks != nil {
		r.unblock(om)
	}
	om.ch, om.ds, om.pr, om.km, om.dead, om.failures = dl, dm.ds, pr, dm.km, true, 0
	om.km.Ref = om
	om.ds.inFlight.Add(1)
	return true
}

// referenceMsg builds the reference to om's record that stands for it on
// the dead-letter channel dl: where it was consumed, its size, why it was
// refused, its headers and the start of its key and value.
func (r *Router) referenceMsg(om *outMsg, dl *channel, rule string) *outMsg {
	rec := om.d.rec
	key, truncated := rec.Key, false
	if len(key) > refKeyMax {
		key, truncated = key[:refKeyMax], true
	}
	hdrs := deadHeaders(rec, rule, om.lastErr)
	hdrs = append(hdrs, sarama.RecordHeader{Key: []byte(HeaderSize), Value: strconv.AppendInt(nil, int64(len(rec.Value)), 10)})
	value := rec.Value
	if len(value) > refValueMax {
		value, truncated = value[:refValueMax], true
	}
	own := 0
	for _, h := range rec.Headers {
		if own += len(h.Key) + len(h.Value); own > refHeadersMax {
			truncated = true
			break
		}
		hdrs = append(hdrs, sarama.RecordHeader{Key: h.Key, Value: h.Value})
	}
	if truncated {
		hdrs = append(hdrs, sarama.RecordHeader{Key: []byte(HeaderTruncated), Value: []byte("true")})
	}
	dm := r.newMsg(rec, dl, rule, key, nil)
	dm.km.Headers = hdrs
	dm.km.Value = value
	om.reference, om.deadReason = true, "reference"
	return dm
}

// deadLettered counts a record the dead-letter channel acknowledged.
func (r *Router) deadLettered(om *outMsg) {
	r.m.dead.WithLabelValues(cmp.Or(om.deadReason, "produce")).Inc()
	r.countDead(om.d.rec)
	r.health.deadLettered()
}

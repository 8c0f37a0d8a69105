package routing

import (
	"cmp"
	"slices"
	"time"

	"go.uber.org/zap"
)

// A destination whose produces fail is recovered in the order of the
// records' source partitions, so that a channel receives the records of
// one source partition in source order through every outage. The
// producer retries in place without limit, so a produce fails back to the
// router, other than for good, only when it cannot be placed (the
// partition count of its topic is not known: a topic the producer has not
// seen, or a cluster without metadata yet) or when its producer was
// retired with it unfinished (errRetired: the cluster was redefined); what
// a producer refuses is refused for good (permanent):
//
//   - a produce that fails other than for good joins the destination's
//     held produces, and the destination is failing: Handle makes every
//     new record for it wait (the agent offers it again), so nothing
//     newer is produced behind the held ones;
//   - once nothing else of the destination is inside its producer, the
//     loop sends the first held produce of each source partition (a
//     probe round); when all of them are acknowledged it sends every
//     held produce, sorted by source partition and offset (a flush
//     round), through the one idempotent producer, which keeps the order
//     of what it is given per partition;
//   - a failure in a round ends it: the failed produces are held again
//     and the next round, a probe, waits a backoff that doubles up to
//     Options.RetryBackoffMax;
//   - the destination works again, and new records flow, only when a
//     flush round leaves nothing held.
//
// A record acknowledged while an earlier one of its source partition is
// held reached the channel out of order: the router cannot undo that
// write; it counts it (kswitch_routing_reordered_total, 0 by design) and
// logs the partition.

// recovery is the state of a failing destination, under Router.mu.
type recovery struct {
	held        []*outMsg // failed produces waiting to be sent again
	round       roundKind
	resending   int  // produces of the running round not yet settled
	roundFailed bool // a produce of the running round failed
	probed      bool // the last round was a probe that fully succeeded
	attempt     int  // failed rounds in a row
	due         time.Time
	// drainSince is when a round first found produces of the destination
	// still inside its producer.
	drainSince time.Time
}

type roundKind int

const (
	roundNone  roundKind = iota
	roundProbe           // the first held produce of each source partition
	roundFlush           // every held produce, in source order
)

// drainWaitMax bounds how long a round waits for the produces still
// inside the destination's producer to return before it starts anyway
// (the producer retries without limit: a destination that does not
// answer keeps them inside).
const drainWaitMax = 30 * time.Second

// hold adds a failed produce to its destination's held produces.
func (r *Router) hold(om *outMsg) {
	r.mu.Lock()
	// Failing is set under r.mu with the destination's recovery, so that
	// an acknowledgement of another of its produces (another producer's
	// sink goroutine: a retired one) does not
	// find it failing but not recovering, and end its recovery
	// (producedWhileRecovering) before this produce is held: new records
	// would flow ahead of it.
	if om.ds.failing.Load() == nil {
		om.ds.failing.Store(&failure{err: om.lastErr, since: time.Now()})
		r.log.Warn("produce failing; the destination's records wait and are sent again in source order once it answers",
			zap.Stringer("destination", om.ds.dest), zap.Error(om.lastErr))
	}
	rc := &om.ds.rec
	om.heldAt = time.Now()
	rc.held = append(rc.held, om)
	if om.resent {
		om.resent = false
		rc.resending--
		rc.roundFailed = true
	}
	if r.recovering == nil {
		r.recovering = map[*destState]bool{}
	}
	if !r.recovering[om.ds] {
		r.recovering[om.ds] = true
		rc.due = time.Now().Add(r.opts.RetryBackoff)
	}
	r.endRound(om.ds)
	r.mu.Unlock()
	r.kick()
}

// producedWhileRecovering settles the recovery's part of a produce the
// destination acknowledged while it recovers.
func (r *Router) producedWhileRecovering(om *outMsg) {
	r.mu.Lock()
	defer r.mu.Unlock()
	rc := &om.ds.rec
	resent := om.resent
	if resent {
		om.resent = false
		rc.resending--
	}
	rec := om.d.rec
	for _, h := range rc.held {
		if hr := h.d.rec; h.overtaken || hr.Partition != rec.Partition || hr.Offset > rec.Offset || hr.Topic != rec.Topic || hr.Cluster != rec.Cluster {
			continue
		}
		h.overtaken = true
		r.m.reordered.Inc()
		if !resent && om.sent.After(h.heldAt) {
			// Handed to the producer after an earlier record of its
			// partition was held: the router broke the order itself.
			r.breaches.Add(1)
			r.log.Error("a record was produced behind an earlier record of its partition that waits to be sent again",
				zap.Stringer("destination", om.ds.dest), zap.String("source", sourceOf(rec)), zap.String("earlier", sourceOf(h.d.rec)))
			continue
		}
		r.log.Warn("a record failed while a later record of its source partition, already inside the producer, reached the channel: it will reach the channel after it",
			zap.Stringer("destination", om.ds.dest), zap.String("failed", sourceOf(h.d.rec)), zap.String("later", sourceOf(rec)), zap.Error(h.lastErr))
	}
	if !r.recovering[om.ds] {
		// Failing because it stalled (sampleHealth), with nothing held:
		// the acknowledgement shows it answers again.
		r.recovered(om.ds)
		return
	}
	r.endRound(om.ds)
}

// leaveRound takes a produce that will not be held again out of its
// destination's recovery round.
func (r *Router) leaveRound(om *outMsg) {
	if !om.resent {
		return
	}
	r.mu.Lock()
	om.resent = false
	om.ds.rec.resending--
	r.endRound(om.ds)
	r.mu.Unlock()
}

// endRound closes the running round of ds once every produce of it is
// settled. r.mu is held.
func (r *Router) endRound(ds *destState) {
	rc := &ds.rec
	if rc.round == roundNone || rc.resending > 0 {
		return
	}
	now := time.Now()
	failed, kind := rc.roundFailed, rc.round
	rc.round, rc.roundFailed = roundNone, false
	switch {
	case failed:
		rc.attempt++
		rc.due, rc.probed = now.Add(r.backoff(rc.attempt)), false
	case len(rc.held) == 0:
		r.recovered(ds)
	case kind == roundProbe:
		rc.due, rc.probed = now, true // the destination answers: the flush is next
	default:
		// A flush that failed nothing, while produces sent before the
		// failure came back failed: probe again.
		rc.due, rc.probed = now, false
	}
	r.kick()
}

// recovered ends the recovery of ds: its new records flow again. r.mu is
// held.
func (r *Router) recovered(ds *destState) {
	delete(r.recovering, ds)
	ds.rec = recovery{}
	if f := ds.failing.Load(); f != nil && ds.failing.CompareAndSwap(f, nil) {
		r.log.Info("destination recovered; its held records were sent again in order and new records flow",
			zap.Stringer("destination", ds.dest), zap.Duration("failed_for", time.Since(f.since)))
	}
}

// recoverDue starts the rounds that are due, and returns how long until
// the next one may be.
func (r *Router) recoverDue(now time.Time) time.Duration {
	wait := time.Hour
	var sends []*outMsg
	r.mu.Lock()
	queued := r.queuedByDest()
	for ds := range r.recovering {
		rc := &ds.rec
		if rc.round != roundNone {
			continue
		}
		inside := ds.inFlight.Load() - int64(len(rc.held)) - queued[ds]
		if len(rc.held) == 0 && (inside <= 0 || !rc.drainSince.IsZero() && now.Sub(rc.drainSince) >= drainWaitMax) {
			// Its held produces were released (dropHeld), and what was
			// inside its producer has returned.
			r.recovered(ds)
			continue
		}
		if len(rc.held) > 0 && now.Before(rc.due) {
			wait = min(wait, rc.due.Sub(now))
			continue
		}
		if inside > 0 {
			// Produces sent before the failure are still inside the
			// producer: they return (acknowledged or failed, then held)
			// before anything is sent again behind them.
			if rc.drainSince.IsZero() {
				rc.drainSince = now
			}
			if now.Sub(rc.drainSince) < drainWaitMax {
				wait = min(wait, 10*time.Millisecond)
				continue
			}
			r.log.Warn("produces of a recovering destination have not returned; sending the held ones again anyway",
				zap.Stringer("destination", ds.dest), zap.Int64("inside", inside), zap.Duration("waited", now.Sub(rc.drainSince)))
		}
		rc.drainSince = time.Time{}
		slices.SortStableFunc(rc.held, bySourceOrder)
		var batch []*outMsg
		if rc.probed {
			batch, rc.held, rc.round = rc.held, nil, roundFlush
		} else {
			batch, rc.held = heads(rc.held)
			rc.round = roundProbe
		}
		if len(batch) == 0 {
			rc.round = roundNone
			r.recovered(ds)
			continue
		}
		rc.resending = len(batch)
		for _, om := range batch {
			om.resent = true
		}
		sends = append(sends, batch...)
	}
	r.mu.Unlock()
	// A produce that cannot be sent now (its producer is being opened)
	// is held again, and so are the later ones of its source partition in
	// this round: they are not sent ahead of it.
	var stopped *outMsg
	for _, om := range sends {
		if stopped != nil && sameSource(stopped, om) {
			om.failures++
			om.lastErr = stopped.lastErr
			r.hold(om)
			continue
		}
		if !r.sendAgain(om) {
			stopped = om
		}
	}
	if len(sends) > 0 {
		return 0
	}
	return wait
}

// sendAgain sends a held produce of a recovery round. It returns false
// when om was held again, its producer not to be had now.
func (r *Router) sendAgain(om *outMsg) bool {
	if err := r.repoint(om); err != nil {
		om.failures++
		om.lastErr = err
		r.hold(om)
		return false
	}
	if err := r.send(om); err != nil {
		r.leaveRound(om)
		r.settle(om)
	}
	return true
}

// dropHeld forgets the held produces that match (those of a partition
// its agent released), and those queued for the loop (a record refused for
// good that waits for the dead-letter channel or blocks its partition):
// they are not acknowledged, and the partitions' next owners consume them
// again.
func (r *Router) dropHeld(match func(*outMsg) bool) {
	var drop, queued []*outMsg
	r.mu.Lock()
	r.retries = slices.DeleteFunc(r.retries, func(om *outMsg) bool {
		if match(om) {
			queued = append(queued, om)
			return true
		}
		return false
	})
	for ds := range r.recovering {
		rc := &ds.rec
		rc.held = slices.DeleteFunc(rc.held, func(om *outMsg) bool {
			if match(om) {
				drop = append(drop, om)
				return true
			}
			return false
		})
	}
	r.mu.Unlock()
	for _, om := range queued {
		if om.blocks != nil {
			r.unblock(om)
		}
		r.settle(om)
	}
	for _, om := range drop {
		r.settle(om)
	}
	if len(drop) > 0 {
		r.kick()
	}
}

// settleHeld forgets every held produce (the router is closing).
func (r *Router) settleHeld() {
	r.dropHeld(func(*outMsg) bool { return true })
}

// bySourceOrder orders produces by source partition and offset.
func bySourceOrder(a, b *outMsg) int {
	ra, rb := a.d.rec, b.d.rec
	return cmp.Or(cmp.Compare(ra.Cluster, rb.Cluster), cmp.Compare(ra.Topic, rb.Topic),
		cmp.Compare(ra.Partition, rb.Partition), cmp.Compare(ra.Offset, rb.Offset))
}

// heads splits sorted held produces into the first of each source
// partition and the rest.
func heads(held []*outMsg) (first, rest []*outMsg) {
	for i, om := range held {
		if i == 0 || !sameSource(held[i-1], om) {
			first = append(first, om)
		} else {
			rest = append(rest, om)
		}
	}
	return first, rest
}

func sameSource(a, b *outMsg) bool {
	ra, rb := a.d.rec, b.d.rec
	return ra.Cluster == rb.Cluster && ra.Topic == rb.Topic && ra.Partition == rb.Partition
}

// kick wakes the loop.
func (r *Router) kick() {
	select {
	case r.retryKick <- struct{}{}:
	default:
	}
}

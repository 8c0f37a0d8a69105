package routing

import (
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// deliveryHealth follows whether records reach their channels, for
// readiness (Router.DeliveryProblem). Its methods are called on the
// per-record path and touch one or two atomics.
type deliveryHealth struct {
	// deadSince is when the first record was dead-lettered after the last
	// record delivered to a channel (unix ns; 0: none since), lastDead
	// the last dead-lettered one.
	deadSince, lastDead atomic.Int64
	deadRun             atomic.Int64 // records dead-lettered since deadSince
	lastDeadErr         atomic.Pointer[string]
}

func (h *deliveryHealth) delivered() {
	if h.deadSince.Load() != 0 {
		h.deadSince.Store(0)
		h.deadRun.Store(0)
	}
}

func (h *deliveryHealth) deadLettered() {
	now := time.Now().UnixNano()
	h.lastDead.Store(now)
	h.deadSince.CompareAndSwap(0, now)
	h.deadRun.Add(1)
}

// deadLetterCause notes why the last record went to the dead-letter
// channel.
func (h *deliveryHealth) deadLetterCause(err error) {
	s := err.Error()
	h.lastDeadErr.Store(&s)
}

// deadRunFor returns for how long every record handled has gone to the
// dead-letter channel (0: one reached a channel since the last dead
// letter, there was none, or none for a minute).
func (h *deliveryHealth) deadRunFor(now time.Time) time.Duration {
	since := h.deadSince.Load()
	if since == 0 || now.Sub(time.Unix(0, h.lastDead.Load())) > deadRunQuiet {
		return 0
	}
	return now.Sub(time.Unix(0, since))
}

// deadRunQuiet is how long after the last dead letter a run of them is
// over, when no record has reached a channel since either.
const deadRunQuiet = time.Minute

// destHealth is what the router's loop samples of one destination every
// second, under Router.mu.
type destHealth struct {
	acked        int64     // the destination's acknowledgement count at the last sample
	stalledSince time.Time // since when records wait and none is acknowledged; zero: it moves
}

// sampleHealth notes, for each destination, whether records wait for it
// while it acknowledges none. It runs on the loop every second.
func (r *Router) sampleHealth(now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	defer r.samples.Add(1)
	queued := r.queuedByDest()
	for _, ds := range r.dests {
		n := ds.acked.Load()
		// Produces queued for the loop (a record refused for good that
		// waits for a dead-letter channel, or blocks its partition) are
		// not inside the producer: they say nothing of whether the
		// destination answers.
		inside := ds.inFlight.Load() - queued[ds]
		if inside <= 0 && !r.recovering[ds] && ds.failing.Load() != nil {
			// Failing because it stalled, with nothing left inside its
			// producer: what waited was settled without an
			// acknowledgement (sent to the dead-letter channel, or its
			// partition released), or acknowledged as the stall was
			// noted. No acknowledgement will come to end it, and
			// nothing is left to keep new records behind.
			r.recovered(ds)
		}
		waiting := inside > 0 || ds.failing.Load() != nil
		switch {
		case !waiting || n != ds.health.acked:
			ds.health.stalledSince = time.Time{}
		case ds.health.stalledSince.IsZero():
			ds.health.stalledSince = now
		case ds.failing.Load() == nil && !r.txns.exactlyOnce(ds.dest.cluster):
			// A second without an acknowledgement while records wait:
			// the producer is retrying a destination that does not
			// answer. New records wait until it does (Handle), instead of
			// piling up behind the retried ones.
			err := fmt.Errorf("no produce acknowledged for %s while %d wait; the producer retries", now.Sub(ds.health.stalledSince).Round(time.Millisecond), ds.inFlight.Load())
			if last := ds.stallError(); last != nil {
				err = fmt.Errorf("%w (last error: %w)", err, last)
			}
			if ds.failing.CompareAndSwap(nil, &failure{err: err, since: ds.health.stalledSince}) {
				r.log.Warn("destination does not acknowledge; its records wait and are sent again in order once it answers",
					zap.Stringer("destination", ds.dest), zap.Error(err))
			}
		}
		ds.health.acked = n
	}
}

// queuedByDest counts, by destination, the produces queued for the loop
// (Router.retries). r.mu is held.
func (r *Router) queuedByDest() map[*destState]int64 {
	if len(r.retries) == 0 {
		return nil
	}
	n := map[*destState]int64{}
	for _, om := range r.retries {
		n[om.ds]++
	}
	return n
}

// DeliveryProblem returns why records do not reach their channels, or ""
// when they do (record.DeliveryReporter; the agent's readiness):
//   - a partition stopped at a record refused for good that nothing takes;
//   - a channel that has acknowledged no record for longer than after
//     while records wait for it (its cluster stopped, hung or refusing);
//   - every record handled for longer than after went to the dead-letter
//     channel, none to a channel;
//   - a producer took a new producer id within 5 s of the one
//     before, less than a minute ago (sampleProducers).
func (r *Router) DeliveryProblem(after time.Duration) string {
	now := time.Now()
	var out []string
	r.mu.Lock()
	for src, b := range r.blocked {
		out = append(out, fmt.Sprintf("partition %s/%d of cluster %s stopped at a record refused for good that no dead-letter channel takes (%d held): %v",
			src.topic, src.partition, src.cluster, b.n, b.err))
	}
	for _, ds := range r.dests {
		since := ds.health.stalledSince
		if since.IsZero() || now.Sub(since) <= after {
			continue
		}
		cause := "its produces are not answered"
		if f := ds.failing.Load(); f != nil {
			cause = f.err.Error()
		}
		out = append(out, fmt.Sprintf("channel %s has acknowledged no record for %s while %d wait: %s",
			ds.dest, now.Sub(since).Round(time.Second), ds.inFlight.Load(), cause))
	}
	r.mu.Unlock()
	out = append(out, r.bumpProblems(now)...)
	h := &r.health
	if d := h.deadRunFor(now); d > after && now.Sub(time.Unix(0, h.lastDead.Load())) <= after {
		cause := "?"
		if e := h.lastDeadErr.Load(); e != nil {
			cause = *e
		}
		out = append(out, fmt.Sprintf("every record handled for %s went to the dead-letter channel, none to a channel (%d records; the last because %s)",
			d.Round(time.Second), h.deadRun.Load(), cause))
	}
	slices.Sort(out)
	return strings.Join(out, "; ")
}

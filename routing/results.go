package routing

import (
	"errors"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"
)

// permanent reports whether a produce error is about the record itself,
// so that sending it again cannot help: it goes to the dead-letter
// channel. Every other error (the cluster unreachable, no leader, the
// topic missing, timeouts) is about the destination, whose records wait
// for it.
func permanent(err error) bool {
	for _, p := range []error{
		sarama.ErrInvalidPartition, // manual-same-partition beyond the topic's partitions
		sarama.ErrMessageSizeTooLarge, sarama.ErrMessageSetSizeTooLarge, sarama.ErrInvalidRecord,
		sarama.ErrInvalidTimestamp, sarama.ErrInvalidTopic, sarama.ErrTopicAuthorizationFailed,
		sarama.ErrPolicyViolation, sarama.ErrUnsupportedForMessageFormat,
	} {
		if errors.Is(err, p) {
			return true
		}
	}
	return false
}

// produced settles a produce that the destination acknowledged, and
// acknowledges its record once every produce of it is.
func (r *Router) produced(om *outMsg) {
	r.settle(om)
	om.ds.acked.Add(1)
	om.ds.routed.Inc()
	om.ds.latency.Observe(time.Since(om.sent).Seconds())
	if om.resent || om.ds.failing.Load() != nil {
		r.producedWhileRecovering(om)
	}
	if om.blocks != nil {
		r.unblock(om)
	}
	if om.dead {
		r.deadLettered(om)
	} else {
		r.health.delivered()
	}
	if om.d.pending.Add(-1) == 0 {
		r.ack(om.d.rec)
	}
}

// failed holds a produce that failed for its destination's recovery, or
// settles one that the destination refused for good.
func (r *Router) failed(om *outMsg, err error) {
	om.failures++
	om.lastErr = err
	om.ds.failures.Inc()
	if r.log.Core().Enabled(zap.DebugLevel) {
		r.log.Debug("produce failed", zap.Stringer("destination", om.ds.dest), zap.String("source", sourceOf(om.d.rec)),
			zap.Int("failures", om.failures), zap.Error(err))
	}
	if permanent(err) {
		r.leaveRound(om)
		r.refusedForGood(om, err)
		return
	}
	r.hold(om)
}

// backoff is the wait before the n-th retry of a record (n >= 1).
func (r *Router) backoff(n int) time.Duration {
	d := r.opts.RetryBackoff
	for i := 1; i < n && d < r.opts.RetryBackoffMax; i++ {
		d *= 2
	}
	return min(d, r.opts.RetryBackoffMax)
}

func (r *Router) enqueue(om *outMsg, after time.Duration) {
	om.due = time.Now().Add(after)
	r.mu.Lock()
	r.retries = append(r.retries, om)
	r.mu.Unlock()
	select {
	case r.retryKick <- struct{}{}:
	default:
	}
}

// requeue queues om to be sent again after its backoff, or forgets it
// when the router is closing.
func (r *Router) requeue(om *outMsg) {
	if r.loopCtx.Err() == nil {
		r.enqueue(om, r.backoff(om.failures))
	} else {
		r.settle(om)
	}
}

func (r *Router) block(om *outMsg, err error) {
	src := source{om.d.rec.Cluster, om.d.rec.Topic, om.d.rec.Partition}
	r.mu.Lock()
	defer r.mu.Unlock()
	b := r.blocked[src]
	if b == nil {
		b = &blockedSource{}
		r.blocked[src] = b
	}
	b.n++
	b.err = err
	om.blocks = &src
	r.nblock.Store(int32(len(r.blocked)))
}

func (r *Router) unblock(om *outMsg) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if b := r.blocked[*om.blocks]; b != nil {
		if b.n--; b.n <= 0 {
			delete(r.blocked, *om.blocks)
		}
	}
	om.blocks = nil
	r.nblock.Store(int32(len(r.blocked)))
}

// settleWaiting settles, at the close, the records waiting for a retry
// and those held: their partitions' next owners consume them again.
func (r *Router) settleWaiting() {
	r.mu.Lock()
	pending := r.retries
	r.retries = nil
	r.mu.Unlock()
	for _, om := range pending {
		r.settle(om)
	}
	r.settleHeld()
}

// loop is the router's background goroutine: it sends failed produces
// again when they are due, and closes producers no channel uses.
func (r *Router) loop() {
	defer close(r.loopDone)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		now := time.Now()
		wait := r.recoverDue(now)
		var due []*outMsg
		r.mu.Lock()
		rest := r.retries[:0]
		for _, om := range r.retries {
			if !om.due.After(now) {
				due = append(due, om)
			} else {
				wait = min(wait, om.due.Sub(now))
				rest = append(rest, om)
			}
		}
		clear(r.retries[len(rest):])
		r.retries = rest
		r.mu.Unlock()
		for _, om := range due {
			r.resend(om)
		}
		if len(due) > 0 || wait == 0 {
			continue // sends took time, and may have queued more
		}
		timer.Reset(wait)
		select {
		case <-r.loopCtx.Done():
			r.settleWaiting()
			return
		case <-r.retryKick:
		case <-timer.C:
		case <-r.sweepKick:
			r.pool.sweep(r.cur.Load().producers())
		case <-tick.C:
			r.pool.sweep(r.cur.Load().producers())
			r.sampleHealth(time.Now())
			r.sampleProducers(time.Now())
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
	}
}

// resend sends a produce refused for good to the dead-letter channel (the
// record, or a reference to it when the dead-letter channel refused the
// record too), or sends a produce again after its backoff.
func (r *Router) resend(om *outMsg) {
	if permanent(om.lastErr) {
		v := r.cur.Load()
		switch dl := v.deadLetter; {
		case dl == nil:
		case !om.dead:
			if !r.toDeadLetter(om, dl, false) {
				return
			}
		case !om.reference && v.refused() == RefusedReference:
			if !r.toDeadLetter(om, dl, true) {
				return
			}
		}
	}
	if err := r.repoint(om); err != nil {
		r.requeue(om)
		return
	}
	if err := r.send(om); err != nil {
		r.settle(om)
	}
}

// repoint moves om from its producer, when that was retired (its
// cluster's definition changed: SetClusters), to a producer with the new
// definition, waiting at most Options.OpenWait for it to open; om stays
// where it was when that fails.
func (r *Router) repoint(om *outMsg) error {
	if !om.pr.retired.Load() {
		return nil
	}
	pr, err := r.pool.acquire(r.loopCtx, om.pr.key, 1, r.opts.OpenWait)
	if err != nil {
		return err
	}
	r.pool.release(om.pr, 1)
	om.pr = pr
	return nil
}

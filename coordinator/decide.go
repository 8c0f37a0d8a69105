package coordinator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/state"
)

// uncalledFor returns why the switch in progress that this term found at
// its start (a predecessor's, or a value someone else wrote: every key is
// writable by whoever may write the fleet's prefix) is not resumed, ""
// when it is. It is resumed when something calls for it: the cluster it
// leaves is not reachable by a quorum (a failover), it goes to a cluster
// preferred to the one it leaves (a failback), a pin or a staged move
// names its target. Otherwise it is abandoned, as a switch whose cause is
// gone: the fleet stays where it is, and history/ records it abandoned.
func (r *leaderRun) uncalledFor(conf *dynamic) string {
	from, to := r.t.active.From, r.t.active.Cluster
	st := r.stages
	switch {
	case !r.h.quorumUpNow(from), conf.rank(to) < conf.rank(from), r.pn.get() == to, st != nil && st.Running() && st.Plan.To == to:
		return ""
	}
	return fmt.Sprintf("found in progress at the start of this term, and nothing calls for it: %s is reachable by a quorum of agents, %s is not preferred to it, and no pin or staged move names it", from, to)
}

// abandonFound abandons the switch in progress found at the term's start
// (uncalledFor says why).
func (r *leaderRun) abandonFound(ctx context.Context, why string) error {
	err := r.abandonSwitch(ctx, r.t, why)
	switch {
	case ctx.Err() != nil:
		return ctx.Err()
	case errors.Is(err, election.ErrNotLeader):
		return err
	case err != nil:
		r.log.Warn("cannot abandon the switch in progress; resuming it instead", zap.Error(err))
		r.reread(ctx, r.t, r.ak, r.log)
	}
	return nil
}

// caughtUpGate is the failback gate's check that cluster `to` holds what
// the fleet consumed where it is (Leader.caughtUp), made at most every 2 s
// for the same cluster.
func (r *leaderRun) caughtUpGate(ctx context.Context, to string) (bool, string) {
	if time.Since(r.caughtUpAt) > 2*time.Second || r.caughtUpTo != to {
		r.caughtUpAt, r.caughtUpTo = time.Now(), to
		r.caughtUp, r.caughtUpWhy = r.Leader.caughtUp(ctx, r.t, to, r.log)
	}
	return r.caughtUp, r.caughtUpWhy
}

// whileRetrying is a turn while a switch in progress waits for its retry.
// A switch whose target is gone while the cluster it left is back is given
// up: the fleet returns there rather than stay released. Otherwise nobody
// consumes while a switch is in progress: no planning, just wait for the
// retry (observing health again every probe interval).
func (r *leaderRun) whileRetrying(ctx context.Context) error {
	t := r.t
	if !r.h.quorumUpNow(t.active.Cluster) && r.h.quorumUpNow(t.active.From) {
		err := r.abandonSwitch(ctx, t, fmt.Sprintf("%s is unreachable by a quorum of agents and %s is reachable again", t.active.Cluster, t.active.From))
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, election.ErrNotLeader) {
			return err
		}
		if err != nil {
			r.log.Warn("cannot abandon the switch; retrying", zap.Error(err))
			r.reread(ctx, t, r.ak, r.log)
		} else {
			r.retry.set(nil, 0)
		}
		return nil
	}
	r.status.Store(&LeaderStatus{Active: t.active, Pin: r.pn.get(), Breaker: r.br.openUntil,
		Verdict: fmt.Sprintf("switch to %s failed, retrying at %s: %v", t.active.Cluster, r.retry.at.UTC().Format(time.RFC3339Nano), r.retry.err)})
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(min(time.Until(r.retry.at), r.cfg.Failover.ProbeInterval)):
	}
	return nil
}

// staying returns the topics a fleet switch to `to` leaves on the cluster
// it leaves: those pinned there, while a quorum of agents reaches it (a
// pin is honoured only then; a failover away from a dead cluster takes
// every topic along).
func (r *leaderRun) staying(to string) []string {
	from := r.t.active.Cluster
	if r.t.active.Phase == state.PhaseSwitching || !r.h.quorumUpNow(from) {
		return nil
	}
	var out []string
	for topic, c := range r.tp.get() {
		if c == from && c != to {
			out = append(out, topic)
		}
	}
	slices.Sort(out)
	return out
}

// doSwitch switches clusters (or finishes a switch in progress), counts
// it with the breaker and sets the retry of one that failed.
func (r *leaderRun) doSwitch(ctx context.Context, dec decision) error {
	t := r.t
	// Planned: the cluster being left is healthy (a pin, a failback), so
	// the switch can be made before it is broken.
	planned := r.h.quorumUpNow(t.active.Cluster) && r.h.quorumUpNow(dec.to)
	reason := dec.reason
	if st := r.stages; st != nil && st.Running() && t.active.Phase != state.PhaseSwitching {
		reason += fmt.Sprintf(" (overrides the staged move to %s at stage %d of %d)", st.Plan.To, st.Stage+1, len(st.Plan.Stages))
	}
	ev, err := r.switchTo(ctx, t, switchRequest{to: dec.to, reason: reason, auto: dec.auto, planned: planned, stay: r.staying(dec.to)})
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if errors.Is(err, election.ErrNotLeader) {
		return err
	}
	r.counted(ev, err, dec.auto, t.active.Epoch)
	r.retry.set(err, r.cfg.Failover.ProbeInterval)
	if err != nil {
		r.log.Error("cluster switch failed; retrying (the fleet stays released while a switch is in progress)",
			zap.Error(err), zap.Duration("retry_in", r.retry.delay))
	}
	// Re-read what the switch wrote, then plan on the new cluster. After
	// a failure state/active may have changed under the leader (a stale
	// revision fails every later write).
	if err != nil {
		r.reread(ctx, t, r.ak, r.log)
		return nil
	}
	r.overrideStages(ctx, ev)
	// The switch listed the partitions on the new cluster (and assigned
	// them): plan with them until discovery there reports.
	r.discoverInUse(ctx)
	if r.lists[t.active.Cluster] == nil {
		r.lists[t.active.Cluster] = t.found
	}
	return nil
}

// retrying is the backoff of a kind of switch whose last attempt failed.
type retrying struct {
	at    time.Time // the next attempt, zero when the last one succeeded
	delay time.Duration
	err   error // the last attempt's
}

// set notes an attempt's outcome: a failure doubles the delay (from base,
// up to maxSwitchRetry), a success clears it.
func (b *retrying) set(err error, base time.Duration) {
	b.err = err
	if err == nil {
		b.at, b.delay = time.Time{}, 0
		return
	}
	b.delay = min(max(2*b.delay, base), maxSwitchRetry)
	b.at = time.Now().Add(b.delay)
}

// counted counts a switch's outcome with the breaker (an automatic one
// that succeeded; a failed one once per epoch, however many attempts;
// epoch 0: it failed before it took an epoch) and the metrics.
func (r *leaderRun) counted(ev state.SwitchEvent, err error, auto bool, epoch int64) {
	tripped := false
	switch {
	case err == nil && auto:
		tripped = r.br.record(time.Now(), false)
	case err != nil && epoch > 0 && epoch != r.failedEpoch:
		r.failedEpoch = epoch
		tripped = r.br.record(time.Now(), true)
	}
	if r.metrics != nil {
		r.metrics.switched(ev, ev.Finished.Sub(ev.Started), err)
	}
	if tripped {
		r.log.Error("circuit breaker tripped: automatic switching stops", zap.Time("until", r.br.openUntil))
	}
}

package coordinator

import (
	"context"
	"errors"
	"maps"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/state"
)

// keepAssignment is a turn without a switch: it repairs the fleet's state,
// follows the active cluster's partitions, publishes the status and the
// stalled partitions, and plans and publishes the next generation when
// it differs. again: state/assignment changed under the leader and was
// read again.
func (r *leaderRun) keepAssignment(ctx context.Context, now time.Time, live []string, why string) (again bool, err error) {
	t := r.t
	if err := r.repairState(ctx, t, r.ak, r.asg, r.act, r.log); err != nil {
		if errors.Is(err, election.ErrNotLeader) {
			return false, err
		}
		r.log.Warn("cannot repair the fleet's state; re-reading it", zap.Error(err))
		r.reread(ctx, t, r.ak, r.log)
	}
	r.discoverInUse(ctx)
	r.takeLists()
	// Agents that alone cannot reach a cluster get no partitions there:
	// they would only stall them. They are still live: what they own is
	// revoked, not handed straight to another agent, since they may still
	// be consuming (a probe that timed out on a loaded machine is enough
	// to be cut off) and only their release commits what they handled.
	cut := r.cutOffAll(now)
	parts, listed := consumed(t.active, r.lists, r.conf().naming)
	cannot := map[string]map[string]bool{}
	for _, c := range inUse(t.active) {
		cannot[c] = r.h.downFor(now, c, r.cfg.Failover.FailureWindow)
	}
	r.status.Store(&LeaderStatus{Active: t.active, Verdict: why, Pin: r.pn.get(), TopicPins: r.tp.get(), Stages: r.stages, Breaker: r.br.openUntil,
		CutOff: cut[t.active.Cluster], CutOffOn: cut, Unassigned: r.unowned.note(now, parts, t.current, cannot),
		Silent: r.quiet.reasons()})
	r.publishStalled(ctx, t, r.unowned, r.quiet.reasons(), now, r.log)
	if !listed {
		return false, nil
	}
	acks := r.ak.upTo(t.current.Generation)
	next, changed := PlanSections(SectionsInput{Current: t.current, Cluster: t.active.Cluster, Partitions: parts,
		Live: live, CutOff: cut, Acks: acks})
	if !changed {
		return false, nil
	}
	if hold := handoverHold(t.current, live, acks, now); hold > 0 {
		r.handover = time.After(hold) // collected once it fires or is dropped (Go 1.23 timers)
		return false, nil
	}
	err = r.publishTerm(ctx, t, next)
	switch {
	case errors.Is(err, election.ErrNotLeader):
		r.log.Warn("leadership lost while publishing", zap.Error(err))
		return false, err
	case errors.Is(err, election.ErrConditionFailed):
		r.log.Warn("state/assignment changed under the leader; re-reading it")
		if c, rev, err := r.readAssignment(ctx, r.ak); err == nil {
			t.current, t.currentRev = c, rev
		}
		return true, nil
	case err != nil:
		r.log.Warn("cannot publish assignment; retrying", zap.Error(err))
	}
	return false, nil
}

// handoverWait bounds how long the leader holds the next generation while
// live agents have not yet acknowledged the revokes of the current one,
// so that the partitions they release are handed over together: each
// generation makes every agent apply it (a start of partitions waits for
// a fetch, about 500 ms on an idle partition) and refuses every commit
// fenced by the one before. A join to a fleet of 30 agents published 20
// generations in a second, one for every few acknowledgements, and the
// new agent took 4-8 s to own its share (0.2 s with 10 agents).
const handoverWait = 500 * time.Millisecond

// handoverHold returns how much longer to hold the next generation: until
// every live agent revoking in cur has acknowledged it, at most
// handoverWait after cur was published. Zero when nothing is revoked, or
// the wait is over (or cur's publication time is not of this clock's
// past: a hold never outlasts handoverWait).
func handoverHold(cur state.Assignment, live []string, acks map[string]int64, now time.Time) time.Duration {
	since := now.Sub(cur.Published)
	if since < 0 || since >= handoverWait {
		return 0
	}
	for _, a := range live {
		if acks[a] < cur.Generation && cur.Revokes(a) {
			return handoverWait - since
		}
	}
	return 0
}

// inUse returns the clusters a has partitions consumed on or moving to:
// its own first.
func inUse(a state.Active) []string { return append([]string{a.Cluster}, a.Placed()...) }

// consumed returns, by cluster in use, the listed partitions consumed there
// under a: those of the topics a places there, not in a switch of their
// own. ok is false while a cluster in use has not been listed: planning
// without its list would release what is consumed there.
func consumed(a state.Active, lists map[string][]state.TopicPartition, naming Naming) (parts map[string][]state.TopicPartition, ok bool) {
	parts = map[string][]state.TopicPartition{}
	for _, c := range inUse(a) {
		ps := lists[c]
		if ps == nil && c != a.Cluster && !consumesOn(a, c) {
			// Only topics moving there: nothing is consumed there yet.
			continue
		}
		if ps == nil {
			return nil, false
		}
		if len(a.Topics) == 0 {
			parts[c] = ps
			continue
		}
		var keep []state.TopicPartition
		for _, tp := range ps {
			if tc, moving := a.TopicCluster(naming.Logical(c, tp.Topic)); tc == c && !moving {
				keep = append(keep, tp)
			}
		}
		parts[c] = keep
	}
	return parts, true
}

// consumesOn reports whether a places a topic on cluster c, other than
// its own, that is consumed there now (not moving there).
func consumesOn(a state.Active, c string) bool {
	for _, e := range a.Topics {
		if e.Cluster == c && e.Phase == state.PhaseActive {
			return true
		}
	}
	return false
}

// cutOffAll returns, by cluster in use, the agents that alone cannot reach
// it (health.cutOff), sorted.
func (r *leaderRun) cutOffAll(now time.Time) map[string][]string {
	out := map[string][]string{}
	for _, c := range inUse(r.t.active) {
		if cut := r.h.cutOff(now, c, r.cfg.Failover.FailureWindow); len(cut) > 0 {
			out[c] = slices.Sorted(maps.Keys(cut))
		}
	}
	return out
}

// revokingPartitions counts the partitions being released in every
// section of a (for logs).
func revokingPartitions(a state.Assignment) int {
	n := 0
	for _, c := range a.Sections() {
		for _, tps := range a.Section(c).Revoking {
			n += len(tps)
		}
	}
	return n
}

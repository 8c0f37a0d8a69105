package coordinator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/state"
)

// Topic switches: one logical topic (or a few) moves to the other cluster
// while every other topic goes on being consumed where it is. The fleet's
// cluster stays the default; state/active's topics lists the exceptions.

// topicMove is a decided topic switch: topics go from one cluster to the
// other.
type topicMove struct {
	topics   []string
	from, to string
	reason   string
	auto     bool
	// resume: state/active holds the move already (phase switching).
	resume bool
}

// topicDecision returns the topic switch due now, if any: one in progress
// first (resumed), else the topics whose pin is not where they are
// consumed. A pin is followed only to a cluster a quorum of agents
// reaches; a topic placed on a cluster that a quorum has seen down for the
// failure window goes back to the fleet's cluster (automatic: the breaker
// counts it, and an open breaker holds it), and returns when that cluster
// is reachable again. Topics moving between the same two clusters for the
// same reason (one pin's cluster, one stage) move together.
func (r *leaderRun) topicDecision(now time.Time, live []string) (*topicMove, string) {
	a := r.t.active
	if sw := a.TopicSwitching(); len(sw) > 0 {
		e := a.Topics[sw[0]]
		mv := &topicMove{from: e.From, to: e.Cluster, reason: e.Reason, auto: e.Automatic, resume: true}
		for _, t := range sw {
			if a.Topics[t].Epoch == e.Epoch {
				mv.topics = append(mv.topics, t)
			}
		}
		return mv, ""
	}
	wants := r.topicWants()
	topics := map[string]bool{}
	for t := range wants {
		topics[t] = true
	}
	for t := range a.Topics {
		topics[t] = true
	}
	type key struct {
		from, to string
		auto     bool
		reason   string
	}
	moves := map[key]*topicMove{}
	var notes []string
	fo := r.cfg.Failover
	for _, topic := range slices.Sorted(maps.Keys(topics)) {
		at, _ := a.TopicCluster(topic)
		want, why, auto := a.Cluster, "unpinned: back on the fleet's cluster "+a.Cluster, false
		if w, ok := wants[topic]; ok {
			want, why = cmp.Or(w.cluster, a.Cluster), w.reason
		}
		if want != a.Cluster && at == want {
			// Placed where its pin says: it stays unless that
			// cluster is down while the fleet's is up.
			down, _ := r.h.down(now, want, live, fo.FailureWindow)
			if !down && !r.h.hardDown(now, want, live, fo.HardFailureWindow) {
				continue
			}
			if r.br.open(now) {
				notes = append(notes, fmt.Sprintf("%s: %s is down, circuit breaker open", topic, want))
				continue
			}
			want, why, auto = a.Cluster, fmt.Sprintf("topic failover: %s, where the topic is pinned, is unreachable; back on the fleet's cluster %s", at, a.Cluster), true
		}
		if want == at {
			continue
		}
		if !r.h.quorumUpNow(want) {
			notes = append(notes, fmt.Sprintf("%s pinned to %s, which a quorum of agents cannot reach yet", topic, want))
			continue
		}
		k := key{at, want, auto, why}
		if moves[k] == nil {
			moves[k] = &topicMove{from: at, to: want, reason: why, auto: auto}
		}
		moves[k].topics = append(moves[k].topics, topic)
	}
	note := strings.Join(notes, "; ")
	if len(moves) == 0 {
		return nil, note
	}
	ks := slices.SortedFunc(maps.Keys(moves), func(x, y key) int {
		return strings.Compare(x.from+"\x00"+x.to+"\x00"+x.reason, y.from+"\x00"+y.to+"\x00"+y.reason)
	})
	return moves[ks[0]], note
}

// doTopicSwitch carries out mv, counts it with the breaker when automatic,
// and sets the retry of one that failed. The other topics' partitions are
// planned as usual meanwhile (keepAssignment): a failed topic switch holds
// only its own topics.
func (r *leaderRun) doTopicSwitch(ctx context.Context, mv *topicMove) error {
	t := r.t
	ev, err := r.topicSwitch(ctx, t, mv)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if errors.Is(err, election.ErrNotLeader) {
		return err
	}
	r.counted(ev, err, mv.auto, ev.Epoch)
	r.topicRetry.set(err, r.cfg.Failover.ProbeInterval)
	if err != nil {
		r.log.Error("topic switch failed; retrying (only the topics being switched wait; the others are consumed)",
			zap.Strings("topics", mv.topics), zap.Error(err), zap.Duration("retry_in", r.topicRetry.delay))
		r.reread(ctx, t, r.ak, r.log)
	}
	r.discoverInUse(ctx)
	return nil
}

// topicSwitch moves mv.topics from mv.from to mv.to, or resumes such a
// switch left in state/active. Steps, each visible in etcd:
//
//  1. state/active's topics[T] := {to, switching, from} under the next
//     epoch (skipped when resuming);
//  2. a generation without T's partitions on any cluster: their owners
//     release and commit them (the plan is sticky: no other partition
//     moves, and none is paused); wait for the acknowledgements;
//  3. translate T's committed positions on `from` to `to`;
//  4. in one transaction: the translated positions, topics[T] := {to,
//     active} (removed when `to` is the fleet's cluster), and the
//     generation that assigns T's partitions on `to`; then
//     history/<epoch> := the event, with topics set.
//
// Nobody consumes T on `to` before step 4, so a leader that dies in 1–3
// leaves a state its successor resumes, and translating again is safe.
func (r *leaderRun) topicSwitch(ctx context.Context, t *term, mv *topicMove) (state.SwitchEvent, error) {
	began := time.Now()
	started, err := r.beginTopicMove(ctx, t, mv, began.UTC())
	if err != nil {
		return state.SwitchEvent{Started: started, Finished: time.Now().UTC()}, err
	}
	epoch := t.active.Topics[mv.topics[0]].Epoch
	ev := state.SwitchEvent{Epoch: epoch, From: mv.from, To: mv.to, Reason: mv.reason, Started: started, Phases: map[string]float64{},
		Leader: t.ID, Token: t.Rev, Automatic: mv.auto, Topics: mv.topics}
	fail := func(err error) (state.SwitchEvent, error) {
		ev.Finished = time.Now().UTC()
		return ev, err
	}
	log := t.log.With(zap.Strings("topics", mv.topics), zap.String("from", mv.from), zap.String("to", mv.to), zap.Int64("epoch", epoch))
	log.Info("switching topics", zap.String("reason", mv.reason), zap.Bool("resumed", mv.resume))

	// 2. Release the topics' partitions, and only them.
	parts, listed := consumed(t.active, r.lists, r.conf().naming)
	if !listed {
		return fail(fmt.Errorf("coordinator: topic switch: the partitions of %s are not listed yet", strings.Join(inUse(t.active), ", ")))
	}
	next, changed := PlanSections(SectionsInput{Current: t.current, Cluster: t.active.Cluster, Partitions: parts,
		Live: r.liveNow(), CutOff: r.cutOffAll(time.Now()), Acks: r.ak.upTo(t.current.Generation)})
	if changed {
		if err := r.publishTerm(ctx, t, next); err != nil {
			return fail(err)
		}
	}
	if err := r.awaitReleases(ctx, t, r.liveNow, log); err != nil {
		return fail(err)
	}
	ev.Phases["revoke"] = time.Since(began).Seconds()

	// 3. Translate the topics' positions.
	planned := r.h.quorumUpNow(mv.from)
	ops, err := r.translateAll(ctx, t, &ev, translateJob{from: ev.From, to: ev.To, planned: planned, log: log,
		only: func(logical string) bool { return slices.Contains(mv.topics, logical) }})
	if err != nil {
		return fail(err)
	}

	// 4. Activate: the topics on `to`, in the same transaction as the
	// generation that assigns them there.
	ta := time.Now()
	done := topicsMoved(t.active, mv, epoch)
	if err := r.activateOn(ctx, t, mv.to, activation{active: done, ops: ops, ev: &ev, began: ta}); err != nil {
		return fail(err)
	}
	if r.lists[mv.to] == nil {
		r.lists[mv.to] = t.found
	}
	log.Info("switched topics", zap.Duration("took", ev.Finished.Sub(ev.Started)), zap.Int("partitions", len(ev.Partitions)))
	return ev, nil
}

// beginTopicMove is step 1 of topicSwitch: it marks mv's topics switching
// in state/active (a resumed move has them marked) and returns when the
// move began.
func (r *leaderRun) beginTopicMove(ctx context.Context, t *term, mv *topicMove, now time.Time) (time.Time, error) {
	if mv.resume {
		if t.active.Leader != t.ID {
			mv.reason += " (resumed by " + t.ID + ")"
		}
		return t.active.Topics[mv.topics[0]].Since, nil
	}
	next := t.active
	next.Epoch++
	next.Topics = maps.Clone(t.active.Topics)
	if next.Topics == nil {
		next.Topics = map[string]state.TopicActive{}
	}
	for _, topic := range mv.topics {
		next.Topics[topic] = state.TopicActive{Cluster: mv.to, Phase: state.PhaseSwitching, From: mv.from, Epoch: next.Epoch,
			Reason: mv.reason, Since: now, Automatic: mv.auto}
	}
	return now, r.writeActive(ctx, t, next)
}

// topicsMoved returns active with mv's topics active on mv.to (no entry
// when mv.to is the fleet's cluster) in the move's epoch.
func topicsMoved(active state.Active, mv *topicMove, epoch int64) state.Active {
	done := active
	done.Topics = maps.Clone(active.Topics)
	for _, topic := range mv.topics {
		if mv.to == done.Cluster {
			delete(done.Topics, topic)
			continue
		}
		done.Topics[topic] = state.TopicActive{Cluster: mv.to, Phase: state.PhaseActive, Epoch: epoch, Reason: mv.reason,
			Since: time.Now().UTC(), Automatic: mv.auto}
	}
	if len(done.Topics) == 0 {
		done.Topics = nil
	}
	return done
}

package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/state"
)

// switchRequest is a switch the leader decided on.
type switchRequest struct {
	to, reason string
	// auto: decided by the leader's health verdict (not an operator's pin).
	auto bool
	// planned: the cluster being left is healthy, so the switch is made
	// before it is broken (prepare, and translate until the target caught
	// up).
	planned bool
	// stay are the logical topics pinned to stay where they are.
	stay []string
}

// switchTo moves the fleet to cluster to, or resumes a switch that a
// previous leader left in PhaseSwitching. Steps, each visible in etcd:
//
//  0. a planned switch (the cluster being left is reachable, and
//     BreakBeforeMake is off) is prepared first: agents warm their
//     clients to `to` and the leader pre-translates (prepare);
//  1. state/active := {to, epoch+1, switching} (skipped when resuming);
//  2. a generation on `to` in which every live owner releases what it
//     consumes; wait until each has committed and acknowledged (an agent
//     that does not within the drain bound is evicted: its lease is
//     revoked, so it can commit nothing more);
//  3. translate every partition's committed position on `from` to `to`
//     and write it (fenced);
//  4. in one transaction: the translated positions, state/active := {to,
//     active}, and the first generation on `to` (activate); then
//     history/<epoch> := the event.
//
// Nobody consumes `to` before step 4: it assigns partitions there in the
// same transaction that makes the phase active. So a leader that dies anywhere in 1–3
// leaves a state the next leader resumes from, and re-translating is safe.
func (r *leaderRun) switchTo(ctx context.Context, t *term, req switchRequest) (state.SwitchEvent, error) {
	to, reason, auto, planned := req.to, req.reason, req.auto, req.planned
	live := r.liveNow
	began := time.Now()
	from := t.active.Cluster
	started := began.UTC()
	var prep *prepared
	defer func() { prep.close() }()
	if t.active.Phase != state.PhaseSwitching && planned && (r.opts.Hooks == nil || !r.opts.Hooks.BreakBeforeMake) {
		prep = r.prepare(ctx, t, to, live, t.log.With(zap.String("from", from), zap.String("to", to)))
		if ctx.Err() != nil {
			return state.SwitchEvent{Started: started, Finished: time.Now().UTC()}, ctx.Err()
		}
	}
	prepTook := time.Since(began)
	began = time.Now()
	if t.active.Phase == state.PhaseSwitching {
		// The event keeps the switch's own start: a resumed switch
		// took from then, the leader's outage included.
		from, to, auto, started = t.active.From, t.active.Cluster, t.active.Automatic, t.active.Since
		reason = t.active.Reason
		if t.active.Leader != t.ID {
			reason += " (resumed by " + t.ID + ")"
		}
	} else {
		if sw := t.active.TopicSwitching(); len(sw) > 0 {
			reason += fmt.Sprintf(" (overrides the switch of %s in progress)", strings.Join(sw, ", "))
		}
		next := state.Active{Cluster: to, Epoch: t.active.Epoch + 1, Phase: state.PhaseSwitching, From: from, Reason: reason, Since: started, Automatic: auto}
		next.Topics = throughSwitch(t.active, to, req.stay, next.Epoch, started)
		if err := r.writeActive(ctx, t, next); err != nil {
			return state.SwitchEvent{Started: started, Finished: time.Now().UTC()}, err
		}
	}
	ev := state.SwitchEvent{Epoch: t.active.Epoch, From: from, To: to, Reason: reason, Started: started, Phases: map[string]float64{}, Leader: t.ID, Token: t.Rev, Automatic: auto}
	fail := func(err error) (state.SwitchEvent, error) {
		ev.Finished = time.Now().UTC()
		return ev, err
	}
	if prep != nil {
		ev.Phases["prepare"] = prepTook.Seconds()
	}
	log := t.log.With(zap.String("from", from), zap.String("to", to), zap.Int64("epoch", ev.Epoch))
	log.Info("switching clusters", zap.String("reason", reason), zap.Bool("prepared", prep != nil))

	// 2. Release everything that moves.
	if err := r.releaseAll(ctx, t, live, log); err != nil {
		return fail(err)
	}
	ev.Phases["revoke"] = time.Since(began).Seconds()

	// 3. Translate the topics that move: those state/active does not
	// place (already consumed on `to`, or staying on `from`).
	leaving := t.active
	ops, err := r.translateAll(ctx, t, &ev, translateJob{from: from, to: to, prep: prep, planned: planned, log: log,
		only: func(logical string) bool { _, placed := leaving.Topics[logical]; return !placed }})
	if err != nil {
		return fail(err)
	}

	// 4. Activate.
	ta := time.Now()
	active := state.Active{Cluster: to, Epoch: ev.Epoch, Phase: state.PhaseActive, From: from, Reason: reason, Since: time.Now().UTC(), Automatic: auto}
	active.Topics = placedElsewhere(leaving.Topics, to)
	if err := r.activateOn(ctx, t, to, activation{active: active, ops: ops, ev: &ev, began: ta}); err != nil {
		return fail(err)
	}
	r.countLate(ctx, t.Term, ev, log)
	log.Info("switched clusters", zap.Duration("took", ev.Finished.Sub(ev.Started)), zap.Int("partitions", len(ev.Partitions)))
	return ev, nil
}

// record writes ev to history/<epoch>, fenced by the term (writeHistory),
// allowing etcd's request timeout for each of its writes.
func (l *Leader) record(ctx context.Context, term election.Term, ev state.SwitchEvent, log *zap.Logger) {
	hctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout*time.Duration(1+len(ev.Partitions)/historyChunk))
	defer cancel()
	if err := writeHistory(hctx, term, l.keys, ev); err != nil {
		log.Warn("could not record the switch in history/", zap.Int64("epoch", ev.Epoch), zap.Int("partitions", len(ev.Partitions)), zap.Error(err))
	}
}

// placedElsewhere returns the topic placements of topics not on to (nil
// when none): those a fleet switch to `to` leaves where they are.
func placedElsewhere(topics map[string]state.TopicActive, to string) map[string]state.TopicActive {
	var out map[string]state.TopicActive
	for topic, e := range topics {
		if e.Cluster != to {
			if out == nil {
				out = map[string]state.TopicActive{}
			}
			out[topic] = e
		}
	}
	return out
}

// activation is what activate writes in one transaction: the state
// (active), the translated positions (ops), and the switch's record
// (history/<epoch>), so that no switch takes effect unrecorded. The
// event's activate phase, from began, and its Finished are set as the
// transaction is sent.
type activation struct {
	active state.Active
	ops    []clientv3.Op
	ev     *state.SwitchEvent
	began  time.Time
}

// activateOn is activate, planned on the partitions consumed under
// act.active: the translation's listing of `to` (t.found) with the
// leader's of the others.
func (r *leaderRun) activateOn(ctx context.Context, t *term, to string, act activation) error {
	lists := maps.Clone(r.lists)
	lists[to] = t.found
	parts, listed := consumed(act.active, lists, r.conf().naming)
	if !listed {
		return fmt.Errorf("coordinator: activate %s: the partitions of %s are not listed yet", to, strings.Join(inUse(act.active), ", "))
	}
	return r.activate(ctx, t, act, parts)
}

// maxSwitchOps bounds the operations of one switch transaction, under
// etcd's default --max-txn-ops (128).
const maxSwitchOps = 100

// activate completes a switch in one transaction, fenced by the term and
// the revisions of state/active and state/assignment: the translated
// positions (act.ops), state/active := act.active, the next generation
// over the agents live now and not cut off (by cluster), planned on parts:
// by cluster, the partitions consumed there under act.active (those the
// translation listed on the target among them), and the switch's record
// in history/. Agents start on the new cluster the moment the switch is
// visible, at the positions written with it. Positions too many for one
// transaction, and the chunks of a record too large for one value, are
// written first, fenced the same way: harmless, as nobody consumes the
// target before state/active says so, and nobody reads a chunk without
// its event.
func (r *leaderRun) activate(ctx context.Context, t *term, act activation, parts map[string][]state.TopicPartition) error {
	a, ops := act.active, act.ops
	l, live, cut := r.Leader, r.liveNow(), r.cutOffAll(time.Now())
	a.Leader, a.Token = t.ID, t.Rev
	aval, err := json.Marshal(a)
	if err != nil {
		return err
	}
	cmps := []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(l.keys.Active()), "=", t.activeRev)}
	final := []clientv3.Op{clientv3.OpPut(l.keys.Active(), string(aval))}
	next, changed := PlanSections(SectionsInput{Current: t.current, Cluster: a.Cluster, Partitions: parts, Live: live, CutOff: cut, Acks: t.acks.upTo(t.current.Generation)})
	if changed && parts != nil {
		next.Leader, next.Token, next.Published = t.ID, t.Rev, time.Now().UTC()
		val, err := json.Marshal(next)
		if err != nil {
			return err
		}
		cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(l.keys.Assignment()), "=", t.currentRev))
		final = append(final, clientv3.OpPut(l.keys.Assignment(), string(val)))
	} else {
		changed = false
	}
	if act.ev != nil {
		put, err := r.recordWith(ctx, t, act)
		if err != nil {
			return err
		}
		final = append(final, put)
	}
	if len(ops)+len(final) > maxSwitchOps {
		for chunk := range slices.Chunk(ops, maxSwitchOps) {
			wctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
			_, err := t.Txn(wctx, cmps[:1], chunk...)
			cancel()
			if err != nil {
				return fmt.Errorf("coordinator: write translated positions: %w", err)
			}
		}
		ops = nil
	}
	wctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := t.Txn(wctx, cmps, append(ops, final...)...)
	if err != nil {
		return fmt.Errorf("coordinator: activate %s: %w", a.Cluster, err)
	}
	t.active, t.activeRev = a, resp.Header.Revision
	if changed {
		t.current, t.currentRev = next, resp.Header.Revision
		t.log.Info("published assignment", zap.Int64("generation", next.Generation), zap.String("cluster", next.Cluster),
			zap.Int("agents", len(next.Owned)), zap.Int("revoking", revokingPartitions(next)), zap.Strings("placed", next.Sections()[1:]),
			zap.Bool("with_activation", true))
	}
	return nil
}

// recordWith completes act's event as of now, writes the chunks of its
// partitions if it has too many for one value, and returns the write of
// the event for the activation's transaction.
func (r *leaderRun) recordWith(ctx context.Context, t *term, act activation) (clientv3.Op, error) {
	act.ev.Phases["activate"] = time.Since(act.began).Seconds()
	act.ev.Finished = time.Now().UTC()
	chunks, put, err := historyOps(r.keys, *act.ev)
	if err != nil {
		return put, err
	}
	wctx, cancel := context.WithTimeout(ctx, r.cfg.Etcd.RequestTimeout*time.Duration(1+len(chunks)))
	defer cancel()
	if err := writeChunks(wctx, t.Term, chunks); err != nil {
		return put, fmt.Errorf("coordinator: record the switch in history/: %w", err)
	}
	return put, nil
}

// abandonSwitch ends the switch in progress without completing it: the
// fleet returns to the cluster it was leaving, in the same epoch, and
// history/<epoch> records the attempt with why it was abandoned. It is
// safe: nobody consumes the target before the switch activates it, and
// the positions on the origin are those the agents committed when they
// released it (positions already translated to the target are written
// again by the next switch there).
func (l *Leader) abandonSwitch(ctx context.Context, t *term, why string) error {
	from, to := t.active.From, t.active.Cluster
	ev := state.SwitchEvent{Epoch: t.active.Epoch, From: from, To: to, Reason: t.active.Reason, Started: t.active.Since,
		Phases: map[string]float64{}, Leader: t.ID, Token: t.Rev, Automatic: t.active.Automatic, Abandoned: why}
	// The topics consumed on `to` before the switch stay placed there:
	// their positions are there.
	back := state.Active{Cluster: from, Epoch: t.active.Epoch, Phase: state.PhaseActive, Since: time.Now().UTC(),
		Reason: fmt.Sprintf("back on %s: the switch to %s was abandoned: %s", from, to, why), Topics: t.active.Topics}
	if err := l.writeActive(ctx, t, back); err != nil {
		return err
	}
	ev.Finished = time.Now().UTC()
	l.record(ctx, t.Term, ev, t.log)
	t.log.Warn("abandoned the cluster switch: back on the cluster it was leaving",
		zap.String("from", from), zap.String("to", to), zap.Int64("epoch", ev.Epoch), zap.String("why", why))
	return nil
}

// releaseAll publishes a generation in which every live owner releases
// what moves in the fleet switch in progress (t.active, switching), and
// waits until each has acknowledged it. What state/active keeps where it
// is consumed (topics placed on the target already, topics staying on
// the cluster being left) stays with its owners: they are not paused.
func (r *leaderRun) releaseAll(ctx context.Context, t *term, live func() []string, log *zap.Logger) error {
	keep := map[string][]state.TopicPartition{}
	naming := r.conf().naming
	for _, c := range t.current.Sections() {
		for _, tps := range t.current.Section(c).Owned {
			for _, tp := range tps {
				if tc, moving := t.active.TopicCluster(naming.Logical(c, tp.Topic)); tc == c && !moving {
					keep[c] = append(keep[c], tp)
				}
			}
		}
	}
	next, changed := PlanSections(SectionsInput{Current: t.current, Cluster: t.active.Cluster, Partitions: keep,
		Live: live(), Acks: t.acks.upTo(t.current.Generation)})
	if changed {
		if err := r.publishTerm(ctx, t, next); err != nil {
			return err
		}
	}
	return r.awaitReleases(ctx, t, live, log)
}

// awaitReleases waits until every live agent has acknowledged the current
// generation's releases. Agents drain their handlers (bounded by their
// drain timeout, 5 s by default) before they commit and acknowledge; one
// that has not within ackTimeout is evicted: its lease is revoked, so it
// can commit nothing more.
func (l *Leader) awaitReleases(ctx context.Context, t *term, live func() []string, log *zap.Logger) error {
	deadline := time.Now().Add(l.ackTimeout())
	for {
		waiting := l.unacked(t, live())
		if len(waiting) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			for _, id := range waiting {
				log.Warn("agent did not release its partitions in time; evicting it", zap.String("laggard", id))
				l.evictLease(ctx, t.Term, id, log)
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.acks.changed:
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (l *Leader) ackTimeout() time.Duration { return 10 * time.Second }

// unacked returns the live agents that still hold partitions of the
// current generation unreleased.
func (l *Leader) unacked(t *term, live []string) []string {
	acks := t.acks.upTo(t.current.Generation)
	var out []string
	for _, id := range live {
		if t.current.Revokes(id) && acks[id] < t.current.Generation {
			out = append(out, id)
		}
	}
	return out
}

// throughSwitch returns the topics of a that a fleet switch to `to` (under
// epoch) leaves where they are consumed: those whose positions are on
// `to` already, which join the fleet there, and those of stay, pinned to
// the cluster being left and consumed there now, which stay placed there.
// Every other topic follows the fleet: its positions are translated.
func throughSwitch(a state.Active, to string, stay []string, epoch int64, since time.Time) map[string]state.TopicActive {
	out := map[string]state.TopicActive{}
	for topic, e := range a.Topics {
		if a.PositionsOf(topic) != to {
			continue
		}
		e.Phase, e.From = state.PhaseActive, ""
		out[topic] = e
	}
	for _, topic := range stay {
		if a.PositionsOf(topic) != a.Cluster {
			continue
		}
		e, ok := a.Topics[topic]
		if !ok || e.Phase != state.PhaseActive {
			e = state.TopicActive{Cluster: a.Cluster, Phase: state.PhaseActive, Epoch: epoch, Since: since.UTC(),
				Reason: fmt.Sprintf("pinned to %s: stays there while the fleet moves to %s", a.Cluster, to)}
		}
		out[topic] = e
	}
	if len(out) == 0 {
		return nil
	}
	return out
}

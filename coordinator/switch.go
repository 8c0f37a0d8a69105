package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/translate"
)

// term is the state of one leader term that the switch and the planning
// loop share. Only the Run goroutine touches it.
type term struct {
	election.Term
	log        *zap.Logger
	active     Active
	activeRev  int64
	current    Assignment
	currentRev int64
	acks       *acks
	// found are the source partitions on the target of the last switch,
	// listed by its translation: the first assignment there needs no
	// discovery round.
	found []TopicPartition
	// failback is the failback check this term last wrote to
	// state/failback.
	failback *FailbackCheck
	// stalled is the set of partitions the term last wrote to
	// state/stalled (nil: not written yet in this term).
	stalled *string
}

// writeActive publishes a, fenced by the term and the revision it replaces.
func (l *Leader) writeActive(ctx context.Context, t *term, a Active) error {
	a.Leader, a.Token = t.ID, t.Rev
	val, err := json.Marshal(a)
	if err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := t.Txn(wctx, []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(l.keys.Active()), "=", t.activeRev)},
		clientv3.OpPut(l.keys.Active(), string(val)))
	if err != nil {
		return fmt.Errorf("coordinator: write state/active: %w", err)
	}
	t.active, t.activeRev = a, resp.Header.Revision
	return nil
}

// readActive reads state/active. When it is absent, malformed, names a
// cluster this configuration lacks, or is not a value a leader wrote
// (believable), the active cluster and epoch are recovered from what else
// the fleet recorded (recoverActive), and the result is marked to be
// written back at once.
func (l *Leader) readActive(ctx context.Context) (Active, int64, error) {
	rctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
	defer cancel()
	// One snapshot of both keys: a switch writes them together.
	resp, err := l.etcd.Txn(rctx).Then(clientv3.OpGet(l.keys.Active()), clientv3.OpGet(l.keys.Assignment())).Commit()
	if err != nil {
		return Active{}, 0, err
	}
	act, asg := resp.Responses[0].GetResponseRange().Kvs, resp.Responses[1].GetResponseRange().Kvs
	var rev int64
	why := "absent"
	if len(act) > 0 {
		rev = act[0].ModRevision
		a, err := ParseActive(act[0].Value)
		_, known := l.conf().clusters[a.Cluster]
		switch {
		case err != nil:
			why = err.Error()
		case !known:
			why = "names cluster " + a.Cluster + ", which this configuration lacks"
		default:
			if why, err = l.believable(rctx, a, rev, asg); err != nil {
				return Active{}, 0, err
			}
			if why == "" {
				return a, rev, nil
			}
			l.metrics.refusedValue(refused.Active)
		}
	}
	a, err := l.recoverActive(rctx)
	if err != nil {
		return Active{}, 0, err
	}
	if rev != 0 || a.Epoch > 1 {
		l.log.Warn("state/active is unusable; recovered the active cluster and epoch from state/assignment and history/",
			zap.String("found", why), zap.String("active", a.Cluster), zap.Int64("epoch", a.Epoch))
	}
	return a, rev, nil
}

// believable returns "" when a, found in state/active at revision rev at
// the start of a term, can be a value a leader wrote, else why not. The
// fleet's cluster changes only by a switch, and every switch leaves a
// trace: history/ names where the last one left the fleet (its target, or
// its origin when abandoned; the primary before any), and a switch that
// completed but whose history entry is not written yet wrote state/active
// in the same transaction as the assignment on its target (activate), so
// at the same revision. A value that moves the fleet elsewhere with
// neither was written by someone else: taken as it is, the new leader
// would consume a cluster with no switch, no translation and no history
// entry (from offset 0 of a cluster never consumed). asg is
// state/assignment in the same snapshot as a.
func (l *Leader) believable(ctx context.Context, a Active, rev int64, asg []*mvccpb.KeyValue) (string, error) {
	on, err := l.lastFleetCluster(ctx)
	if err != nil {
		return "", err
	}
	switch a.Phase {
	case PhaseSwitching:
		if a.From != on {
			return fmt.Sprintf("is a switch from %s to %s (epoch %d), but history/ leaves the fleet on %s: a switch starts where the fleet is",
				a.From, a.Cluster, a.Epoch, on), nil
		}
	default:
		if a.Cluster == on {
			return "", nil
		}
		if len(asg) > 0 && asg[0].ModRevision == rev {
			if g, err := ParseAssignment(asg[0].Value); err == nil && g.Cluster == a.Cluster {
				return "", nil // a switch activated, its history not yet written
			}
		}
		return fmt.Sprintf("names cluster %s (epoch %d), but history/ leaves the fleet on %s and no switch to %s wrote state/assignment with it",
			a.Cluster, a.Epoch, on, a.Cluster), nil
	}
	return "", nil
}

// historyPage is how many history/ entries lastFleetCluster reads at a
// time: topic switches between fleet switches are skipped.
const historyPage = 32

// lastFleetCluster returns the cluster history/ leaves the fleet on: the
// target of its last fleet switch (not a topic switch), the origin if that
// switch was abandoned, the primary if there is none. Malformed entries
// are skipped.
func (l *Leader) lastFleetCluster(ctx context.Context) (string, error) {
	end := clientv3.GetPrefixRangeEnd(l.keys.SwitchHistory())
	for {
		resp, err := l.etcd.Get(ctx, l.keys.SwitchHistory(), clientv3.WithRange(end),
			clientv3.WithSort(clientv3.SortByKey, clientv3.SortDescend), clientv3.WithLimit(historyPage))
		if err != nil {
			return "", err
		}
		for _, kv := range resp.Kvs {
			ev, err := ParseSwitchEvent(kv.Value)
			if err != nil || len(ev.Topics) > 0 {
				continue
			}
			if ev.Abandoned != "" {
				return ev.From, nil
			}
			return ev.To, nil
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return l.conf().primary, nil
		}
		end = string(resp.Kvs[len(resp.Kvs)-1].Key)
	}
}

// recoverActive returns the fleet's active cluster and epoch as the rest
// of its state records them, marked to be written: the cluster of
// state/assignment (where agents consume now), else the target of the
// last switch in history/, else the primary; the epoch of the last switch
// in history/ (1 if none), so that the next switch takes the epoch after
// every recorded one and never overwrites an entry.
func (l *Leader) recoverActive(ctx context.Context) (Active, error) {
	conf := l.conf()
	a := Active{Cluster: conf.primary, Epoch: 1, Phase: PhaseActive, Reason: "initial", Since: time.Now().UTC(), unwritten: true}
	resp, err := l.etcd.Get(ctx, l.keys.SwitchHistory(), clientv3.WithLastKey()...)
	if err != nil {
		return a, err
	}
	if len(resp.Kvs) > 0 {
		if ev, err := ParseSwitchEvent(resp.Kvs[0].Value); err == nil && ev.Epoch > 0 {
			a.Epoch = ev.Epoch
			switch {
			case len(ev.Topics) > 0:
				// A topic switch: the fleet's cluster is not in it.
			case ev.Abandoned != "":
				a.Cluster, a.Reason = ev.From, "recovered from history/"
			default:
				a.Cluster, a.Reason = ev.To, "recovered from history/"
			}
		}
	}
	if resp, err = l.etcd.Get(ctx, l.keys.Assignment()); err != nil {
		return a, err
	}
	if len(resp.Kvs) > 0 {
		if asg, err := ParseAssignment(resp.Kvs[0].Value); err == nil && asg.Cluster != "" {
			a.Cluster, a.Reason = asg.Cluster, "recovered from state/assignment"
			a.Topics = recoverPlaced(asg, a, conf)
		}
	}
	if _, ok := conf.clusters[a.Cluster]; !ok {
		a.Cluster, a.Topics = conf.primary, nil
	}
	return a, nil
}

// recoverPlaced returns the topics asg consumes on a cluster other than
// its own (its placed sections), placed there in a: their positions are
// there, and treating them as on a.Cluster would consume them again from
// older positions.
func recoverPlaced(asg Assignment, a Active, conf *dynamic) map[string]TopicActive {
	var out map[string]TopicActive
	for _, c := range asg.Sections()[1:] {
		if _, ok := conf.clusters[c]; !ok || c == a.Cluster {
			continue
		}
		sec := asg.Section(c)
		for _, m := range []map[string][]TopicPartition{sec.Owned, sec.Revoking} {
			for _, tps := range m {
				for _, tp := range tps {
					if out == nil {
						out = map[string]TopicActive{}
					}
					out[conf.naming.Logical(c, tp.Topic)] = TopicActive{Cluster: c, Phase: PhaseActive, Epoch: a.Epoch,
						Reason: "recovered from state/assignment", Since: a.Since}
				}
			}
		}
	}
	return out
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
func (r *leaderRun) switchTo(ctx context.Context, t *term, to, reason string, auto, planned bool, stay []string) (SwitchEvent, error) {
	live := r.liveNow
	began := time.Now()
	from := t.active.Cluster
	started := began.UTC()
	var prep *prepared
	defer func() { prep.close() }()
	if t.active.Phase != PhaseSwitching && planned && !r.opts.BreakBeforeMake {
		prep = r.prepare(ctx, t, to, live, t.log.With(zap.String("from", from), zap.String("to", to)))
		if ctx.Err() != nil {
			return SwitchEvent{Started: started, Finished: time.Now().UTC()}, ctx.Err()
		}
	}
	prepTook := time.Since(began)
	began = time.Now()
	if t.active.Phase == PhaseSwitching {
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
		next := Active{Cluster: to, Epoch: t.active.Epoch + 1, Phase: PhaseSwitching, From: from, Reason: reason, Since: started, Automatic: auto}
		next.Topics = throughSwitch(t.active, to, stay, next.Epoch, started)
		if err := r.writeActive(ctx, t, next); err != nil {
			return SwitchEvent{Started: started, Finished: time.Now().UTC()}, err
		}
	}
	ev := SwitchEvent{Epoch: t.active.Epoch, From: from, To: to, Reason: reason, Started: started, Phases: map[string]float64{}, Leader: t.ID, Token: t.Rev, Automatic: auto}
	fail := func(err error) (SwitchEvent, error) {
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
	ops, err := r.translateAll(ctx, t, &ev, prep, planned, func(logical string) bool { _, placed := leaving.Topics[logical]; return !placed }, log)
	if err != nil {
		return fail(err)
	}

	// 4. Activate.
	ta := time.Now()
	active := Active{Cluster: to, Epoch: ev.Epoch, Phase: PhaseActive, From: from, Reason: reason, Since: time.Now().UTC(), Automatic: auto}
	for topic, e := range leaving.Topics {
		if e.Cluster != to {
			if active.Topics == nil {
				active.Topics = map[string]TopicActive{}
			}
			active.Topics[topic] = e
		}
	}
	lists := maps.Clone(r.lists)
	lists[to] = t.found
	parts, listed := consumed(active, lists, r.conf().naming)
	if !listed {
		return fail(fmt.Errorf("coordinator: activate %s: the partitions of %s are not listed yet", to, strings.Join(inUse(active), ", ")))
	}
	if err := r.activate(ctx, t, active, ops, parts, live(), r.cutOffAll(time.Now())); err != nil {
		return fail(err)
	}
	ev.Phases["activate"] = time.Since(ta).Seconds()
	ev.Finished = time.Now().UTC()
	r.record(ctx, t.Term, ev, log)
	r.countLate(ctx, t.Term, ev, log)
	log.Info("switched clusters", zap.Duration("took", ev.Finished.Sub(ev.Started)), zap.Int("partitions", len(ev.Partitions)))
	return ev, nil
}

// record writes ev to history/<epoch>, fenced by the term (writeHistory),
// allowing etcd's request timeout for each of its writes.
func (l *Leader) record(ctx context.Context, term election.Term, ev SwitchEvent, log *zap.Logger) {
	hctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout*time.Duration(1+len(ev.Partitions)/historyChunk))
	defer cancel()
	if err := writeHistory(hctx, term, l.keys, ev); err != nil {
		log.Warn("could not record the switch in history/", zap.Int64("epoch", ev.Epoch), zap.Int("partitions", len(ev.Partitions)), zap.Error(err))
	}
}

// maxSwitchOps bounds the operations of one switch transaction, under
// etcd's default --max-txn-ops (128).
const maxSwitchOps = 100

// activate completes a switch in one transaction, fenced by the term and
// the revisions of state/active and state/assignment: the translated
// positions (ops), state/active := a, and the next generation over the
// live agents not cut off (by cluster), planned on parts: by cluster, the
// partitions consumed there under a (those the translation listed on the
// target among them). Agents start on the new cluster the moment the
// switch is visible, at the positions written with it. Positions too many
// for one transaction are written first, fenced the same way: harmless,
// as nobody consumes the target before state/active says so.
func (l *Leader) activate(ctx context.Context, t *term, a Active, ops []clientv3.Op, parts map[string][]TopicPartition, live []string, cut map[string][]string) error {
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

// abandonSwitch ends the switch in progress without completing it: the
// fleet returns to the cluster it was leaving, in the same epoch, and
// history/<epoch> records the attempt with why it was abandoned. It is
// safe: nobody consumes the target before the switch activates it, and
// the positions on the origin are those the agents committed when they
// released it (positions already translated to the target are written
// again by the next switch there).
func (l *Leader) abandonSwitch(ctx context.Context, t *term, why string) error {
	from, to := t.active.From, t.active.Cluster
	ev := SwitchEvent{Epoch: t.active.Epoch, From: from, To: to, Reason: t.active.Reason, Started: t.active.Since,
		Phases: map[string]float64{}, Leader: t.ID, Token: t.Rev, Automatic: t.active.Automatic, Abandoned: why}
	// The topics consumed on `to` before the switch stay placed there:
	// their positions are there.
	back := Active{Cluster: from, Epoch: t.active.Epoch, Phase: PhaseActive, Since: time.Now().UTC(),
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
	keep := map[string][]TopicPartition{}
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

// translation is what a switch translates positions with: a client of the
// target, one Translator per MirrorMaker 2 flow between the two clusters,
// and the source partitions found on the target. A planned switch opens it
// before it revokes anything, so that the translation after the revoke
// runs on connected clients with loaded metadata.
//
// A physical topic whose origin is `from` (A's orders, going to B's
// A.orders) is translated forward along the flow into `to`; one whose
// origin is `to` (A's B.orders, going back to B's orders) backward along
// the flow into `from`.
type translation struct {
	from, to string
	naming   Naming
	target   sarama.Client
	// fwd translates along the flow into `to`, back along the flow into
	// `from`.
	fwd, back *translate.Translator
	// source is a client of `from`, opened only when a flow's
	// offset-syncs live there (in a failover `from` is down, and opening
	// it costs a connection timeout): at most once, on first use.
	source *lazyClient
	// all are the source partitions on `to`, sorted; tps those of them
	// to translate (restrict).
	all, tps []TopicPartition
	// unconsumed is source.initial_offset: where a partition nothing was
	// consumed from yet continues (translate.Request.Unconsumed).
	unconsumed string
}

// lazyClient opens a client on first use and keeps it (or the failure).
// The opening is given up after within: sarama's NewClient bounds each
// seed broker's dial and metadata request by the timeout, not the whole,
// so a cluster whose brokers accept connections and answer nothing (a
// hung or blackholed data centre) costs the timeout once per broker. A
// given-up opening runs on in bg and closes its client when it ends.
type lazyClient struct {
	once   sync.Once
	open   func() (sarama.Client, error)
	within time.Duration
	bg     *sync.WaitGroup
	client sarama.Client
}

func (c *lazyClient) get() sarama.Client {
	c.once.Do(func() {
		type opened struct {
			client sarama.Client
			err    error
		}
		done := make(chan opened, 1)
		c.bg.Add(1)
		go func() {
			defer c.bg.Done()
			cl, err := c.open()
			done <- opened{cl, err}
		}()
		timer := time.NewTimer(c.within)
		defer timer.Stop()
		select {
		case o := <-done:
			if o.err == nil {
				c.client = o.client
			}
		case <-timer.C:
			c.bg.Add(1)
			go func() {
				defer c.bg.Done()
				if o := <-done; o.err == nil {
					_ = o.client.Close()
				}
			}()
		}
	})
	return c.client
}

func (c *lazyClient) close() {
	c.once.Do(func() {}) // no open after close
	if c.client != nil {
		_ = c.client.Close()
	}
}

// openTranslation connects to `to` and lists the source partitions there.
// fromDown says a quorum of agents does not reach `from` (a failover):
// translation then never connects to it, and the offset-syncs kept there
// are not read. Fingerprints and timestamps on `to` still translate every
// position; trying a cluster the fleet has just declared down would cost
// the switch a probe timeout when its brokers hang, and nothing when they
// refuse, so a switch from a hung cluster is as fast as from a stopped one.
func (l *Leader) openTranslation(ctx context.Context, from, to string, fromDown bool, log *zap.Logger) (*translation, error) {
	conf := l.conf()
	target, err := kafka.NewClientWith(to, conf.clusters[to], kafka.Options{Dialer: l.dialer(to)})
	if err != nil {
		return nil, err
	}
	x := &translation{from: from, to: to, naming: conf.naming, target: target, unconsumed: conf.source.InitialOffset}
	x.source = &lazyClient{open: func() (sarama.Client, error) {
		if fromDown {
			return nil, fmt.Errorf("coordinator: %s is down: its offset-syncs are not read", from)
		}
		return kafka.NewClientWith(from, conf.clusters[from],
			kafka.Options{Dialer: l.dialer(from), Timeout: l.cfg.Failover.ProbeTimeout})
	}, within: l.cfg.Failover.ProbeTimeout, bg: l.bg}
	d := &discovery{leader: l, cluster: to, log: log, client: target, def: conf.clusters[to], missing: map[string]bool{}}
	if x.all, err = d.partitions(ctx, conf); err != nil {
		x.close()
		return nil, err
	}
	x.tps = x.all
	flow := func(into string) *translate.Translator {
		rep := conf.cfg.Replication(into)
		tr := &translate.Translator{Target: target, Replication: rep, TimestampMargin: l.cfg.Failover.TimestampMargin,
			SyncsCache: new(translate.SyncsCache)}
		switch rep.OffsetSyncsCluster {
		case to:
			tr.Syncs = target
		case from:
			tr.OpenSyncs = x.source.get
		}
		return tr
	}
	x.fwd, x.back = flow(to), flow(from)
	return x, nil
}

// restrict makes x translate the partitions of the logical topics only
// accepts (all when nil).
func (x *translation) restrict(only func(logical string) bool) {
	x.tps = x.all
	if only != nil {
		x.tps = slices.DeleteFunc(slices.Clone(x.all), func(tp TopicPartition) bool { return !only(x.naming.Logical(x.to, tp.Topic)) })
	}
}

func (x *translation) close() {
	if x == nil {
		return
	}
	x.source.close()
	_ = x.target.Close()
}

// request returns the translator and the request that translate position
// pos of stream s from x.from to x.to, where the stream's partition is
// tp on x.to.
func (x *translation) request(s Stream, tp TopicPartition, pos offsets.Commit, group string, hint *translate.Hint) (*translate.Translator, translate.Request) {
	req := translate.Request{From: x.from, To: x.to, Topic: tp.Topic, SourceTopic: x.naming.TopicOn(x.from, s),
		Partition: tp.Partition, Position: pos, Hint: hint, Unconsumed: x.unconsumed}
	if x.naming.FromStandby(s) {
		// Records written on the standby are never skipped.
		req.Unconsumed = "oldest"
	}
	if _, forward := x.naming.Flow(x.from, x.to, s); !forward {
		req.Direction = translate.Backward
		return x.back, req
	}
	// Checkpoints are the group's on the flow's target: only forward.
	req.Direction, req.Group = translate.Forward, group
	return x.fwd, req
}

// committed returns the positions committed on cluster, by physical
// partition there.
func (l *Leader) committed(ctx context.Context, cluster string, log *zap.Logger) (map[TopicPartition]offsets.Position, error) {
	lctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
	positions, bad, err := l.store.List(lctx, cluster)
	cancel()
	if err != nil {
		return nil, err
	}
	for _, b := range bad {
		log.Warn("ignoring malformed committed offset", zap.Error(b))
	}
	byPartition := make(map[TopicPartition]offsets.Position, len(positions))
	for _, p := range positions {
		byPartition[TopicPartition{Topic: p.Topic, Partition: p.Partition}] = p
	}
	return byPartition, nil
}

// translate translates every partition of x.tps from the position of the
// same stream's partition on x.from in positions, starting each
// fingerprint scan from its hint (by partition on x.to) when there is one.
// It returns each partition's outcome and the commits to write on x.to;
// the error joins every partition's failure.
func (l *Leader) translate(ctx context.Context, x *translation, positions map[TopicPartition]offsets.Position,
	hints map[TopicPartition]*translate.Hint) ([]PartitionSwitch, []offsets.Commit, error) {
	type result struct {
		ps     PartitionSwitch
		commit *offsets.Commit
		err    error
	}
	results := make([]result, len(x.tps))
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for i, tp := range x.tps {
		s := x.naming.Stream(x.to, tp.Topic)
		fromTP := TopicPartition{Topic: x.naming.TopicOn(x.from, s), Partition: tp.Partition}
		ps := PartitionSwitch{Topic: s.Logical, Origin: s.Origin, FromTopic: fromTP.Topic, ToTopic: tp.Topic, Partition: tp.Partition}
		pos, ok := positions[fromTP]
		if !ok {
			start := "source.initial_offset"
			if x.naming.FromStandby(s) {
				start = "its oldest offset (a topic written on the standby)"
			}
			ps.FromOffset, ps.ToOffset, ps.Method, ps.Rewound = -1, -1, "none", -1
			ps.Detail = "no committed position on " + x.from + ": starts at its committed position on " + x.to + " if any, else at " + start
			results[i] = result{ps: ps}
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			tr, req := x.request(s, tp, pos.Commit, l.cfg.Source.Group, hints[tp])
			res, err := tr.Translate(ctx, req)
			if err != nil {
				results[i] = result{err: err}
				return
			}
			c := offsets.Commit{Cluster: x.to, Topic: tp.Topic, Partition: tp.Partition, Offset: res.Offset,
				Timestamp: pos.Timestamp, Fingerprints: pos.Fingerprints}
			if int64(len(c.Fingerprints)) > c.Offset {
				c.Fingerprints = c.Fingerprints[int64(len(c.Fingerprints))-c.Offset:]
			}
			ps.FromOffset, ps.ToOffset, ps.ToEnd = pos.Offset, res.Offset, res.End
			ps.Method, ps.Rewound, ps.Lagged, ps.Detail = string(res.Method), res.Rewound, res.Lagged, res.Detail
			results[i] = result{commit: &c, ps: ps}
		}()
	}
	wg.Wait()
	var commits []offsets.Commit
	var parts []PartitionSwitch
	var errs []error
	for _, r := range results {
		if r.err != nil {
			errs = append(errs, r.err)
			continue
		}
		parts = append(parts, r.ps)
		if r.commit != nil {
			commits = append(commits, *r.commit)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return parts, commits, fmt.Errorf("coordinator: translate positions %s → %s: %w", x.from, x.to, err)
	}
	return parts, commits, nil
}

// translateAll translates every partition on ev.To of the source topics
// only accepts (all when nil) from its committed position on ev.From,
// records the outcomes and the phase's durations (translate, and of it
// replica_wait: the wait for the replica to hold what the fleet consumed)
// in ev, and returns the operations that write the translated positions.
// It uses prep's clients and hints when a planned switch prepared them.
//
// In a planned switch the replica may be a little behind the fleet (the
// replicator copies what the fleet has just consumed): records consumed on
// `from` but not yet on `to` would be delivered again once copied. So a
// planned switch translates again, every lagPoll, until the target holds
// every consumed record, for at most prepareTimeout; a failover cannot
// wait for a replicator whose source is gone, and reports the lag.
func (l *Leader) translateAll(ctx context.Context, t *term, ev *SwitchEvent, prep *prepared, planned bool, only func(logical string) bool, log *zap.Logger) (
	[]clientv3.Op, error) {
	began := time.Now()
	parts, ops, waited, err := l.translateFrom(ctx, t, ev.From, ev.To, prep, planned, only, log)
	ev.Partitions = parts
	ev.Phases["translate"] = time.Since(began).Seconds()
	if waited > 0 {
		ev.Phases["replica_wait"] = waited.Seconds()
	}
	return ops, err
}

// translateFrom is translateAll's work, from `from` to `to`.
func (l *Leader) translateFrom(ctx context.Context, t *term, from, to string, prep *prepared, planned bool, only func(logical string) bool, log *zap.Logger) (
	parts []PartitionSwitch, ops []clientv3.Op, replicaWait time.Duration, err error) {
	x, hints := prep.use(from, to)
	if x == nil {
		if x, err = l.openTranslation(ctx, from, to, !planned, log); err != nil {
			return nil, nil, 0, err
		}
		defer x.close()
	}
	x.restrict(only)
	positions, err := l.committed(ctx, from, log)
	if err != nil {
		return nil, nil, 0, err
	}
	parts, commits, err := l.translate(ctx, x, positions, hints)
	if err == nil && planned && lagging(parts) > 0 {
		began := time.Now()
		for deadline := began.Add(l.prepareTimeout()); err == nil && lagging(parts) > 0 && time.Now().Before(deadline); {
			select {
			case <-ctx.Done():
				return parts, nil, 0, ctx.Err()
			case <-time.After(lagPoll):
			}
			parts, commits, err = l.translate(ctx, x, positions, hints)
		}
		replicaWait = time.Since(began)
	}
	if err != nil {
		return parts, nil, 0, err
	}
	if n := lagging(parts); n > 0 {
		log.Warn("the target lacks records the fleet consumed; if the replicator copies them later they are delivered again",
			zap.Int64("lagged", n), zap.Bool("planned", planned))
	}
	for _, ps := range parts {
		if ps.Method != "none" {
			l.translated(ps.Method)
		}
	}
	if ops, err = l.store.PutOps("leader:"+t.ID, t.current.Generation, commits); err != nil {
		return parts, nil, 0, err
	}
	t.found = x.all
	return parts, ops, replicaWait, nil
}

// lagPoll is how often a planned switch translates again while the target
// lags behind what the fleet consumed.
const lagPoll = 20 * time.Millisecond

// lagging returns how many consumed records the targets lacked in all.
func lagging(parts []PartitionSwitch) int64 {
	var n int64
	for _, ps := range parts {
		n += ps.Lagged
	}
	return n
}

// throughSwitch returns the topics of a that a fleet switch to `to` (under
// epoch) leaves where they are consumed: those whose positions are on
// `to` already, which join the fleet there, and those of stay, pinned to
// the cluster being left and consumed there now, which stay placed there.
// Every other topic follows the fleet: its positions are translated.
func throughSwitch(a Active, to string, stay []string, epoch int64, since time.Time) map[string]TopicActive {
	out := map[string]TopicActive{}
	for topic, e := range a.Topics {
		if a.PositionsOf(topic) != to {
			continue
		}
		e.Phase, e.From = PhaseActive, ""
		out[topic] = e
	}
	for _, topic := range stay {
		if a.PositionsOf(topic) != a.Cluster {
			continue
		}
		e, ok := a.Topics[topic]
		if !ok || e.Phase != PhaseActive {
			e = TopicActive{Cluster: a.Cluster, Phase: PhaseActive, Epoch: epoch, Since: since.UTC(),
				Reason: fmt.Sprintf("pinned to %s: stays there while the fleet moves to %s", a.Cluster, to)}
		}
		out[topic] = e
	}
	if len(out) == 0 {
		return nil
	}
	return out
}

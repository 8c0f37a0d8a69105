package coordinator

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/etcdwatch"
	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/state"
)

// Run does the leader's work until ctx ends (leadership ended). Every
// write goes through the term, so a deposed leader's decisions never
// land. Each turn of the loop observes the fleet, decides, and then either
// switches clusters or keeps the assignment right on the active one; it
// waits for a change before the next turn unless the turn asks for
// another at once.
func (l *Leader) Run(ctx context.Context, et election.Term) error {
	var wg sync.WaitGroup
	defer wg.Wait() // after cancel: the followers end with ctx
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	r := l.newRun(et)
	r.follow(ctx, &wg)
	if err := r.readState(ctx); err != nil {
		return err
	}
	if err := r.readStages(ctx); err != nil {
		return err
	}
	defer r.stopDiscoveries()
	r.loadBreaker(ctx)
	for {
		again, err := r.turn(ctx)
		if err != nil {
			return err
		}
		if !again {
			if err := r.wait(ctx); err != nil {
				return err
			}
		}
	}
}

// leaderRun is one term's state: what the loop's steps read and change.
type leaderRun struct {
	*Leader
	t   *term
	log *zap.Logger
	ak  *acks
	// quiet leaves out of planning the registered agents that never
	// acknowledge (silence).
	quiet *silence
	pn    *pin
	tp    *topicPins
	sp    *stagePlan
	// stages is state/stages as this term wrote or found it (nil: no
	// staged move).
	stages *state.StageState
	// foundJudged is set once the first turn judged a switch in progress
	// found at the term's start (uncalledFor).
	foundJudged bool
	asg         *keyWatch // state/assignment
	act         *keyWatch // state/active
	memb        <-chan struct{}
	h           *health
	br          *breaker

	// Discovery runs for every cluster in use (the fleet's, and those
	// topics are placed on), each in a goroutine of its own
	// (discovery.go); lists[c] is nil until c's first list, and listed
	// receives a value when any discovery has a new one.
	disc   map[string]*discoveryRun
	lists  map[string][]state.TopicPartition
	listed chan struct{}

	// A switch that failed is retried after a backoff; failedEpoch is the
	// epoch of the last one that failed, counted once by the breaker
	// however often it is retried.
	retry       retrying
	failedEpoch int64
	// A topic switch that failed is retried after a backoff of its own:
	// it never delays a fleet switch, and the other topics are consumed
	// meanwhile.
	topicRetry retrying

	// handover fires when a generation held by handoverHold is due.
	handover <-chan time.Time

	lastVerdict string
	// The failback gate's caught-up check, at most every 2 s.
	caughtUpAt  time.Time
	caughtUp    bool
	caughtUpWhy string
	unowned     *stalled
	probe       *time.Ticker
}

func (l *Leader) newRun(et election.Term) *leaderRun {
	log := l.log.With(zap.Int64("fencing_token", et.Rev))
	ak := newAcks(l.keys, l.members.Lease, func() { l.metrics.refusedValue(refused.Ack) }, log)
	r := &leaderRun{Leader: l, log: log, ak: ak, quiet: newSilence(silentAfter(l.cfg.Etcd.SessionTTL), log), asg: newKeyWatch(), act: newKeyWatch(),
		t: &term{Term: et, log: log, acks: ak}, h: newHealth(), br: &breaker{cfg: l.cfg.Failover},
		disc: map[string]*discoveryRun{}, lists: map[string][]state.TopicPartition{}, listed: make(chan struct{}, 1), failedEpoch: -1,
		caughtUpWhy: "not checked yet", unowned: &stalled{since: map[state.ClusterPartition]time.Time{}, metrics: l.metrics}}
	r.tp = &topicPins{prefix: l.keys.TopicPins(), vals: map[string]string{}, changed: make(chan struct{}, 1), log: log,
		refused: func() { l.metrics.refusedValue(refused.Pin) }, valid: func(c string) bool {
			conf := l.conf()
			return c == conf.primary || c == conf.standby
		}}
	r.sp = &stagePlan{changed: make(chan struct{}, 1), log: log, refused: func() { l.metrics.refusedValue(refused.Stages) },
		valid: func(c string) bool {
			conf := l.conf()
			return c == conf.primary || c == conf.standby
		},
		source: func(topic string) bool {
			conf := l.conf()
			return slices.Contains(conf.source.Topics, topic) || (conf.regex != nil && conf.regex.MatchString(topic))
		}}
	r.pn = &pin{changed: make(chan struct{}, 1), log: log, refused: func() { l.metrics.refusedValue(refused.Pin) }, valid: func(c string) bool {
		conf := l.conf()
		return c != "" && (c == conf.primary || c == conf.standby)
	}}
	return r
}

// follow starts the term's followers of etcd (acks/, state/assignment,
// state/active, control/pin) on wg, and subscribes to the membership.
func (r *leaderRun) follow(ctx context.Context, wg *sync.WaitGroup) {
	timeout := r.cfg.Etcd.RequestTimeout
	wg.Go(func() {
		_ = etcdwatch.Follow(ctx, r.etcd, etcdwatch.Target{Key: r.keys.Acks(), Prefix: true, Timeout: timeout}, r.ak)
	})
	wg.Go(func() {
		_ = etcdwatch.Follow(ctx, r.etcd, etcdwatch.Target{Key: r.keys.Assignment(), Timeout: timeout}, r.asg)
	})
	wg.Go(func() {
		_ = etcdwatch.Follow(ctx, r.etcd, etcdwatch.Target{Key: r.keys.Active(), Timeout: timeout}, r.act)
	})
	wg.Go(func() { _ = etcdwatch.Follow(ctx, r.etcd, etcdwatch.Target{Key: r.keys.Pin(), Timeout: timeout}, r.pn) })
	wg.Go(func() {
		_ = etcdwatch.Follow(ctx, r.etcd, etcdwatch.Target{Key: r.keys.TopicPins(), Prefix: true, Timeout: timeout}, r.tp)
	})
	wg.Go(func() {
		_ = etcdwatch.Follow(ctx, r.etcd, etcdwatch.Target{Key: r.keys.Stages(), Timeout: timeout}, r.sp)
	})
	r.memb = r.members.Subscribe(ctx)
	r.probe = time.NewTicker(r.cfg.Failover.ProbeInterval)
	context.AfterFunc(ctx, r.probe.Stop)
}

// readState reads state/active and state/assignment, retrying every
// second until it can, and writes state/active when it held nothing
// usable. It reads them once acks/ has been read: a missing or malformed
// assignment is replaced above every generation an agent applied.
func (r *leaderRun) readState(ctx context.Context) error {
	t := r.t
	slow := time.NewTimer(r.cfg.Etcd.RequestTimeout)
	defer slow.Stop()
	for synced := false; !synced; {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-r.ak.synced:
			synced = true
		case <-slow.C:
			r.log.Warn("acks/ not read yet; the fleet's state is read once it is", zap.Duration("waited", r.cfg.Etcd.RequestTimeout))
		}
	}
	for {
		var err error
		if t.active, t.activeRev, t.activeUnwritten, err = r.readActive(ctx); err == nil {
			t.current, t.currentRev, err = r.readAssignment(ctx, r.ak)
		}
		if err == nil {
			break
		}
		r.log.Warn("cannot read the fleet's state; retrying", zap.Error(err))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
	if !t.activeUnwritten {
		return nil
	}
	repair := t.activeRev != 0 // a value was there: unusable
	t.activeUnwritten = false
	if err := r.writeActive(ctx, t, t.active); err != nil {
		return err
	}
	if repair {
		r.metrics.repaired("active")
	}
	return nil
}

// loadBreaker restores the circuit breaker from history/ (it outlives the
// term that tripped it), or says why it starts closed.
func (r *leaderRun) loadBreaker(ctx context.Context) {
	if err := r.Leader.restoreBreaker(ctx, r.br); err != nil {
		r.log.Warn("cannot read history/ to restore the circuit breaker; it starts closed", zap.Error(err))
	} else if r.br.open(time.Now()) {
		r.log.Warn("circuit breaker open (tripped under an earlier leader): automatic switching stays off", zap.Time("until", r.br.openUntil))
	}
}

// live returns the agents the leader plans on at now: the registered
// ones that earned membership and are not silent (silence).
func (r *leaderRun) live(now time.Time) []string {
	return r.quiet.live(now, r.members.Live(), r.t.current, r.ak.snapshot(), r.members.Vouched)
}

// liveNow is live at the time of the call.
func (r *leaderRun) liveNow() []string { return r.live(time.Now()) }

// turn is one turn of the loop; again asks for the next at once, without
// waiting for a change.
func (r *leaderRun) turn(ctx context.Context) (again bool, err error) {
	now := time.Now()
	conf := r.conf()
	live := r.live(now)
	views := r.members.Views()
	r.h.observe(now, live, views, []string{conf.primary, conf.standby})
	if r.metrics != nil {
		r.metrics.observe(views, r.t.active)
		r.metrics.breaker(r.br.openUntil)
	}
	// A switch in progress (ours or a predecessor's) goes first.
	dec, why := verdict(verdictInput{now: now, active: r.t.active, primary: conf.primary, standby: conf.standby, pin: r.pn.get(),
		live: live, h: r.h, b: r.br, cfg: r.cfg.Failover, caughtUp: func() (bool, string) { return r.caughtUpGate(ctx) }})
	switching := r.t.active.Phase == state.PhaseSwitching
	found := switching && !r.foundJudged
	r.foundJudged = true
	if found {
		if why := r.uncalledFor(conf); why != "" {
			return true, r.abandonFound(ctx, why)
		}
	}
	if (switching || dec.to != "") && now.Before(r.retry.at) {
		if switching {
			return true, r.whileRetrying(ctx)
		}
		dec = decision{} // keep consuming where the fleet is until the retry
	}
	if switching || dec.to != "" {
		return true, r.doSwitch(ctx, dec)
	}
	if err := r.stageStep(ctx, now); err != nil {
		if errors.Is(err, election.ErrNotLeader) {
			return false, err
		}
		r.log.Warn("staged move: cannot record its progress; trying again", zap.Error(err))
	}
	mv, note := r.topicDecision(now, live)
	if _, listed := consumed(r.t.active, r.lists, conf.naming); listed && mv != nil && !now.Before(r.topicRetry.at) {
		return true, r.doTopicSwitch(ctx, mv)
	}
	if r.topicRetry.err != nil && now.Before(r.topicRetry.at) {
		note = fmt.Sprintf("topic switch failed, retrying at %s: %v", r.topicRetry.at.UTC().Format(time.RFC3339Nano), r.topicRetry.err)
	}
	if note != "" {
		why = strings.TrimPrefix(why+"; "+note, "; ")
	}
	if why != r.lastVerdict && why != "" {
		r.log.Info("verdict", zap.String("active", r.t.active.Cluster), zap.String("state", why))
	}
	r.lastVerdict = why
	return r.keepAssignment(ctx, now, live, why)
}

// uncalledFor returns why the switch in progress that this term found at
// its start (a predecessor's, or a value someone else wrote: every key is
// writable by whoever may write the fleet's prefix) is not resumed, ""
// when it is. It is resumed when something calls for it: the cluster it
// leaves is not reachable by a quorum (a failover), it goes to the
// primary (where the fleet belongs: a failback), a pin or a staged move
// names its target. Otherwise it is abandoned, as a switch whose cause is
// gone: the fleet stays where it is, and history/ records it abandoned.
func (r *leaderRun) uncalledFor(conf *dynamic) string {
	from, to := r.t.active.From, r.t.active.Cluster
	st := r.stages
	switch {
	case !r.h.quorumUpNow(from), to == conf.primary, r.pn.get() == to, st != nil && st.Running() && st.Plan.To == to:
		return ""
	}
	return fmt.Sprintf("found in progress at the start of this term, and nothing calls for it: %s is reachable by a quorum of agents, %s is not the primary, and no pin or staged move names it", from, to)
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

// caughtUpGate is the failback gate's check that the primary holds what
// the fleet consumed on the standby (Leader.caughtUp), made at most every
// 2 s.
func (r *leaderRun) caughtUpGate(ctx context.Context) (bool, string) {
	if time.Since(r.caughtUpAt) > 2*time.Second {
		r.caughtUpAt = time.Now()
		r.caughtUp, r.caughtUpWhy = r.Leader.caughtUp(ctx, r.t, r.log)
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

// discoveryRun is the discovery of one cluster's partitions.
type discoveryRun struct {
	found chan []state.TopicPartition
	stop  context.CancelFunc
}

// discoverInUse follows the partitions of every cluster the fleet uses
// now (inUse) and of no other: a cluster no longer in use loses its list.
// Discovery talks to Kafka in a goroutine of its own (on bg): a dead or
// hung cluster delays the partition list, never the loop or the end of
// the term.
func (r *leaderRun) discoverInUse(ctx context.Context) {
	use := inUse(r.t.active)
	for c, d := range r.disc {
		if !slices.Contains(use, c) {
			d.stop()
			delete(r.disc, c)
			delete(r.lists, c)
		}
	}
	for _, c := range use {
		if r.disc[c] != nil {
			continue
		}
		dctx, dcancel := context.WithCancel(ctx)
		d := &discoveryRun{found: make(chan []state.TopicPartition, 1), stop: dcancel}
		r.disc[c] = d
		r.bg.Add(1)
		go func() {
			defer r.bg.Done()
			r.discoverLoop(dctx, c, r.log, d.found, r.listed)
		}()
	}
}

// stopDiscoveries ends every discovery of the term.
func (r *leaderRun) stopDiscoveries() {
	for _, d := range r.disc {
		d.stop()
	}
}

// takeLists takes the lists the discoveries have found since the last
// call.
func (r *leaderRun) takeLists() {
	for c, d := range r.disc {
		select {
		case ps := <-d.found:
			if !slices.Equal(ps, r.lists[c]) {
				r.log.Info("source partitions", zap.String("cluster", c), zap.Int("partitions", len(ps)))
			}
			r.lists[c] = ps
		default:
		}
	}
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

// wait waits for what may change the next turn's decision: a member, an
// acknowledgement, the pin, state/assignment or state/active changed; an
// agent's failure window on the active cluster ends; the primary has been
// up for failback_stable while the fleet is on the standby; the probe
// interval passed; discovery listed the partitions. A gossip-declared
// death is confirmed and the agent evicted beside the loop.
func (r *leaderRun) wait(ctx context.Context) error {
	t, fo := r.t, r.cfg.Failover
	var windowEnds <-chan time.Time
	if d, ok := r.h.nextDown(time.Now(), t.active.Cluster, fo.FailureWindow); ok {
		if hd, hok := r.h.nextDown(time.Now(), t.active.Cluster, fo.HardFailureWindow); hok && fo.HardFailureWindow > 0 {
			d = min(d, hd)
		}
		windowEnds = time.After(d) // collected once it fires or is dropped (Go 1.23 timers)
	}
	var stableAt <-chan time.Time
	conf := r.conf()
	if t.active.Cluster == conf.standby && conf.standby != "" && fo.Failback == "auto" {
		if up := r.h.upFor(time.Now(), conf.primary); up > 0 && up < fo.FailbackStable {
			stableAt = time.After(fo.FailbackStable - up)
		}
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-windowEnds:
	case <-stableAt:
	case <-r.memb:
	case <-r.ak.changed:
	case <-r.pn.changed:
	case <-r.tp.changed:
	case <-r.sp.changed:
	case <-r.asg.changed:
	case <-r.act.changed:
	case <-r.probe.C:
	case <-r.handover:
		r.handover = nil
	case id := <-r.members.Dead():
		// The death is confirmed over HTTP first (up to a second for a
		// hung agent): not on the loop. The eviction is fenced by the
		// term, which ctx ends with.
		r.bg.Add(1)
		go func() {
			defer r.bg.Done()
			r.evict(ctx, t.Term, id, r.log)
		}()
	case <-r.listed:
		r.takeLists()
	}
	return nil
}

// term is the state of one leader term that the switch and the planning
// loop share. Only the Run goroutine touches it.
type term struct {
	election.Term
	log       *zap.Logger
	active    state.Active
	activeRev int64
	// activeUnwritten: active was recovered (state/active absent or
	// unusable), not read; the leader writes it at once.
	activeUnwritten bool
	current         state.Assignment
	currentRev      int64
	acks            *acks
	// found are the source partitions on the target of the last switch,
	// listed by its translation: the first assignment there needs no
	// discovery round.
	found []state.TopicPartition
	// failback is the failback check this term last wrote to
	// state/failback.
	failback *state.FailbackCheck
	// stalled is the set of partitions the term last wrote to
	// state/stalled (nil: not written yet in this term).
	stalled *string
}

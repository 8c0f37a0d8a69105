package coordinator

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/etcdwatch"
	"github.com/kswitch/kswitch/internal/refused"
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
	defer func() { r.stopDiscovery() }() // the discovery of the moment
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
	t    *term
	log  *zap.Logger
	ak   *acks
	pn   *pin
	asg  *keyWatch // state/assignment
	act  *keyWatch // state/active
	memb <-chan struct{}
	h    *health
	br   *breaker

	// Discovery of the active cluster's partitions runs in a goroutine of
	// its own (discovery.go); partitions is nil until its first list.
	found         chan []TopicPartition
	partitions    []TopicPartition
	discovering   string
	stopDiscovery context.CancelFunc

	// A switch that failed is retried after a backoff; failedEpoch is the
	// epoch of the last one that failed, counted once by the breaker
	// however often it is retried.
	retryAt     time.Time
	retryDelay  time.Duration
	switchErr   error
	failedEpoch int64

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
	ak := newAcks(l.keys, log)
	r := &leaderRun{Leader: l, log: log, ak: ak, asg: newKeyWatch(), act: newKeyWatch(),
		t: &term{Term: et, log: log, acks: ak}, h: newHealth(), br: &breaker{cfg: l.cfg.Failover},
		found: make(chan []TopicPartition, 1), stopDiscovery: func() {}, failedEpoch: -1,
		caughtUpWhy: "not checked yet", unowned: &stalled{since: map[TopicPartition]time.Time{}, metrics: l.metrics}}
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
	wg.Go(func() { _ = etcdwatch.Follow(ctx, r.etcd, r.keys.Acks(), true, timeout, r.ak, nil) })
	wg.Go(func() { _ = etcdwatch.Follow(ctx, r.etcd, r.keys.Assignment(), false, timeout, r.asg, nil) })
	wg.Go(func() { _ = etcdwatch.Follow(ctx, r.etcd, r.keys.Active(), false, timeout, r.act, nil) })
	wg.Go(func() { _ = etcdwatch.Follow(ctx, r.etcd, r.keys.Pin(), false, timeout, r.pn, nil) })
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
		if t.active, t.activeRev, err = r.readActive(ctx); err == nil {
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
	if !t.active.unwritten {
		return nil
	}
	repair := t.activeRev != 0 // a value was there: unusable
	t.active.unwritten = false
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

// turn is one turn of the loop; again asks for the next at once, without
// waiting for a change.
func (r *leaderRun) turn(ctx context.Context) (again bool, err error) {
	now := time.Now()
	conf := r.conf()
	live := r.members.Live()
	views := r.members.Views()
	r.h.observe(now, live, views, []string{conf.primary, conf.standby})
	if r.metrics != nil {
		r.metrics.observe(views, r.t.active)
		r.metrics.breaker(r.br.openUntil)
	}
	// A switch in progress (ours or a predecessor's) goes first.
	dec, why := verdict(verdictInput{now: now, active: r.t.active, primary: conf.primary, standby: conf.standby, pin: r.pn.get(),
		live: live, h: r.h, b: r.br, cfg: r.cfg.Failover, caughtUp: func() (bool, string) { return r.caughtUpGate(ctx) }})
	switching := r.t.active.Phase == PhaseSwitching
	if (switching || dec.to != "") && now.Before(r.retryAt) {
		if switching {
			return true, r.whileRetrying(ctx)
		}
		dec = decision{} // keep consuming where the fleet is until the retry
	}
	if switching || dec.to != "" {
		return true, r.doSwitch(ctx, dec)
	}
	if why != r.lastVerdict && why != "" {
		r.log.Info("verdict", zap.String("active", r.t.active.Cluster), zap.String("state", why))
	}
	r.lastVerdict = why
	return r.keepAssignment(ctx, now, live, why)
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
			r.retryAt, r.retryDelay = time.Time{}, 0
		}
		return nil
	}
	r.status.Store(&LeaderStatus{Active: t.active, Pin: r.pn.get(), Breaker: r.br.openUntil,
		Verdict: fmt.Sprintf("switch to %s failed, retrying at %s: %v", t.active.Cluster, r.retryAt.UTC().Format(time.RFC3339Nano), r.switchErr)})
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(min(time.Until(r.retryAt), r.cfg.Failover.ProbeInterval)):
	}
	return nil
}

// doSwitch switches clusters (or finishes a switch in progress), counts
// it with the breaker and sets the retry of one that failed.
func (r *leaderRun) doSwitch(ctx context.Context, dec decision) error {
	t := r.t
	// Planned: the cluster being left is healthy (a pin, a failback), so
	// the switch can be made before it is broken.
	planned := r.h.quorumUpNow(t.active.Cluster) && r.h.quorumUpNow(dec.to)
	ev, err := r.switchTo(ctx, t, dec.to, dec.reason, dec.auto, planned, r.members.Live, r.readyOn)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if errors.Is(err, election.ErrNotLeader) {
		return err
	}
	tripped := false
	switch {
	case err == nil && dec.auto:
		tripped = r.br.record(time.Now(), false)
	case err != nil && t.active.Epoch != r.failedEpoch:
		// One failed switch, however many attempts.
		r.failedEpoch = t.active.Epoch
		tripped = r.br.record(time.Now(), true)
	}
	if r.metrics != nil {
		r.metrics.switched(ev, ev.Finished.Sub(ev.Started), err)
	}
	r.switchErr = err
	if err != nil {
		r.retryDelay = min(max(2*r.retryDelay, r.cfg.Failover.ProbeInterval), maxSwitchRetry)
		r.retryAt = time.Now().Add(r.retryDelay)
		r.log.Error("cluster switch failed; retrying (the fleet stays released while a switch is in progress)",
			zap.Error(err), zap.Duration("retry_in", r.retryDelay))
	} else {
		r.retryAt, r.retryDelay = time.Time{}, 0
	}
	if tripped {
		r.log.Error("circuit breaker tripped: automatic switching stops", zap.Time("until", r.br.openUntil))
	}
	// Re-read what the switch wrote, then plan on the new cluster. After
	// a failure state/active may have changed under the leader (a stale
	// revision fails every later write).
	if err != nil {
		r.reread(ctx, t, r.ak, r.log)
		return nil
	}
	// The switch listed the partitions on the new cluster (and assigned
	// them): plan with them until discovery there reports.
	r.discover(ctx, t.active.Cluster)
	r.partitions = t.found
	return nil
}

// readyOn returns the live agents that are not alone in failing to reach
// cluster: those that get partitions there.
func (r *leaderRun) readyOn(cluster string) []string {
	cut := r.h.cutOff(time.Now(), cluster, r.cfg.Failover.FailureWindow)
	return slices.DeleteFunc(slices.Clone(r.members.Live()), func(id string) bool { return cut[id] })
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
	if r.discovering != t.active.Cluster {
		r.discover(ctx, t.active.Cluster)
	}
	// Agents that alone cannot reach the active cluster get no
	// partitions: they would only stall them. They are still live: what
	// they own is revoked, not handed straight to another agent, since
	// they may still be consuming (a probe that timed out on a loaded
	// machine is enough to be cut off) and only their release commits
	// what they handled.
	cut := slices.Sorted(maps.Keys(r.h.cutOff(now, t.active.Cluster, r.cfg.Failover.FailureWindow)))
	r.status.Store(&LeaderStatus{Active: t.active, Verdict: why, Pin: r.pn.get(), Breaker: r.br.openUntil, CutOff: cut,
		Unassigned: r.unowned.note(now, r.partitions, t.current, r.h.downFor(now, t.active.Cluster, r.cfg.Failover.FailureWindow))})
	r.publishStalled(ctx, t, r.unowned, now, r.log)
	if r.partitions == nil {
		return false, nil
	}
	next, changed := Plan(PlanInput{Current: t.current, Partitions: r.partitions, Cluster: t.active.Cluster,
		Live: live, CutOff: cut, Acks: r.ak.snapshot()})
	if !changed {
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

// discover follows cluster's partitions from now on: the discovery of the
// cluster followed before ends, and partitions is nil until the new one
// lists them. Discovery talks to Kafka in a goroutine of its own (on bg):
// a dead or hung cluster delays the partition list, never the loop or the
// end of the term.
func (r *leaderRun) discover(ctx context.Context, cluster string) {
	r.stopDiscovery()
	dctx, dcancel := context.WithCancel(ctx)
	r.stopDiscovery = dcancel
	r.discovering, r.partitions = cluster, nil
	select {
	case <-r.found:
	default:
	}
	r.bg.Add(1)
	go func() {
		defer r.bg.Done()
		r.discoverLoop(dctx, cluster, r.log, r.found)
	}()
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
	case <-r.asg.changed:
	case <-r.act.changed:
	case <-r.probe.C:
	case id := <-r.members.Dead():
		// The death is confirmed over HTTP first (up to a second for a
		// hung agent): not on the loop. The eviction is fenced by the
		// term, which ctx ends with.
		r.bg.Add(1)
		go func() {
			defer r.bg.Done()
			r.evict(ctx, t.Term, id, r.log)
		}()
	case ps := <-r.found:
		if !slices.Equal(ps, r.partitions) {
			r.log.Info("source partitions", zap.String("cluster", t.active.Cluster), zap.Int("partitions", len(ps)))
		}
		r.partitions = ps
	}
	return nil
}

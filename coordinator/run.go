package coordinator

import (
	"context"
	"errors"
	"fmt"
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
	// The failback gate's caught-up check of caughtUpTo, at most every
	// 2 s.
	caughtUpAt  time.Time
	caughtUpTo  string
	caughtUp    bool
	caughtUpWhy string
	// The clusters' report (clusters.go): how far each is behind, and
	// what was last written to state/clusters, when.
	behind       *behindChecker
	lastClusters *state.ClusterState
	clustersAt   time.Time
	unowned      *stalled
	probe        *time.Ticker
}

func (l *Leader) newRun(et election.Term) *leaderRun {
	log := l.log.With(zap.Int64("fencing_token", et.Rev))
	ak := newAcks(l.keys, l.members.Lease, func() { l.metrics.refusedValue(refused.Ack) }, log)
	r := &leaderRun{Leader: l, log: log, ak: ak, quiet: newSilence(silentAfter(l.cfg.Etcd.SessionTTL), log), asg: newKeyWatch(), act: newKeyWatch(),
		t: &term{Term: et, log: log, acks: ak}, h: newHealth(), br: &breaker{cfg: l.cfg.Failover},
		disc: map[string]*discoveryRun{}, lists: map[string][]state.TopicPartition{}, listed: make(chan struct{}, 1), failedEpoch: -1,
		caughtUpWhy: "not checked yet", behind: newBehindChecker(l, log), unowned: &stalled{since: map[state.ClusterPartition]time.Time{}, metrics: l.metrics}}
	r.tp = &topicPins{prefix: l.keys.TopicPins(), vals: map[string]string{}, changed: make(chan struct{}, 1), log: log,
		refused: func() { l.metrics.refusedValue(refused.Pin) }, valid: func(c string) bool {
			return l.conf().isSource(c)
		}}
	r.sp = &stagePlan{changed: make(chan struct{}, 1), log: log, refused: func() { l.metrics.refusedValue(refused.Stages) },
		valid: func(c string) bool { return l.conf().isSource(c) },
		source: func(topic string) bool {
			conf := l.conf()
			return slices.Contains(conf.source.Topics, topic) || (conf.regex != nil && conf.regex.MatchString(topic))
		}}
	r.pn = &pin{changed: make(chan struct{}, 1), log: log, refused: func() { l.metrics.refusedValue(refused.Pin) }, valid: func(c string) bool {
		return c != "" && l.conf().isSource(c)
	}}
	return r
}

// follow starts the term's followers of etcd (acks/, state/assignment,
// state/active, control/pin) on wg, and subscribes to the membership.
func (r *leaderRun) follow(ctx context.Context, wg *sync.WaitGroup) {
	timeout := r.cfg.Etcd.RequestTimeout
	wg.Go(func() { r.behind.run(ctx) })
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
	r.h.observe(now, live, views, conf.sources)
	r.reportClusters(ctx, now, conf, live, views)
	if r.metrics != nil {
		r.metrics.observe(views, r.t.active)
		r.metrics.breaker(r.br.openUntil)
	}
	// A switch in progress (ours or a predecessor's) goes first.
	dec, why := verdict(verdictInput{now: now, active: r.t.active, sources: conf.sources, pin: r.pn.get(),
		live: live, h: r.h, b: r.br, cfg: r.cfg.Failover, caughtUp: func(to string) (bool, string) { return r.caughtUpGate(ctx, to) }})
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

// wait waits for what may change the next turn's decision: a member, an
// acknowledgement, the pin, state/assignment or state/active changed; an
// agent's failure window on the active cluster ends; a cluster preferred
// to the active one has been up for failback_stable; the probe
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
	if fo.Failback == "auto" {
		// The first cluster ahead of the active one to become stable.
		var next time.Duration
		for _, c := range conf.sources[:min(conf.rank(t.active.Cluster), len(conf.sources))] {
			if up := r.h.upFor(time.Now(), c); up > 0 && up < fo.FailbackStable && (next == 0 || fo.FailbackStable-up < next) {
				next = fo.FailbackStable - up
			}
		}
		if next > 0 {
			stableAt = time.After(next)
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

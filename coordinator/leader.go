package coordinator

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/etcdwatch"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/offsets"
)

// Membership is what the leader needs to know of the fleet's agents.
type Membership interface {
	// Live returns the ids of the agents that are registered and ready.
	Live() []string
	// Subscribe returns a channel that receives a value after Live or
	// Views changed (coalesced), until ctx ends.
	Subscribe(ctx context.Context) <-chan struct{}
	// Dead receives the ids of agents that gossip declared dead.
	Dead() <-chan string
	// GossipAlive reports whether gossip considers the agent alive now.
	GossipAlive(id string) bool
	// Answers reports whether the agent's HTTP endpoint answers now. A
	// gossip death is acted on only when it does not: gossip packets can
	// be forged, an answer over TCP from the registered address cannot
	// be by the same stranger.
	Answers(ctx context.Context, id string) bool
	// Views returns every gossip member's view of the Kafka clusters.
	Views() AgentViews
}

// Leader is the leader's work for one term: it discovers the source
// partitions, plans the assignment over the live agents and publishes
// each generation with a fenced write. It owns no state across terms:
// a new leader reads state/assignment and the acknowledgements from etcd.
type Leader struct {
	cfg     config.Config
	keys    keys.Fleet
	etcd    *clientv3.Client
	members Membership
	log     *zap.Logger
	// OnPublish, when set, is called after each generation is written.
	OnPublish func(Assignment)

	// dyn is the configuration in force: cfg with the dynamic layer's
	// source and cluster definitions (SetConfig).
	dyn atomic.Pointer[dynamic]
	// rediscover asks the discovery loop to list the partitions now (the
	// source changed).
	rediscover chan struct{}
	store      *offsets.Store
	// Dialer, when set, opens the leader's connections to a cluster.
	Dialer func(cluster string) kafka.Dialer
	// Metrics, when set, receives the leader's measurements.
	Metrics *Metrics
	// BreakBeforeMake, when set, turns off the preparation of planned
	// switches (agents warming their clients to the target, the
	// pre-translation): every switch revokes first and connects after,
	// as a failover must. The baseline of BenchmarkPlannedSwitch.
	BreakBeforeMake bool
	// status is the leader's last verdict, for /status.
	status atomic.Pointer[LeaderStatus]
	// bg owns the goroutines that talk to Kafka (discovery, the count of
	// a failback's late tail) and those that confirm and carry out an
	// eviction. They may outlive a term by the length of one call (bounded
	// by the client's timeouts; the eviction's calls end with the term's
	// ctx), so that a dead cluster or agent never delays the end of a
	// term; the caller waits for bg when it shuts down.
	bg *sync.WaitGroup
}

// NewLeader returns the leader work of a fleet. cfg must be validated. bg
// must outlive every Run: the caller waits for it after the last term.
func NewLeader(cfg config.Config, c *clientv3.Client, m Membership, bg *sync.WaitGroup, log *zap.Logger) (*Leader, error) {
	l := &Leader{cfg: cfg, keys: keys.New(cfg.Fleet), etcd: c, members: m, bg: bg, log: log,
		store: offsets.NewStore(c, keys.New(cfg.Fleet)), rediscover: make(chan struct{}, 1)}
	if err := l.SetConfig(cfg); err != nil {
		return nil, err
	}
	return l, nil
}

// dynamic is the configuration in force (the file with the dynamic
// layer's version applied), with what the leader derives from it.
type dynamic struct {
	cfg      config.Config
	source   config.Source
	regex    *regexp.Regexp
	clusters map[string]config.Cluster
	naming   Naming
	primary  string
	standby  string // "" when there is none
}

// SetConfig puts cfg's source and cluster definitions in force (a dynamic
// configuration version, validated). Discovery lists the partitions at
// once under the new source, and every connection opened from now on uses
// the new definitions; discovery's own connection is reopened when its
// cluster's definition changed. A new standby is the target of the next
// failover (CheckConfig allows it only while the fleet consumes the
// primary).
func (l *Leader) SetConfig(cfg config.Config) error {
	d := &dynamic{cfg: cfg, source: cfg.Source, clusters: cfg.Clusters, naming: NewNaming(cfg)}
	d.primary, _ = cfg.Primary()
	d.standby, _, _ = cfg.Standby()
	if cfg.Source.TopicRegex != "" {
		re, err := regexp.Compile(cfg.Source.TopicRegex)
		if err != nil {
			return fmt.Errorf("coordinator: source.topic_regex: %w", err)
		}
		d.regex = re
	}
	old := l.dyn.Swap(d)
	if old != nil && !reflect.DeepEqual(old.source, d.source) {
		select {
		case l.rediscover <- struct{}{}:
		default:
		}
	}
	return nil
}

// conf returns the source and cluster definitions in force.
func (l *Leader) conf() *dynamic { return l.dyn.Load() }

// CheckConfig refuses a configuration the fleet cannot take now: a change
// of the standby while the fleet does not consume the primary, or while a
// switch is in progress (the cluster being left or joined would lose its
// role under it). Before this leader's first verdict it refuses any
// change of the standby: try again in a moment.
func (l *Leader) CheckConfig(next, current config.Config) error {
	was, _, _ := current.Standby()
	now, _, _ := next.Standby()
	if was == now {
		return nil
	}
	primary, _ := next.Primary()
	st := l.status.Load()
	switch {
	case st == nil:
		return fmt.Errorf("the standby changes from %q to %q, and the leader has not read the fleet's state yet; apply it again in a moment", was, now)
	case st.Active.Cluster != primary || st.Active.Phase != PhaseActive:
		return fmt.Errorf("the standby changes from %q to %q while the fleet consumes %s (%s): it can change only while the fleet consumes the primary %s",
			was, now, st.Active.Cluster, st.Active.Phase, primary)
	}
	return nil
}

// acks follows acks/: agent id → generation it has applied.
type acks struct {
	keys    keys.Fleet
	log     *zap.Logger
	mu      sync.Mutex
	gens    map[string]int64
	changed chan struct{}
}

func (a *acks) Reset(kvs []*mvccpb.KeyValue, _ int64) {
	m := map[string]int64{}
	for _, kv := range kvs {
		a.put(m, kv)
	}
	a.mu.Lock()
	a.gens = m
	a.mu.Unlock()
	a.notify()
}

func (a *acks) Apply(evs []*clientv3.Event) {
	a.mu.Lock()
	for _, ev := range evs {
		if ev.Type == clientv3.EventTypeDelete {
			delete(a.gens, strings.TrimPrefix(string(ev.Kv.Key), a.keys.Acks()))
			continue
		}
		a.put(a.gens, ev.Kv)
	}
	a.mu.Unlock()
	a.notify()
}

func (a *acks) put(m map[string]int64, kv *mvccpb.KeyValue) {
	id := strings.TrimPrefix(string(kv.Key), a.keys.Acks())
	g, err := strconv.ParseInt(strings.TrimSpace(string(kv.Value)), 10, 64)
	if err != nil || g < 0 || kv.Lease == 0 {
		// An agent acknowledges on its session lease: a value without
		// one was written by hand, and must not move generations.
		a.log.Warn("ignoring malformed acknowledgement (a generation on the agent's lease)", zap.String("key", string(kv.Key)),
			zap.ByteString("value", kv.Value), zap.Bool("lease", kv.Lease != 0))
		delete(m, id)
		return
	}
	m[id] = g
}

func (a *acks) notify() {
	select {
	case a.changed <- struct{}{}:
	default:
	}
}

func (a *acks) snapshot() map[string]int64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make(map[string]int64, len(a.gens))
	for k, v := range a.gens {
		out[k] = v
	}
	return out
}

// LeaderStatus is what the leader last decided, for /status.
type LeaderStatus struct {
	Active  Active    `json:"active"`
	Verdict string    `json:"verdict,omitempty"`
	Pin     string    `json:"pin,omitempty"`
	Breaker time.Time `json:"breaker_open_until,omitzero"`
	CutOff  []string  `json:"cut_off,omitempty"`
	// Unassigned lists the discovered partitions that no agent consumes
	// or is releasing, with how long: the fleet's stalled partitions.
	Unassigned []string `json:"unassigned,omitempty"`
}

// Status returns the leader's last verdict, or nil when this agent has not
// led.
func (l *Leader) Status() *LeaderStatus { return l.status.Load() }

func (l *Leader) dialer(cluster string) kafka.Dialer {
	if l.Dialer == nil {
		return nil
	}
	return l.Dialer(cluster)
}

// maxPinSize bounds a control/pin value: a cluster name, with room for
// surrounding whitespace.
const maxPinSize = 1 << 10

// pin follows control/pin.
type pin struct {
	mu      sync.Mutex
	val     string
	changed chan struct{}
	valid   func(string) bool
	log     *zap.Logger
	// refused, when set, counts each value refused.
	refused func()
}

func (p *pin) set(v string) {
	if len(v) > maxPinSize {
		p.refuse(fmt.Sprintf("%d bytes, over the %d-byte limit", len(v), maxPinSize), v)
		return
	}
	v = strings.TrimSpace(v)
	if v != "" && !p.valid(v) {
		p.refuse("not a primary or standby cluster of this configuration", v)
		return
	}
	p.mu.Lock()
	p.val = v
	p.mu.Unlock()
	select {
	case p.changed <- struct{}{}:
	default:
	}
}

// refuse logs and counts a refused value; the pin in force stays.
func (p *pin) refuse(reason, v string) {
	p.log.Warn("refusing control/pin; the pin in force stays", zap.String("reason", reason),
		zap.String("value", refused.Truncate([]byte(v), 200)), zap.String("in_force", cmp.Or(p.get(), "none (automatic)")))
	if p.refused != nil {
		p.refused()
	}
}

func (p *pin) Reset(kvs []*mvccpb.KeyValue, _ int64) {
	if len(kvs) == 0 {
		p.set("")
		return
	}
	p.set(string(kvs[0].Value))
}

func (p *pin) Apply(evs []*clientv3.Event) {
	for _, ev := range evs {
		if ev.Type == clientv3.EventTypeDelete {
			p.set("")
		} else {
			p.set(string(ev.Kv.Value))
		}
	}
}

func (p *pin) get() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.val
}

// Run does the leader's work until ctx ends (leadership ended). Every
// write goes through term, so a deposed leader's decisions never land.
func (l *Leader) Run(ctx context.Context, et election.Term) error {
	log := l.log.With(zap.Int64("fencing_token", et.Rev))
	ak := &acks{keys: l.keys, log: log, gens: map[string]int64{}, changed: make(chan struct{}, 1)}
	pn := &pin{changed: make(chan struct{}, 1), log: log, refused: func() { l.Metrics.refusedValue(refused.Pin) }, valid: func(c string) bool {
		conf := l.conf()
		return c != "" && (c == conf.primary || c == conf.standby)
	}}
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	asg, act := newKeyWatch(), newKeyWatch()
	wg.Add(4)
	go func() {
		defer wg.Done()
		_ = etcdwatch.Follow(ctx, l.etcd, l.keys.Acks(), true, l.cfg.Etcd.RequestTimeout, ak, nil)
	}()
	go func() {
		defer wg.Done()
		_ = etcdwatch.Follow(ctx, l.etcd, l.keys.Assignment(), false, l.cfg.Etcd.RequestTimeout, asg, nil)
	}()
	go func() {
		defer wg.Done()
		_ = etcdwatch.Follow(ctx, l.etcd, l.keys.Active(), false, l.cfg.Etcd.RequestTimeout, act, nil)
	}()
	go func() {
		defer wg.Done()
		_ = etcdwatch.Follow(ctx, l.etcd, l.keys.Pin(), false, l.cfg.Etcd.RequestTimeout, pn, nil)
	}()
	memberCh := l.members.Subscribe(ctx)

	t := &term{Term: et, log: log, acks: ak}
	for {
		var err error
		if t.active, t.activeRev, err = l.readActive(ctx); err == nil {
			t.current, t.currentRev, err = l.readAssignment(ctx, ak)
		}
		if err == nil {
			break
		}
		log.Warn("cannot read the fleet's state; retrying", zap.Error(err))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
	if t.active.unwritten {
		repair := t.activeRev != 0 // a value was there: unusable
		t.active.unwritten = false
		if err := l.writeActive(ctx, t, t.active); err != nil {
			return err
		}
		if repair {
			l.Metrics.repaired("active")
		}
	}

	// Discovery talks to Kafka in a goroutine of its own: a dead or hung
	// cluster delays the partition list, never the leader's loop or the
	// end of its term. It follows the active cluster.
	found := make(chan []TopicPartition, 1)
	var partitions []TopicPartition // nil until the first discovery of the active cluster succeeds
	discovering := ""
	stopDiscovery := func() {}
	defer func() { stopDiscovery() }()
	discover := func(cluster string) {
		stopDiscovery()
		dctx, dcancel := context.WithCancel(ctx)
		stopDiscovery = dcancel
		discovering, partitions = cluster, nil
		select {
		case <-found:
		default:
		}
		l.bg.Add(1)
		go func() {
			defer l.bg.Done()
			l.discoverLoop(dctx, cluster, log, found)
		}()
	}

	h := newHealth()
	br := &breaker{cfg: l.cfg.Failover}
	// The breaker outlives the term that tripped it: the switches it
	// counted are in history/.
	if err := l.restoreBreaker(ctx, br); err != nil {
		log.Warn("cannot read history/ to restore the circuit breaker; it starts closed", zap.Error(err))
	} else if br.open(time.Now()) {
		log.Warn("circuit breaker open (tripped under an earlier leader): automatic switching stays off", zap.Time("until", br.openUntil))
	}
	// readyOn returns the live agents that are not alone in failing to
	// reach cluster: those that get partitions there.
	readyOn := func(cluster string) []string {
		cut := h.cutOff(time.Now(), cluster, l.cfg.Failover.FailureWindow)
		return slices.DeleteFunc(slices.Clone(l.members.Live()), func(id string) bool { return cut[id] })
	}
	probe := time.NewTicker(l.cfg.Failover.ProbeInterval)
	defer probe.Stop()
	// A switch that failed is retried after a backoff; failedEpoch is the
	// epoch of the last one that failed, counted once by the breaker
	// however often it is retried.
	var retryAt time.Time
	var retryDelay time.Duration
	var switchErr error
	failedEpoch := int64(-1)
	var lastVerdict string
	var lastCaughtUpCheck time.Time
	unowned := &stalled{since: map[TopicPartition]time.Time{}, metrics: l.Metrics}
	caughtUpResult, caughtUpWhy := false, "not checked yet"
	for {
		now := time.Now()
		conf := l.conf()
		primary, standby := conf.primary, conf.standby
		live := l.members.Live()
		views := l.members.Views()
		h.observe(now, live, views, []string{primary, standby})
		if l.Metrics != nil {
			l.Metrics.observe(views, t.active)
			l.Metrics.breaker(br.openUntil)
		}

		// A switch in progress (ours or a predecessor's) goes first.
		dec, why := verdict(verdictInput{now: now, active: t.active, primary: primary, standby: standby, pin: pn.get(),
			live: live, h: h, b: br, cfg: l.cfg.Failover,
			caughtUp: func() (bool, string) {
				if time.Since(lastCaughtUpCheck) > 2*time.Second {
					lastCaughtUpCheck = time.Now()
					caughtUpResult, caughtUpWhy = l.caughtUp(ctx, t, log)
				}
				return caughtUpResult, caughtUpWhy
			}})
		switching := t.active.Phase == PhaseSwitching
		if (switching || dec.to != "") && now.Before(retryAt) {
			// The last attempt failed. A switch whose target is gone
			// while the cluster it left is back is given up: the fleet
			// returns there rather than stay released.
			if switching && !h.quorumUpNow(t.active.Cluster) && h.quorumUpNow(t.active.From) {
				err := l.abandonSwitch(ctx, t, fmt.Sprintf("%s is unreachable by a quorum of agents and %s is reachable again", t.active.Cluster, t.active.From))
				if ctx.Err() != nil {
					return ctx.Err()
				}
				if errors.Is(err, election.ErrNotLeader) {
					return err
				}
				if err != nil {
					log.Warn("cannot abandon the switch; retrying", zap.Error(err))
					l.reread(ctx, t, ak, log)
				} else {
					retryAt, retryDelay = time.Time{}, 0
				}
				continue
			}
			if switching {
				// Nobody consumes while a switch is in progress: no
				// planning, just wait for the retry (re-observing
				// health every probe interval).
				l.status.Store(&LeaderStatus{Active: t.active, Pin: pn.get(), Breaker: br.openUntil,
					Verdict: fmt.Sprintf("switch to %s failed, retrying at %s: %v", t.active.Cluster, retryAt.UTC().Format(time.RFC3339Nano), switchErr)})
				select {
				case <-ctx.Done():
					return ctx.Err()
				case <-time.After(min(time.Until(retryAt), l.cfg.Failover.ProbeInterval)):
				}
				continue
			}
			dec = decision{} // keep consuming where the fleet is until the retry
		}
		if switching || dec.to != "" {
			// Planned: the cluster being left is healthy (a pin, a
			// failback), so the switch can be made before it is broken.
			planned := h.quorumUpNow(t.active.Cluster) && h.quorumUpNow(dec.to)
			ev, err := l.switchTo(ctx, t, dec.to, dec.reason, dec.auto, planned, l.members.Live, readyOn)
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if errors.Is(err, election.ErrNotLeader) {
				return err
			}
			tripped := false
			switch {
			case err == nil && dec.auto:
				tripped = br.record(time.Now(), false)
			case err != nil && t.active.Epoch != failedEpoch:
				// One failed switch, however many attempts.
				failedEpoch = t.active.Epoch
				tripped = br.record(time.Now(), true)
			}
			if l.Metrics != nil {
				l.Metrics.switched(ev, ev.Finished.Sub(ev.Started), err)
			}
			switchErr = err
			if err != nil {
				retryDelay = min(max(2*retryDelay, l.cfg.Failover.ProbeInterval), maxSwitchRetry)
				retryAt = time.Now().Add(retryDelay)
				log.Error("cluster switch failed; retrying (the fleet stays released while a switch is in progress)",
					zap.Error(err), zap.Duration("retry_in", retryDelay))
			} else {
				retryAt, retryDelay = time.Time{}, 0
			}
			if tripped {
				log.Error("circuit breaker tripped: automatic switching stops", zap.Time("until", br.openUntil))
			}
			// Re-read what the switch wrote, then plan on the new
			// cluster. After a failure state/active may have changed
			// under the leader (a stale revision fails every later
			// write).
			if err != nil {
				l.reread(ctx, t, ak, log)
			} else {
				// The switch listed the partitions on the new cluster
				// (and assigned them): plan with them until discovery
				// there reports.
				discover(t.active.Cluster)
				partitions = t.found
			}
			continue
		}
		if why != lastVerdict && why != "" {
			log.Info("verdict", zap.String("active", t.active.Cluster), zap.String("state", why))
		}
		lastVerdict = why

		if err := l.repairState(ctx, t, ak, asg, act, log); err != nil {
			if errors.Is(err, election.ErrNotLeader) {
				return err
			}
			log.Warn("cannot repair the fleet's state; re-reading it", zap.Error(err))
			l.reread(ctx, t, ak, log)
		}
		if discovering != t.active.Cluster {
			discover(t.active.Cluster)
		}
		// Agents that alone cannot reach the active cluster get no
		// partitions: they would only stall them. They are still live:
		// what they own is revoked, not handed straight to another
		// agent, since they may still be consuming (a probe that timed
		// out on a loaded machine is enough to be cut off) and only
		// their release commits what they handled.
		cut := h.cutOff(now, t.active.Cluster, l.cfg.Failover.FailureWindow)
		l.status.Store(&LeaderStatus{Active: t.active, Verdict: why, Pin: pn.get(), Breaker: br.openUntil, CutOff: slices.Sorted(maps.Keys(cut)),
			Unassigned: unowned.note(now, partitions, t.current, h.downFor(now, t.active.Cluster, l.cfg.Failover.FailureWindow))})
		l.publishStalled(ctx, t, unowned, now, log)
		if partitions != nil {
			next, changed := Plan(PlanInput{Current: t.current, Partitions: partitions, Cluster: t.active.Cluster,
				Live: live, CutOff: slices.Sorted(maps.Keys(cut)), Acks: ak.snapshot()})
			if changed {
				err := l.publishTerm(ctx, t, next)
				switch {
				case errors.Is(err, election.ErrNotLeader):
					log.Warn("leadership lost while publishing", zap.Error(err))
					return err
				case errors.Is(err, election.ErrConditionFailed):
					log.Warn("state/assignment changed under the leader; re-reading it")
					if c, r, err := l.readAssignment(ctx, ak); err == nil {
						t.current, t.currentRev = c, r
					}
					continue
				case err != nil:
					log.Warn("cannot publish assignment; retrying", zap.Error(err))
				}
			}
		}
		// The moment an agent's failure window on the active cluster
		// ends, the verdict (and who is cut off) is looked at again, not
		// at the next tick.
		var windowEnds <-chan time.Time
		if d, ok := h.nextDown(time.Now(), t.active.Cluster, l.cfg.Failover.FailureWindow); ok {
			if hd, hok := h.nextDown(time.Now(), t.active.Cluster, l.cfg.Failover.HardFailureWindow); hok && l.cfg.Failover.HardFailureWindow > 0 {
				d = min(d, hd)
			}
			windowEnds = time.After(d) // collected once it fires or is dropped (Go 1.23 timers)
		}
		// Likewise the moment the primary has been up for failback_stable
		// while the fleet is on the standby: failback starts then, not at
		// the next tick.
		var stableAt <-chan time.Time
		if t.active.Cluster == standby && standby != "" && l.cfg.Failover.Failback == "auto" {
			if up := h.upFor(time.Now(), primary); up > 0 && up < l.cfg.Failover.FailbackStable {
				stableAt = time.After(l.cfg.Failover.FailbackStable - up)
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-windowEnds:
		case <-stableAt:
		case <-memberCh:
		case <-ak.changed:
		case <-pn.changed:
		case <-asg.changed:
		case <-act.changed:
		case <-probe.C:
		case id := <-l.members.Dead():
			// The death is confirmed over HTTP first (up to a second for
			// a hung agent): not on the loop. The eviction is fenced by
			// the term, which ctx ends with.
			l.bg.Add(1)
			go func() {
				defer l.bg.Done()
				l.evict(ctx, et, id, log)
			}()
		case ps := <-found:
			if !slices.Equal(ps, partitions) {
				log.Info("source partitions", zap.String("cluster", t.active.Cluster), zap.Int("partitions", len(ps)))
			}
			partitions = ps
		}
	}
}

// maxSwitchRetry caps the backoff between attempts of a failing switch.
const maxSwitchRetry = 5 * time.Second

// reread reloads state/active and state/assignment after a failed write.
func (l *Leader) reread(ctx context.Context, t *term, ak *acks, log *zap.Logger) {
	if a, rev, err := l.readActive(ctx); err == nil {
		t.active, t.activeRev = a, rev
	} else {
		log.Warn("cannot re-read state/active", zap.Error(err))
	}
	if c, r, err := l.readAssignment(ctx, ak); err == nil {
		t.current, t.currentRev = c, r
	}
}

// breakerHistory is how many of the latest switches restoreBreaker reads.
const breakerHistory = 64

// restoreBreaker replays the switches of history/ that the breaker counts
// (automatic ones, and abandoned ones as failures) into br, so that a
// breaker tripped under an earlier leader stays open under this one.
// Failed attempts of switches that later completed are not in history/:
// a new leader counts such a switch as a plain one.
func (l *Leader) restoreBreaker(ctx context.Context, br *breaker) error {
	rctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := l.etcd.Get(rctx, l.keys.SwitchHistory(), clientv3.WithPrefix(),
		clientv3.WithSort(clientv3.SortByKey, clientv3.SortDescend), clientv3.WithLimit(breakerHistory))
	if err != nil {
		return err
	}
	since := time.Now().Add(-l.cfg.Failover.BreakerWindow - l.cfg.Failover.BreakerCooldown)
	var evs []SwitchEvent
	for _, kv := range resp.Kvs {
		ev, err := ParseSwitchEvent(kv.Value)
		if err != nil {
			l.log.Warn("refusing a malformed history/ entry; the breaker is restored without it",
				zap.String("key", string(kv.Key)), zap.Error(err))
			l.Metrics.refusedValue(refused.History)
			continue
		}
		if !(ev.Automatic || ev.Abandoned != "") || ev.Finished.Before(since) {
			continue
		}
		evs = append(evs, ev)
	}
	slices.SortFunc(evs, func(a, b SwitchEvent) int { return a.Finished.Compare(b.Finished) })
	for _, ev := range evs {
		br.record(ev.Finished, ev.Abandoned != "")
	}
	return nil
}

// publishTerm publishes a as the term's next generation.
func (l *Leader) publishTerm(ctx context.Context, t *term, a Assignment) error {
	a.Leader, a.Token, a.Published = t.ID, t.Rev, time.Now().UTC()
	rev, err := l.publish(ctx, t.Term, a, t.currentRev)
	if err != nil {
		return err
	}
	t.current, t.currentRev = a, rev
	t.log.Info("published assignment", zap.Int64("generation", a.Generation), zap.String("cluster", a.Cluster),
		zap.Int("agents", len(a.Owned)), zap.Int("revoking", len(a.Revoking)))
	if l.OnPublish != nil {
		l.OnPublish(a)
	}
	return nil
}

// caughtUp reports whether the primary holds the last record consumed on
// the standby in every partition of every stream: the fingerprint
// translation from the standby back to the primary must find it exactly.
// For the primary's own records (B's A.orders back to A's orders) that is
// the primary still holding what it wrote; for the records written on the
// standby during the outage (B's orders to A's B.orders) it is MirrorMaker
// 2's flow back having copied everything the fleet consumed. When not, the
// reason names the partitions behind, and kswitch_failback_behind_partitions
// counts them.
func (l *Leader) caughtUp(ctx context.Context, t *term, log *zap.Logger) (bool, string) {
	ok, why, behind := l.checkCaughtUp(ctx, t, log)
	l.Metrics.failbackBehind(behind)
	c := FailbackCheck{Standby: t.active.Cluster, Epoch: t.active.Epoch, CaughtUp: ok, Reason: why, Behind: behind}
	if last := t.failback; last == nil || last.Standby != c.Standby || last.Epoch != c.Epoch || last.CaughtUp != ok || last.Reason != why {
		c.Checked, c.Leader = time.Now().UTC(), t.ID
		if val, err := json.Marshal(c); err == nil {
			wctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
			if _, err := t.Txn(wctx, nil, clientv3.OpPut(l.keys.Failback(), string(val))); err != nil {
				log.Debug("cannot record the failback check in state/failback", zap.Error(err))
			} else {
				t.failback = &c
			}
			cancel()
		}
	}
	return ok, why
}

// checkCaughtUp is caughtUp's check; behind is -1 when it could not be
// made.
func (l *Leader) checkCaughtUp(ctx context.Context, t *term, log *zap.Logger) (bool, string, int) {
	conf := l.conf()
	primary, standby := conf.primary, t.active.Cluster
	// The check runs every 2 s while failback waits: discovery's warning
	// of a configured topic missing on the primary is the discovery
	// loop's to give, once, not this check's each time.
	x, err := l.openTranslation(ctx, standby, primary, zap.NewNop())
	if err != nil {
		return false, err.Error(), -1
	}
	defer x.close()
	positions, err := l.committed(ctx, standby, log)
	if err != nil {
		return false, err.Error(), -1
	}
	parts, _, terr := l.translate(ctx, x, positions, nil)
	exact := map[TopicPartition]bool{}
	for _, ps := range parts {
		if ps.Method == string(offsets.MethodFingerprint) && ps.Lagged == 0 {
			exact[TopicPartition{Topic: ps.ToTopic, Partition: ps.Partition}] = true
		}
	}
	var behind []string
	for _, tp := range slices.SortedFunc(maps.Keys(positions), TopicPartition.Compare) {
		if len(positions[tp].Fingerprints) == 0 {
			continue // nothing consumed there
		}
		s := conf.naming.Stream(standby, tp.Topic)
		on := conf.naming.PartitionOn(standby, primary, tp)
		if !exact[on] {
			behind = append(behind, fmt.Sprintf("%s (%s on %s, written on %s) is not on %s's %s yet", tp, tp.Topic, standby, s.Origin, primary, on))
		}
	}
	if len(behind) == 0 {
		return true, "", 0
	}
	why := fmt.Sprintf("%d partitions behind: the last record consumed on %s", len(behind), behind[0])
	if len(behind) > 1 {
		why += fmt.Sprintf(", and %d more", len(behind)-1)
	}
	if terr != nil {
		log.Debug("failback check: translation errors", zap.Error(terr))
	}
	return false, why, len(behind)
}

// evict frees the partitions of an agent that gossip declared dead without
// waiting for its session lease to expire, once the agent's HTTP endpoint
// confirms it by not answering: the leader deletes its registration
// (fenced: only while this term lasts and the registration is still on
// the lease it had) and revokes that lease. An agent that is in
// fact alive sees its lease gone, stops consuming at once, and registers
// again. With agent.death_detection "lease" it does nothing: the lease
// expires by itself.
func (l *Leader) evict(ctx context.Context, term election.Term, id string, log *zap.Logger) {
	if l.cfg.Agent.DeathDetection == "lease" {
		return
	}
	if id == term.ID || l.members.GossipAlive(id) {
		return // a stale notice: the agent is back in gossip
	}
	if l.members.Answers(ctx, id) {
		log.Warn("gossip reports an agent dead, but it answers over HTTP: not evicting it (its session lease decides)", zap.String("agent_reported_dead", id))
		l.Metrics.deathRefuted()
		return
	}
	l.evictLease(ctx, term, id, log)
}

// evictLease deletes agent id's registration (fenced) and revokes its
// lease: its partitions are free, and it can commit nothing more.
func (l *Leader) evictLease(ctx context.Context, term election.Term, id string, log *zap.Logger) {
	key := l.keys.Agent(id)
	rctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := l.etcd.Get(rctx, key)
	if err != nil || len(resp.Kvs) == 0 || resp.Kvs[0].Lease == 0 {
		return // gone already (its lease expired) or unreadable: the TTL frees it
	}
	lease := clientv3.LeaseID(resp.Kvs[0].Lease)
	_, err = term.Txn(rctx, []clientv3.Cmp{clientv3.Compare(clientv3.LeaseValue(key), "=", lease)}, clientv3.OpDelete(key))
	if err != nil {
		log.Debug("not evicting agent", zap.String("dead_agent", id), zap.Error(err))
		return
	}
	if _, err := l.etcd.Revoke(rctx, lease); err != nil {
		log.Warn("deleted the registration of an agent gossip declared dead, but could not revoke its lease; its commits are refused anyway",
			zap.String("dead_agent", id), zap.Error(err))
		return
	}
	log.Info("evicted agent: revoked its lease so its partitions move now",
		zap.String("dead_agent", id), zap.String("lease", fmt.Sprintf("%x", int64(lease))))
}

// discoverLoop lists the source partitions now and every refresh interval,
// and hands each successful result to found (keeping only the latest).
func (l *Leader) discoverLoop(ctx context.Context, cluster string, log *zap.Logger, found chan []TopicPartition) {
	d := &discovery{leader: l, cluster: cluster, log: log}
	defer d.close()
	t := time.NewTicker(l.cfg.Source.RefreshInterval)
	defer t.Stop()
	for {
		ps, err := d.partitions(ctx, l.conf())
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			log.Warn("topic discovery failed; keeping the last known partitions", zap.String("cluster", cluster), zap.Error(err))
		default:
			select {
			case <-found: // drop a result the loop has not taken yet
			default:
			}
			found <- ps
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-l.rediscover:
		}
	}
}

// readAssignment reads state/assignment and its revision. A value that
// does not parse, or none, is replaced by the next publication; its
// generation is taken past every acknowledged one so agents never see a
// generation go backwards.
func (l *Leader) readAssignment(ctx context.Context, ak *acks) (Assignment, int64, error) {
	rctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := l.etcd.Get(rctx, l.keys.Assignment())
	if err != nil {
		return Assignment{}, 0, err
	}
	if len(resp.Kvs) == 0 {
		// Never written, or deleted: the next generation is above every
		// one an agent applied, which agents would otherwise ignore.
		return Assignment{Generation: maxAck(ak)}, 0, nil
	}
	kv := resp.Kvs[0]
	a, err := ParseAssignment(kv.Value)
	if err != nil {
		l.log.Warn("state/assignment is malformed; the next generation replaces it", zap.Error(err))
		return Assignment{Generation: maxAck(ak)}, kv.ModRevision, nil
	}
	return a, kv.ModRevision, nil
}

// publish writes a, fenced by the term and by the revision of the value it
// replaces, and returns the new revision.
func (l *Leader) publish(ctx context.Context, term election.Term, a Assignment, rev int64) (int64, error) {
	val, err := json.Marshal(a)
	if err != nil {
		return 0, err
	}
	pctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := term.Txn(pctx, []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(l.keys.Assignment()), "=", rev)},
		clientv3.OpPut(l.keys.Assignment(), string(val)))
	if err != nil {
		return 0, err
	}
	return resp.Header.Revision, nil
}

// discovery lists the source partitions of one cluster.
type discovery struct {
	leader  *Leader
	cluster string
	log     *zap.Logger
	client  sarama.Client
	def     config.Cluster  // the definition client was opened with
	missing map[string]bool // configured topics reported missing, to warn once
}

func (d *discovery) close() {
	if d.client != nil {
		_ = d.client.Close()
	}
}

// partitions returns the partitions of the configured topics and of the
// topics matching the regex, sorted. The Kafka calls are bounded by the
// client's timeouts (internal/kafka).
func (d *discovery) partitions(ctx context.Context, conf *dynamic) ([]TopicPartition, error) {
	def := conf.clusters[d.cluster]
	if d.client != nil && !reflect.DeepEqual(def, d.def) {
		d.log.Info("cluster definition changed; discovery reconnects", zap.String("cluster", d.cluster))
		d.close()
		d.client = nil
	}
	if d.client == nil {
		c, err := kafka.NewClientWith(d.cluster, def, kafka.Options{Dialer: d.leader.dialer(d.cluster)})
		if err != nil {
			return nil, err
		}
		d.client, d.def = c, def
		d.missing = map[string]bool{}
	}
	if err := d.client.RefreshMetadata(); err != nil {
		return nil, fmt.Errorf("coordinator: metadata of cluster %s: %w", d.cluster, err)
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	all, err := d.client.Topics()
	if err != nil {
		return nil, fmt.Errorf("coordinator: topics of cluster %s: %w", d.cluster, err)
	}
	// Topics are chosen by their logical name, so every physical copy of
	// a logical topic is found by the same topics and regex: orders and
	// B.orders on the primary, A.orders and orders on a standby filled
	// with the prefix policy.
	want := map[string]bool{}
	for _, t := range conf.source.Topics {
		want[t] = false
	}
	var out []TopicPartition
	for _, t := range all {
		logical := conf.naming.Logical(d.cluster, t)
		_, listed := want[logical]
		internal := strings.HasPrefix(logical, "__")
		if !listed && (conf.regex == nil || internal || !conf.regex.MatchString(logical)) {
			continue
		}
		want[logical] = true
		ps, err := d.client.Partitions(t)
		if err != nil {
			return nil, fmt.Errorf("coordinator: partitions of %s on cluster %s: %w", t, d.cluster, err)
		}
		for _, p := range ps {
			out = append(out, TopicPartition{Topic: t, Partition: p})
		}
	}
	for t := range d.missing {
		if _, still := want[t]; !still {
			delete(d.missing, t) // no longer configured
		}
	}
	for t, found := range want {
		if !found && !d.missing[t] {
			d.log.Warn("configured source topic does not exist on the cluster", zap.String("topic", t), zap.String("cluster", d.cluster))
		}
		d.missing[t] = !found
	}
	slices.SortFunc(out, TopicPartition.Compare)
	return out, nil
}

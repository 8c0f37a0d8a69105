package coordinator

import (
	"context"
	"encoding/json"
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

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/notify"
	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/internal/testhooks"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/state"
	"github.com/kswitch/kswitch/translate"
)

// Membership is what the leader needs to know of the fleet's agents.
type Membership interface {
	// Live returns the ids of the agents that are registered and ready.
	Live() []string
	// Lease returns the session lease of agent id's registration, false
	// when it is not registered. What an agent writes on its own behalf
	// (acks/<id>) counts only on that lease.
	Lease(id string) (clientv3.LeaseID, bool)
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
	// Vouched reports whether agent id has shown it is the process its
	// registration names, and why not when it has not (silence). It
	// must not wait on the network: checks run elsewhere, and Subscribe
	// tells of their results.
	Vouched(id string) (Proof, string)
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
	opts    LeaderOptions

	// dyn is the configuration in force: cfg with the dynamic layer's
	// source and cluster definitions (SetConfig).
	dyn atomic.Pointer[dynamic]
	// rediscover asks the discovery loop to list the partitions now (the
	// source changed).
	rediscover notify.Subscribers
	store      *offsets.Store
	// metrics receives the leader's measurements (LeaderOptions.Metrics;
	// nil: none).
	metrics *Metrics
	// status is the leader's last verdict, for /status.
	status atomic.Pointer[LeaderStatus]
	// bg owns the goroutines that talk to Kafka (discovery, the count of
	// a failback's late tail) and those that confirm and carry out an
	// eviction. They may outlive a term by the length of one call
	// (bounded by the client's timeouts; the eviction's calls end with
	// the term's ctx), so that a dead cluster or agent never delays the
	// end of a term: Wait waits for them.
	bg *sync.WaitGroup
}

// LeaderOptions are the parts of a Leader that are not configuration.
type LeaderOptions struct {
	// Logger receives the leader's logs. Default: none.
	Logger *zap.Logger
	// Metrics, when set, receives the leader's measurements.
	Metrics *Metrics
	// Hooks are this module's tests' (an internal type: nil outside it).
	Hooks *testhooks.Leader
}

// Wait waits for the leader's background goroutines, which a term's end
// does not wait for (each ends within one bounded call). Call it after
// the last Run has returned.
func (l *Leader) Wait() { l.bg.Wait() }

// NewLeader returns the leader work of a fleet. cfg must be validated.
func NewLeader(cfg config.Config, c *clientv3.Client, m Membership, opts LeaderOptions) (*Leader, error) {
	log := opts.Logger
	if log == nil {
		log = zap.NewNop()
	}
	l := &Leader{cfg: cfg, keys: keys.New(cfg.Fleet), etcd: c, members: m, bg: &sync.WaitGroup{}, log: log, opts: opts, metrics: opts.Metrics,
		store: offsets.NewStore(c, keys.New(cfg.Fleet))}
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
	// sources are the source clusters in order of preference, primary
	// is the first.
	sources []string
	primary string
}

// rank is cluster's place in the order of preference: 0 for the primary,
// len(sources) for a cluster that is not a source.
func (d *dynamic) rank(cluster string) int { return rankIn(d.sources, cluster) }

// isSource reports whether cluster is a source cluster.
func (d *dynamic) isSource(cluster string) bool { return slices.Contains(d.sources, cluster) }

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
	d.sources = cfg.Sources()
	if cfg.Source.TopicRegex != "" {
		re, err := regexp.Compile(cfg.Source.TopicRegex)
		if err != nil {
			return fmt.Errorf("coordinator: source.topic_regex: %w", err)
		}
		d.regex = re
	}
	old := l.dyn.Swap(d)
	if old != nil && !reflect.DeepEqual(old.source, d.source) {
		l.rediscover.Notify()
	}
	return nil
}

// conf returns the source and cluster definitions in force.
func (l *Leader) conf() *dynamic { return l.dyn.Load() }

// CheckConfig refuses a configuration the fleet cannot take now: a change
// of the standbys or their order while the fleet does not consume the
// primary, or while a switch is in progress (the cluster being left or
// joined would lose its role under it). Before this leader's first
// verdict it refuses any change of the standbys: try again in a moment.
func (l *Leader) CheckConfig(next, current config.Config) error {
	was, now := current.Sources(), next.Sources()
	if slices.Equal(was, now) {
		return nil
	}
	standbys := func(s []string) string {
		if len(s) < 2 {
			return `""`
		}
		q := make([]string, 0, len(s)-1)
		for _, c := range s[1:] {
			q = append(q, strconv.Quote(c))
		}
		return strings.Join(q, ", ")
	}
	primary, _ := next.Primary()
	st := l.status.Load()
	switch {
	case st == nil:
		return fmt.Errorf("the standby changes from %s to %s, and the leader has not read the fleet's state yet; apply it again in a moment", standbys(was), standbys(now))
	case st.Active.Cluster != primary || st.Active.Phase != state.PhaseActive:
		return fmt.Errorf("the standby changes from %s to %s while the fleet consumes %s (%s): it can change only while the fleet consumes the primary %s",
			standbys(was), standbys(now), st.Active.Cluster, st.Active.Phase, primary)
	}
	return nil
}

// LeaderStatus is what the leader last decided, for /status.
type LeaderStatus struct {
	Active  state.Active `json:"active"`
	Verdict string       `json:"verdict,omitempty"`
	Pin     string       `json:"pin,omitempty"`
	Breaker time.Time    `json:"breaker_open_until,omitzero"`
	CutOff  []string     `json:"cut_off,omitempty"`
	// TopicPins are the topic pins in force (control/pin/topic/), by
	// logical topic; CutOffOn the agents cut off, by cluster in use.
	TopicPins map[string]string `json:"topic_pins,omitempty"`
	// Stages is the staged move's progress (state/stages), if any.
	Stages   *state.StageState   `json:"stages,omitempty"`
	CutOffOn map[string][]string `json:"cut_off_on,omitempty"`
	// Unassigned lists the discovered partitions that no agent consumes
	// or is releasing, with how long: the fleet's stalled partitions.
	Unassigned []string `json:"unassigned,omitempty"`
	// Silent lists the registered agents planned without because they
	// do not acknowledge the generations given to them, with why.
	Silent map[string]string `json:"silent,omitempty"`
}

// Status returns the leader's last verdict, or nil when this agent has not
// led.
func (l *Leader) Status() *LeaderStatus { return l.status.Load() }

func (l *Leader) dialer(cluster string) kafka.Dialer {
	if l.opts.Hooks == nil || l.opts.Hooks.Dialer == nil {
		return nil
	}
	return l.opts.Hooks.Dialer(cluster)
}

// maxSwitchRetry caps the backoff between attempts of a failing switch.
const maxSwitchRetry = 5 * time.Second

// reread reloads state/active and state/assignment after a failed write.
func (l *Leader) reread(ctx context.Context, t *term, ak *acks, log *zap.Logger) {
	if a, rev, recovered, err := l.readActive(ctx); err == nil {
		t.active, t.activeRev, t.activeUnwritten = a, rev, recovered
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
	var evs []state.SwitchEvent
	for _, kv := range resp.Kvs {
		ev, err := state.ParseSwitchEvent(kv.Value)
		if err != nil {
			l.log.Warn("refusing a malformed history/ entry; the breaker is restored without it",
				zap.String("key", string(kv.Key)), zap.Error(err))
			l.metrics.refusedValue(refused.History)
			continue
		}
		if !(ev.Automatic || ev.Abandoned != "") || ev.Finished.Before(since) {
			continue
		}
		evs = append(evs, ev)
	}
	slices.SortFunc(evs, func(a, b state.SwitchEvent) int { return a.Finished.Compare(b.Finished) })
	for _, ev := range evs {
		br.record(ev.Finished, ev.Abandoned != "")
	}
	return nil
}

// generationsSpent ends a term whose next generation would pass
// state.MaxGeneration. It matches election.ErrNotLeader: the term leads no
// further, and the next term's first generation is 1, ordered above every
// earlier one by the term's token.
type generationsSpent struct{ next int64 }

func (e generationsSpent) Error() string {
	return fmt.Sprintf("coordinator: the next generation would be %d, past the bound 2^53 agents accept: ending this term so that the next starts at 1", e.next)
}

func (generationsSpent) Is(target error) bool { return target == election.ErrNotLeader }

// publishTerm publishes a as the term's next generation.
func (l *Leader) publishTerm(ctx context.Context, t *term, a state.Assignment) error {
	// A term's first value goes above every generation an agent applied
	// (agents keep the numbers running across terms). Later ones follow
	// the term's own: an ack above them is from before the generations
	// started again, or a stranger's (the repair goes above one an agent
	// really applied).
	first := t.current.Token != t.Rev
	if m := maxAck(t.acks); first && a.Generation <= m {
		a.Generation = m + 1
	}
	if a.Generation > state.MaxGeneration {
		// Agents refuse generations past the bound. Values near it
		// were written by someone else (a leader adds one at a time).
		// This term's first value starts a new run of generations at 1:
		// agents order values by term first (a newer term's token is
		// newer whatever its generation). A term that published already
		// has agents on its own numbers: it ends, and the next starts
		// again.
		if !first {
			return generationsSpent{next: a.Generation}
		}
		t.log.Warn("generations near the bound (written by someone else): this term starts them again at 1",
			zap.Int64("would_be", a.Generation), zap.Int64("bound", state.MaxGeneration))
		a.Generation = 1
	}
	a.Leader, a.Token, a.Published = t.ID, t.Rev, time.Now().UTC()
	rev, err := l.publish(ctx, t.Term, a, t.currentRev)
	if err != nil {
		return err
	}
	t.current, t.currentRev = a, rev
	t.log.Info("published assignment", zap.Int64("generation", a.Generation), zap.String("cluster", a.Cluster),
		zap.Int("agents", len(a.Owned)), zap.Int("revoking", revokingPartitions(a)), zap.Strings("placed", a.Sections()[1:]))
	return nil
}

// caughtUp reports whether cluster `to` (the primary, or a standby
// preferred to the active one) holds the last record consumed on the
// active cluster in every partition of every stream: the fingerprint
// translation from the active cluster to `to` must find it exactly.
// For the primary's own records (B's A.orders back to A's orders) that is
// the primary still holding what it wrote; for the records written on the
// standby during the outage (B's orders to A's B.orders) it is MirrorMaker
// 2's flow back having copied everything the fleet consumed. When not, the
// reason names the partitions behind, and kswitch_failback_behind_partitions
// counts them.
func (l *Leader) caughtUp(ctx context.Context, t *term, to string, log *zap.Logger) (bool, string) {
	ok, why, behind, _ := l.checkCaughtUp(ctx, t.active, to, log)
	l.metrics.failbackBehind(behind)
	c := state.FailbackCheck{Standby: t.active.Cluster, To: to, Epoch: t.active.Epoch, CaughtUp: ok, Reason: why, Behind: behind}
	if last := t.failback; last == nil || last.Standby != c.Standby || last.To != to || last.Epoch != c.Epoch || last.CaughtUp != ok || last.Reason != why {
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

// checkCaughtUp is caughtUp's check of cluster target against the active
// state a: behind counts the partitions whose last consumed record it
// lacks, lacking the consumed records it lacks where the translation
// could tell; both -1 when the check could not be made.
func (l *Leader) checkCaughtUp(ctx context.Context, a state.Active, target string, log *zap.Logger) (ok bool, why string, behind int, lacking int64) {
	conf := l.conf()
	standby := a.Cluster
	// The check runs every 2 s while failback waits: discovery's warning
	// of a configured topic missing on the target is the discovery
	// loop's to give, once, not this check's each time.
	x, err := l.openTranslation(ctx, standby, target, false, zap.NewNop())
	if err != nil {
		return false, err.Error(), -1, -1
	}
	defer x.close()
	// Only the topics consumed on the standby: those placed on the
	// target are there already.
	onStandby := func(logical string) bool { return a.PositionsOf(logical) == standby }
	x.restrict(onStandby)
	positions, err := l.committed(ctx, standby, log)
	if err != nil {
		return false, err.Error(), -1, -1
	}
	maps.DeleteFunc(positions, func(tp state.TopicPartition, _ offsets.Position) bool {
		return !onStandby(conf.naming.Logical(standby, tp.Topic))
	})
	parts, _, terr := l.translate(ctx, x, positions, nil)
	exact := map[state.TopicPartition]bool{}
	for _, ps := range parts {
		if ps.Method == string(translate.MethodFingerprint) && ps.Lagged == 0 {
			exact[state.TopicPartition{Topic: ps.ToTopic, Partition: ps.Partition}] = true
		}
		lacking += max(ps.Lagged, 0)
	}
	var behindTPs []string
	for _, tp := range slices.SortedFunc(maps.Keys(positions), state.TopicPartition.Compare) {
		if len(positions[tp].Fingerprints) == 0 {
			continue // nothing consumed there
		}
		s := conf.naming.Stream(standby, tp.Topic)
		on := conf.naming.PartitionOn(standby, target, tp)
		if !exact[on] {
			behindTPs = append(behindTPs, fmt.Sprintf("%s (%s on %s, written on %s) is not on %s's %s yet", tp, tp.Topic, standby, s.Origin, target, on))
		}
	}
	if len(behindTPs) == 0 {
		return true, "", 0, lacking
	}
	why = fmt.Sprintf("%d partitions behind: the last record consumed on %s", len(behindTPs), behindTPs[0])
	if len(behindTPs) > 1 {
		why += fmt.Sprintf(", and %d more", len(behindTPs)-1)
	}
	if terr != nil {
		log.Debug("failback check: translation errors", zap.Error(terr))
	}
	return false, why, len(behindTPs), lacking
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
		l.metrics.deathRefuted()
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

// readAssignment reads state/assignment and its revision. A value that
// does not parse, or none, is replaced by the next publication; its
// generation is taken past every acknowledged one so agents never see a
// generation go backwards.
func (l *Leader) readAssignment(ctx context.Context, ak *acks) (state.Assignment, int64, error) {
	rctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := l.etcd.Get(rctx, l.keys.Assignment())
	if err != nil {
		return state.Assignment{}, 0, err
	}
	if len(resp.Kvs) == 0 {
		// Never written, or deleted: the next generation is above every
		// one an agent applied, which agents would otherwise ignore.
		return state.Assignment{Generation: maxAck(ak)}, 0, nil
	}
	kv := resp.Kvs[0]
	a, err := state.ParseAssignment(kv.Value)
	if err != nil {
		l.log.Warn("state/assignment is malformed; the next generation replaces it", zap.Error(err))
		return state.Assignment{Generation: maxAck(ak)}, kv.ModRevision, nil
	}
	return a, kv.ModRevision, nil
}

// publish writes a, fenced by the term and by the revision of the value it
// replaces, and returns the new revision.
func (l *Leader) publish(ctx context.Context, term election.Term, a state.Assignment, rev int64) (int64, error) {
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

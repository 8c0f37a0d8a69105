package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/dynconfig"
	"github.com/kswitch/kswitch/internal/etcdwatch"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/notify"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/signals"
	"github.com/kswitch/kswitch/state"
)

// Registration is what an agent writes under agents/<id> on its session
// lease: the key exists exactly while the agent's session lives.
type Registration struct {
	ID      string    `json:"id"`
	HTTP    string    `json:"http"`
	Gossip  string    `json:"gossip"`
	Version string    `json:"version"`
	Started time.Time `json:"started"`
	// Config is the digest of the agent's fleet-wide configuration; nil
	// in the registration of an agent older than it.
	Config *ConfigDigest `json:"config,omitempty"`
	// Lease is the session lease the registration is kept on (set from
	// etcd, not from the value): what the agent writes on its own behalf
	// (acks/<id>) is on this lease.
	Lease clientv3.LeaseID `json:"-"`
}

// maxRegistrationSize bounds what is parsed from agents/: a value written
// there by a stranger must not make an agent allocate without bound.
const maxRegistrationSize = 4 << 10

// ParseRegistration decodes and checks the value of the key agents/<id>.
func ParseRegistration(id string, val []byte) (Registration, error) {
	var r Registration
	if len(val) > maxRegistrationSize {
		return r, fmt.Errorf("agent: registration of %q is %d bytes, over the %d-byte limit", id, len(val), maxRegistrationSize)
	}
	if err := json.Unmarshal(val, &r); err != nil {
		return r, fmt.Errorf("agent: registration of %q is not valid JSON: %w", id, err)
	}
	if r.ID != id {
		return r, fmt.Errorf("agent: registration under key %q names agent %q", id, r.ID)
	}
	if c := r.Config; c != nil {
		for part, d := range map[string]string{"digest": c.Digest, "routing": c.Routing, "source": c.Source, "clusters": c.Clusters, "failover": c.Failover} {
			if !isDigest(d) {
				return r, fmt.Errorf("agent: registration of %q: config.%s %q is not a configuration digest (12 lower-case hex digits)", id, part, d)
			}
		}
	}
	return r, nil
}

// isDigest reports whether s is as digestOf writes them.
func isDigest(s string) bool {
	if len(s) != 12 {
		return false
	}
	for _, c := range s {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// parseRegistrationKV is ParseRegistration of an etcd key-value: a
// registration is an agent's only while its session lease keeps it, so
// one written without a lease (by hand) is refused.
func parseRegistrationKV(id string, kv *mvccpb.KeyValue) (Registration, error) {
	if kv.Lease == 0 {
		return Registration{}, fmt.Errorf("agent: registration of %q has no lease: an agent registers on its session lease, so this one was written by hand and is not a member (delete it)", id)
	}
	r, err := ParseRegistration(id, kv.Value)
	r.Lease = clientv3.LeaseID(kv.Lease)
	return r, err
}

// ReadRegistrations lists the registered agents of a fleet, sorted by id.
// Values that do not parse are skipped and described in refused, so a
// caller can show the good ones and warn about the rest.
func ReadRegistrations(ctx context.Context, c *clientv3.Client, k keys.Fleet) (regs []Registration, refused []string, err error) {
	resp, err := c.Get(ctx, k.Agents(), clientv3.WithPrefix())
	if err != nil {
		return nil, nil, fmt.Errorf("agent: list %s: %w", k.Agents(), err)
	}
	for _, kv := range resp.Kvs {
		id, ok := k.AgentID(string(kv.Key))
		if !ok {
			continue
		}
		r, err := parseRegistrationKV(id, kv)
		if err != nil {
			refused = append(refused, err.Error())
			continue
		}
		regs = append(regs, r)
	}
	slices.SortFunc(regs, func(a, b Registration) int { return strings.Compare(a.ID, b.ID) })
	return regs, refused, nil
}

// registry follows agents/ in etcd. run owns its goroutine; the other
// methods may be called from any goroutine.
type registry struct {
	client  *clientv3.Client
	keys    keys.Fleet
	log     *zap.Logger
	timeout time.Duration
	onBad   func() // counts refused values; must not block

	mu   sync.Mutex
	regs map[string]Registration
	subs notify.Subscribers
}

func newRegistry(c *clientv3.Client, k keys.Fleet, timeout time.Duration, log *zap.Logger, onBad func()) *registry {
	return &registry{client: c, keys: k, log: log, timeout: timeout, onBad: onBad, regs: map[string]Registration{}}
}

// list returns the registered agents sorted by id.
func (r *registry) list() []Registration {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := slices.Collect(maps.Values(r.regs))
	slices.SortFunc(out, func(a, b Registration) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// Lease returns the session lease of agent id's registration.
func (r *registry) Lease(id string) (clientv3.LeaseID, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	reg, ok := r.regs[id]
	return reg.Lease, ok
}

// get returns agent id's registration, false when it is not registered.
func (r *registry) get(id string) (Registration, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	reg, ok := r.regs[id]
	return reg, ok
}

// Live returns the ids of the registered agents, sorted. An agent is
// registered exactly while its session lease lives.
func (r *registry) Live() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Sorted(maps.Keys(r.regs))
}

// Subscribe returns a channel that receives a value after the registered
// agents changed; notifications coalesce. It is unsubscribed when ctx ends.
func (r *registry) Subscribe(ctx context.Context) <-chan struct{} { return r.subscribe(ctx) }

func (r *registry) subscribe(ctx context.Context) chan struct{} { return r.subs.Subscribe(ctx) }

// run follows agents/ until ctx ends.
func (r *registry) run(ctx context.Context) {
	_ = etcdwatch.Follow(ctx, r.client, etcdwatch.Target{Key: r.keys.Agents(), Prefix: true, Timeout: r.timeout, OnError: func(err error) {
		r.log.Debug("agents watch interrupted; relisting", zap.Error(err))
	}}, r)
}

// Reset implements etcdwatch.Follower.
func (r *registry) Reset(kvs []*mvccpb.KeyValue, _ int64) {
	regs := map[string]Registration{}
	for _, kv := range kvs {
		if reg, ok := r.parse(kv); ok {
			regs[reg.ID] = reg
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.regs = regs
	r.subs.Notify()
}

// Apply implements etcdwatch.Follower.
func (r *registry) Apply(evs []*clientv3.Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, ev := range evs {
		id, ok := r.keys.AgentID(string(ev.Kv.Key))
		if !ok {
			continue
		}
		if ev.Type == clientv3.EventTypeDelete {
			delete(r.regs, id)
			continue
		}
		if reg, ok := r.parse(ev.Kv); ok {
			r.regs[id] = reg
		} else {
			delete(r.regs, id)
		}
	}
	r.subs.Notify()
}

func (r *registry) parse(kv *mvccpb.KeyValue) (Registration, bool) {
	id, ok := r.keys.AgentID(string(kv.Key))
	if !ok {
		return Registration{}, false
	}
	reg, err := parseRegistrationKV(id, kv)
	if err != nil {
		r.log.Warn("ignoring agent registration", zap.String("key", string(kv.Key)), zap.Error(err))
		r.onBad()
		return Registration{}, false
	}
	return reg, true
}

// FleetView is a fleet as stored in etcd: who leads, who is registered,
// the assignment and the committed positions. It is what `kswitch status`
// shows; it needs no running agent.
type FleetView struct {
	Fleet  string         `json:"fleet"`
	Leader string         `json:"leader"`
	Token  int64          `json:"fencing_token"`
	Agents []Registration `json:"agents"`
	// Active is the active cluster; nil before the first leader wrote it.
	Active *state.Active `json:"active,omitempty"`
	// Assignment is nil when none was published yet.
	Assignment *state.Assignment `json:"assignment,omitempty"`
	// Partitions are the assigned partitions of every cluster consumed
	// (the assignment's, and those topics are placed on) with their
	// committed positions there, by cluster.
	Partitions []PartitionView `json:"partitions,omitempty"`
	// Signals are the pause/start signals in force, and refused values.
	Signals signals.State `json:"signals"`
	// Refused lists values that could not be parsed.
	Refused []string `json:"refused,omitempty"`
	// Config is the dynamic configuration version in force and the
	// leader's last refusal.
	Config dynconfig.State `json:"config"`
	// Failback is the leader's last failback check while the fleet is
	// on the standby (nil otherwise): why it does not fail back yet.
	Failback *state.FailbackCheck `json:"failback,omitempty"`
	// Stages is the staged move's progress (state/stages), nil when
	// there is none.
	Stages *state.StageState `json:"stages,omitempty"`
	// StageSteps are the steps of that move (history/stages/), oldest
	// first.
	StageSteps []state.StageStep `json:"stage_steps,omitempty"`
	// Stalled is the leader's list of partitions that no agent has
	// consumed for over state.StalledAfter (nil: none).
	Stalled *state.Stalled `json:"stalled,omitempty"`
	// ConfigDisagree are the agents whose configuration digest differs
	// from the fleet's (CompareConfigs, the leader's digest breaking a
	// tie), nil when they agree.
	ConfigDisagree []ConfigDisagreement `json:"config_disagree,omitempty"`
	// Ready is each agent's own answer on /readyz, filled by AskReady
	// (kswitch status); empty when not asked.
	Ready map[string]Readiness `json:"ready,omitempty"`
}

// Readiness is an agent's answer on /readyz.
type Readiness struct {
	// Answered is false when the agent did not answer (Reason says why).
	Answered bool   `json:"answered"`
	Ready    bool   `json:"ready"`
	Reason   string `json:"reason,omitempty"`
	// RecordsPerSecond is what the agent handed its handler per second
	// over the last 10 s.
	RecordsPerSecond float64 `json:"records_per_second"`
}

// AskReady asks every registered agent's /readyz, in parallel, each within
// timeout, and fills v.Ready.
func (v *FleetView) AskReady(ctx context.Context, timeout time.Duration) {
	v.Ready = make(map[string]Readiness, len(v.Agents))
	var mu sync.Mutex
	var wg sync.WaitGroup
	hc := &http.Client{Timeout: timeout}
	for _, a := range v.Agents {
		wg.Go(func() {
			r := askReady(ctx, hc, a.HTTP)
			mu.Lock()
			v.Ready[a.ID] = r
			mu.Unlock()
		})
	}
	wg.Wait()
}

// askReady asks one agent's /readyz at addr (host:port).
func askReady(ctx context.Context, hc *http.Client, addr string) Readiness {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/readyz", nil)
	if err != nil {
		return Readiness{Reason: err.Error()}
	}
	resp, err := hc.Do(req)
	if err != nil {
		return Readiness{Reason: err.Error()}
	}
	defer resp.Body.Close()
	var body readyBody
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<10)).Decode(&body); err != nil {
		return Readiness{Reason: fmt.Sprintf("/readyz %d: %v", resp.StatusCode, err)}
	}
	rate, _ := strconv.ParseFloat(body.RecordsPerSecond, 64) // an older agent's answer has none: 0
	return Readiness{Answered: true, Ready: resp.StatusCode == http.StatusOK, Reason: body.Reason, RecordsPerSecond: rate}
}

// PartitionView is one partition of a FleetView.
type PartitionView struct {
	// Cluster is the cluster the partition is consumed on: the
	// assignment's, or the one its topic is placed on.
	Cluster string `json:"cluster"`
	state.TopicPartition
	Owner string `json:"owner"`
	// Revoking is true while the owner is releasing it.
	Revoking bool `json:"revoking,omitempty"`
	// Committed is the next offset to consume, -1 when none is committed.
	Committed int64 `json:"committed"`
	// CommittedAt is when it was committed.
	CommittedAt time.Time `json:"committed_at,omitzero"`
	// End is the partition's high watermark, -1 when unknown (the
	// cluster was not asked or did not answer).
	End int64 `json:"end"`
	// Lag is End - Committed, -1 when either is unknown.
	Lag int64 `json:"lag"`
}

// ReadFleet reads a fleet's leader and registrations from etcd.
func ReadFleet(ctx context.Context, c *clientv3.Client, fleet string) (FleetView, error) {
	k := keys.New(fleet)
	v := FleetView{Fleet: fleet}
	l, err := election.Current(ctx, c, k.Election())
	switch {
	case errors.Is(err, election.ErrNoLeader):
	case err != nil:
		return v, err
	default:
		v.Leader, v.Token = l.ID, l.Token
	}
	if v.Agents, v.Refused, err = ReadRegistrations(ctx, c, k); err != nil {
		return v, err
	}
	v.ConfigDisagree = CompareConfigs(v.Agents, v.Leader)
	if v.Signals, err = signals.Read(ctx, c, k); err != nil {
		return v, err
	}
	if v.Config, err = dynconfig.ReadState(ctx, c, k); errors.Is(err, dynconfig.ErrMalformed) {
		v.Refused = append(v.Refused, err.Error())
	} else if err != nil {
		return v, err
	}
	if resp, err := c.Get(ctx, k.Active()); err != nil {
		return v, fmt.Errorf("agent: read %s: %w", k.Active(), err)
	} else if len(resp.Kvs) > 0 {
		if a, err := state.ParseActive(resp.Kvs[0].Value); err != nil {
			v.Refused = append(v.Refused, err.Error())
		} else {
			v.Active = &a
		}
	}
	if resp, err := c.Get(ctx, k.Failback()); err != nil {
		return v, fmt.Errorf("agent: read %s: %w", k.Failback(), err)
	} else if len(resp.Kvs) > 0 && v.Active != nil {
		if fb, err := state.ParseFailbackCheck(resp.Kvs[0].Value); err != nil {
			v.Refused = append(v.Refused, err.Error())
		} else if fb.Standby == v.Active.Cluster && fb.Epoch == v.Active.Epoch && v.Active.Phase == state.PhaseActive {
			v.Failback = &fb
		}
	}
	if resp, err := c.Get(ctx, k.StagesState()); err != nil {
		return v, fmt.Errorf("agent: read %s: %w", k.StagesState(), err)
	} else if len(resp.Kvs) > 0 {
		if st, err := state.ParseStageState(resp.Kvs[0].Value); err != nil {
			v.Refused = append(v.Refused, err.Error())
		} else {
			v.Stages = &st
			if v.StageSteps, err = readStageSteps(ctx, c, k, st.Revision, &v.Refused); err != nil {
				return v, err
			}
		}
	}
	if resp, err := c.Get(ctx, k.Stalled()); err != nil {
		return v, fmt.Errorf("agent: read %s: %w", k.Stalled(), err)
	} else if len(resp.Kvs) > 0 {
		if st, err := state.ParseStalled(resp.Kvs[0].Value); err != nil {
			v.Refused = append(v.Refused, err.Error())
		} else {
			v.Stalled = &st
		}
	}
	resp, err := c.Get(ctx, k.Assignment())
	if err != nil {
		return v, fmt.Errorf("agent: read %s: %w", k.Assignment(), err)
	}
	if len(resp.Kvs) == 0 {
		return v, nil
	}
	a, err := state.ParseAssignment(resp.Kvs[0].Value)
	if err != nil {
		v.Refused = append(v.Refused, err.Error())
		return v, nil
	}
	v.Assignment = &a
	store := offsets.NewStore(c, k)
	for _, cluster := range a.Sections() {
		positions, bad, err := store.List(ctx, cluster)
		if err != nil {
			return v, err
		}
		for _, b := range bad {
			v.Refused = append(v.Refused, b.Error())
		}
		byTP := map[state.TopicPartition]offsets.Position{}
		for _, p := range positions {
			byTP[p.TopicPartition()] = p
		}
		sec := a.Section(cluster)
		for _, m := range []map[string][]state.TopicPartition{sec.Owned, sec.Revoking} {
			for owner, tps := range m {
				for _, tp := range tps {
					pv := PartitionView{Cluster: cluster, TopicPartition: tp, Owner: owner, Revoking: slices.Contains(sec.Revoking[owner], tp),
						Committed: -1, End: -1, Lag: -1}
					if p, ok := byTP[tp]; ok {
						pv.Committed, pv.CommittedAt = p.Offset, p.CommittedAt
					}
					v.Partitions = append(v.Partitions, pv)
				}
			}
		}
	}
	slices.SortFunc(v.Partitions, func(x, y PartitionView) int {
		return state.ClusterPartition{Cluster: x.Cluster, TopicPartition: x.TopicPartition}.Compare(
			state.ClusterPartition{Cluster: y.Cluster, TopicPartition: y.TopicPartition})
	})
	return v, nil
}

// maxStageSteps bounds the steps of a staged move read (a plan of N
// stages writes about 2N+1).
const maxStageSteps = 200

// readStageSteps reads the steps of the staged move written at revision
// rev, oldest first; a step that does not decode is added to refused.
func readStageSteps(ctx context.Context, c *clientv3.Client, k keys.Fleet, rev int64, refused *[]string) ([]state.StageStep, error) {
	resp, err := c.Get(ctx, k.StageEvents(rev), clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend),
		clientv3.WithLimit(maxStageSteps))
	if err != nil {
		return nil, fmt.Errorf("agent: read %s: %w", k.StageEvents(rev), err)
	}
	var steps []state.StageStep
	for _, kv := range resp.Kvs {
		st, err := state.ParseStageStep(kv.Value)
		if err != nil {
			*refused = append(*refused, fmt.Sprintf("%s: %v", kv.Key, err))
			continue
		}
		steps = append(steps, st)
	}
	return steps, nil
}

// FillLag asks each cluster of the assignment that clusters names with
// brokers for the end offset of its partitions, and sets their End and
// Lag. Each call is bounded by the client's timeouts (internal/kafka);
// a cluster that does not answer leaves its partitions' lag unknown (-1)
// and is named in the error.
func (v *FleetView) FillLag(clusters map[string]config.Cluster) error {
	if v.Assignment == nil {
		return nil
	}
	var errs []error
	for _, name := range v.Assignment.Sections() {
		c, ok := clusters[name]
		if !ok || len(c.Brokers) == 0 {
			continue
		}
		if err := fillLag(name, c, v.Partitions); err != nil {
			errs = append(errs, fmt.Errorf("no lag on %s: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

func fillLag(name string, c config.Cluster, ps []PartitionView) error {
	client, err := kafka.NewClient(name, c)
	if err != nil {
		return err
	}
	defer client.Close()
	var errs []error
	for i := range ps {
		if ps[i].Cluster != name {
			continue
		}
		end, err := client.GetOffset(ps[i].Topic, ps[i].Partition, sarama.OffsetNewest)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", ps[i].TopicPartition, err))
			continue
		}
		ps[i].End = end
		if ps[i].Committed >= 0 {
			ps[i].Lag = max(0, end-ps[i].Committed)
		}
	}
	return errors.Join(errs...)
}

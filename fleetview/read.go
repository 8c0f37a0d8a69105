package fleetview

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/IBM/sarama"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/signals"
	"github.com/kswitch/kswitch/state"
)

// FleetView is a fleet as stored in etcd: who leads, who is registered,
// the assignment and the committed positions. It is what `kswitch status`
// shows; it needs no running agent.
type FleetView struct {
	Fleet  string               `json:"fleet"`
	Leader string               `json:"leader"`
	Token  int64                `json:"fencing_token"`
	Agents []state.Registration `json:"agents"`
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
	Config state.ConfigState `json:"config"`
	// Failback is the leader's last failback check while the fleet is
	// on the standby (nil otherwise): why it does not fail back yet.
	Failback *state.FailbackCheck `json:"failback,omitempty"`
	// Clusters is the leader's view of the source clusters
	// (state/clusters): their order, health and how far each is behind
	// the active one; nil before a leader wrote it.
	Clusters *state.ClusterState `json:"clusters,omitempty"`
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
	ConfigDisagree []state.ConfigDisagreement `json:"config_disagree,omitempty"`
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
	var body ReadyBody
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
func ReadFleet(ctx context.Context, c *clientv3.Client, k keys.Fleet) (FleetView, error) {
	v := FleetView{Fleet: k.Name()}
	if err := v.readLeader(ctx, c, k); err != nil {
		return v, err
	}
	var err error
	if v.Agents, v.Refused, err = state.ReadRegistrations(ctx, c, k); err != nil {
		return v, err
	}
	v.ConfigDisagree = state.CompareConfigs(v.Agents, v.Leader)
	if v.Signals, err = signals.Read(ctx, c, k); err != nil {
		return v, err
	}
	if v.Config, err = state.ReadConfigState(ctx, c, k); errors.Is(err, state.ErrMalformed) {
		v.Refused = append(v.Refused, err.Error())
	} else if err != nil {
		return v, err
	}
	if err := v.readActive(ctx, c, k); err != nil {
		return v, err
	}
	if err := v.readFailback(ctx, c, k); err != nil {
		return v, err
	}
	if v.Clusters, err = readParsed(ctx, c, k.Clusters(), state.ParseClusterState, &v.Refused); err != nil {
		return v, err
	}
	if err := v.readStages(ctx, c, k); err != nil {
		return v, err
	}
	if err := v.readStalled(ctx, c, k); err != nil {
		return v, err
	}
	if err := v.readAssignment(ctx, c, k); err != nil {
		return v, err
	}
	return v, nil
}

// readLeader sets the leader and its fencing token, when there is one.
func (v *FleetView) readLeader(ctx context.Context, c *clientv3.Client, k keys.Fleet) error {
	l, err := election.Current(ctx, c, k.Election())
	switch {
	case errors.Is(err, election.ErrNoLeader):
	case err != nil:
		return err
	default:
		v.Leader, v.Token = l.ID, l.Token
	}
	return nil
}

// getValue reads key, returning its value and whether it exists; the
// error names the key.
func getValue(ctx context.Context, c *clientv3.Client, key string) ([]byte, bool, error) {
	resp, err := c.Get(ctx, key)
	if err != nil {
		return nil, false, fmt.Errorf("agent: read %s: %w", key, err)
	}
	if len(resp.Kvs) == 0 {
		return nil, false, nil
	}
	return resp.Kvs[0].Value, true, nil
}

// readParsed reads key and parses its value with parse: nil when the key
// is absent, and nil with the parse error added to refused when the value
// does not parse. The error is etcd's.
func readParsed[T any](ctx context.Context, c *clientv3.Client, key string, parse func([]byte) (T, error), refused *[]string) (*T, error) {
	b, ok, err := getValue(ctx, c, key)
	if err != nil || !ok {
		return nil, err
	}
	val, err := parse(b)
	if err != nil {
		*refused = append(*refused, err.Error())
		return nil, nil
	}
	return &val, nil
}

// readActive sets the active cluster (state/active), when the leader
// wrote it; a value that does not parse is added to v.Refused.
func (v *FleetView) readActive(ctx context.Context, c *clientv3.Client, k keys.Fleet) (err error) {
	v.Active, err = readParsed(ctx, c, k.Active(), state.ParseActive, &v.Refused)
	return err
}

// readFailback sets the leader's last failback check when it was made in
// the current epoch on the standby the fleet is active on, and no switch
// is under way: an older check says nothing of why the fleet does not fail
// back now. It reads v.Active, so it runs after readActive.
func (v *FleetView) readFailback(ctx context.Context, c *clientv3.Client, k keys.Fleet) error {
	if v.Active == nil {
		return nil
	}
	fb, err := readParsed(ctx, c, k.Failback(), state.ParseFailbackCheck, &v.Refused)
	if fb != nil && fb.Standby == v.Active.Cluster && fb.Epoch == v.Active.Epoch && v.Active.Phase == state.PhaseActive {
		v.Failback = fb
	}
	return err
}

// readStages sets the staged move's progress (state/stages) and its steps,
// when there is one.
func (v *FleetView) readStages(ctx context.Context, c *clientv3.Client, k keys.Fleet) (err error) {
	v.Stages, err = readParsed(ctx, c, k.StagesState(), state.ParseStageState, &v.Refused)
	if err != nil || v.Stages == nil {
		return err
	}
	v.StageSteps, err = readStageSteps(ctx, c, k, v.Stages.Revision, &v.Refused)
	return err
}

// readStalled sets the leader's list of stalled partitions, when there is
// one.
func (v *FleetView) readStalled(ctx context.Context, c *clientv3.Client, k keys.Fleet) (err error) {
	v.Stalled, err = readParsed(ctx, c, k.Stalled(), state.ParseStalled, &v.Refused)
	return err
}

// readAssignment sets the assignment, when one was published, and the
// partitions it assigns on each of its clusters with their committed
// positions there, sorted by cluster and partition.
func (v *FleetView) readAssignment(ctx context.Context, c *clientv3.Client, k keys.Fleet) error {
	b, ok, err := getValue(ctx, c, k.Assignment())
	if err != nil || !ok {
		return err
	}
	a, err := state.ParseAssignment(b)
	if err != nil {
		v.Refused = append(v.Refused, err.Error())
		return nil
	}
	v.Assignment = &a
	store := offsets.NewStore(c, k)
	for _, cluster := range a.Sections() {
		positions, bad, err := store.List(ctx, cluster)
		if err != nil {
			return err
		}
		for _, e := range bad {
			v.Refused = append(v.Refused, e.Error())
		}
		v.Partitions = append(v.Partitions, sectionViews(cluster, a.Section(cluster), positions)...)
	}
	slices.SortFunc(v.Partitions, func(x, y PartitionView) int {
		return state.ClusterPartition{Cluster: x.Cluster, TopicPartition: x.TopicPartition}.Compare(
			state.ClusterPartition{Cluster: y.Cluster, TopicPartition: y.TopicPartition})
	})
	return nil
}

// sectionViews returns the partitions that sec assigns on cluster, owned
// or being released, with their committed positions among positions (-1
// when none is committed); end and lag are left unknown for FillLag.
func sectionViews(cluster string, sec state.Placement, positions []offsets.Position) []PartitionView {
	byTP := map[state.TopicPartition]offsets.Position{}
	for _, p := range positions {
		byTP[p.TopicPartition()] = p
	}
	var out []PartitionView
	for _, m := range []map[string][]state.TopicPartition{sec.Owned, sec.Revoking} {
		for owner, tps := range m {
			for _, tp := range tps {
				pv := PartitionView{Cluster: cluster, TopicPartition: tp, Owner: owner, Revoking: slices.Contains(sec.Revoking[owner], tp),
					Committed: -1, End: -1, Lag: -1}
				if p, ok := byTP[tp]; ok {
					pv.Committed, pv.CommittedAt = p.Offset, p.CommittedAt
				}
				out = append(out, pv)
			}
		}
	}
	return out
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

// ReadyBody is an agent's answer on /readyz. Every value is a string: probes and
// scripts decode it as an object of strings.
type ReadyBody struct {
	Status string `json:"status"`
	Reason string `json:"reason,omitempty"`
	Agent  string `json:"agent"`
	// RecordsPerSecond is the records handed to the handler per second
	// over the last 10 s, formatted with one decimal.
	RecordsPerSecond string `json:"records_per_second"`
}

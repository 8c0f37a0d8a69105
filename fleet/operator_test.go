package fleet_test

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/fleet"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/signals"
	"github.com/kswitch/kswitch/state"
)

// operatorOn returns an operator of fleet "orders" on a fresh etcd, and
// that etcd's client to look at the keys with.
func operatorOn(t *testing.T) (*fleet.Operator, *clientv3.Client) {
	t.Helper()
	cli := testenv.EtcdClientT(t, testenv.StartEtcdT(t))
	op, err := fleet.NewOperator(cli, "orders")
	if err != nil {
		t.Fatal(err)
	}
	return op, cli
}

// value returns key's value, "" when it is absent.
func value(t *testing.T, cli *clientv3.Client, key string) string {
	t.Helper()
	resp, err := cli.Get(t.Context(), key)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return ""
	}
	return string(resp.Kvs[0].Value)
}

// The operator writes the keys the leader follows, the ones an operator
// would write with etcdctl, and refuses a bad name before writing.
func TestOperatorPinsWhatEtcdctlWould(t *testing.T) {
	t.Parallel()
	op, cli := operatorOn(t)
	ctx := t.Context()
	k := op.Keys()
	if err := op.Pin(ctx, "B"); err != nil {
		t.Fatal(err)
	}
	if v := value(t, cli, "/kswitch/orders/control/pin"); v != "B" {
		t.Fatalf("control/pin = %q after Pin(B)", v)
	}
	if err := op.PinTopic(ctx, "audit", "B"); err != nil {
		t.Fatal(err)
	}
	if v := value(t, cli, k.TopicPin("audit")); v != "B" {
		t.Fatalf("%s = %q after PinTopic(audit, B)", k.TopicPin("audit"), v)
	}
	if err := op.PinTopic(ctx, "bad/topic", "B"); err == nil || !strings.Contains(err.Error(), "bad/topic") {
		t.Errorf("PinTopic of an invalid name: %v, want an error naming it", err)
	}
	if err := op.Pin(ctx, ""); err == nil {
		t.Error("Pin to an empty cluster name succeeded")
	}
	if v := value(t, cli, k.Pin()); v != "B" {
		t.Errorf("control/pin = %q after a refused Pin, want B kept", v)
	}
	if err := op.Unpin(ctx); err != nil {
		t.Fatal(err)
	}
	if err := op.UnpinTopic(ctx, "audit"); err != nil {
		t.Fatal(err)
	}
	if v, w := value(t, cli, k.Pin()), value(t, cli, k.TopicPin("audit")); v != "" || w != "" {
		t.Errorf("pins left after Unpin and UnpinTopic: %q, %q", v, w)
	}
}

// A staged move is checked as the leader checks it: a plan the leader
// would refuse is refused here and nothing is written.
func TestOperatorRefusesABadStagedMove(t *testing.T) {
	t.Parallel()
	op, cli := operatorOn(t)
	ctx := t.Context()
	k := op.Keys()
	if err := op.MoveInStages(ctx, state.StagePlan{To: "B", Check: time.Minute}); err == nil {
		t.Fatal("a staged move without stages was accepted")
	}
	if v := value(t, cli, k.Stages()); v != "" {
		t.Fatalf("a refused plan was written: %q", v)
	}
	plan := state.StagePlan{To: "B", Check: 30 * time.Second, Stages: []state.Stage{{Topics: []string{"audit"}}, {Topics: []string{"orders", "payments"}}}}
	if err := op.MoveInStages(ctx, plan); err != nil {
		t.Fatal(err)
	}
	got, err := state.ParseStagePlan([]byte(value(t, cli, k.Stages())), nil)
	if err != nil {
		t.Fatalf("the plan written does not parse: %v", err)
	}
	if got.To != "B" || len(got.Stages) != 2 || got.Stages[1].Topics[1] != "payments" {
		t.Errorf("plan read back %+v, want %+v", got, plan)
	}
	if err := op.EndStagedMove(ctx); err != nil {
		t.Fatal(err)
	}
	if v := value(t, cli, k.Stages()); v != "" {
		t.Errorf("control/stages = %q after EndStagedMove", v)
	}
}

// Pause and Resume write the signal values the agents obey, and Signals
// reads them back as the agents do.
func TestOperatorPausesAndResumes(t *testing.T) {
	t.Parallel()
	op, _ := operatorOn(t)
	ctx := t.Context()
	topic := signals.Scope{Kind: signals.Topic, Name: "payments"}
	if err := op.Pause(ctx, topic, "bad batch upstream"); err != nil {
		t.Fatal(err)
	}
	s, err := op.Signals(ctx)
	if err != nil {
		t.Fatal(err)
	}
	paused := func(s signals.State, topic string) bool { p, _ := s.Paused(topic, "agent-1"); return p }
	if !paused(s, "payments") || paused(s, "orders") {
		t.Fatalf("after Pause(topic payments): payments paused %v, orders paused %v", paused(s, "payments"), paused(s, "orders"))
	}
	if err := op.Resume(ctx, topic, "fixed"); err != nil {
		t.Fatal(err)
	}
	if s, err = op.Signals(ctx); err != nil || paused(s, "payments") {
		t.Fatalf("after Resume: payments paused %v (%v)", paused(s, "payments"), err)
	}
	if err := op.Pause(ctx, signals.Scope{Kind: signals.Topic}, ""); err == nil {
		t.Error("a topic pause without a topic was accepted")
	}
}

// Active and Switches read what the leader wrote; a value nobody can read
// is reported with its key, not fatal to the others.
func TestOperatorReadsActiveAndSwitches(t *testing.T) {
	t.Parallel()
	op, cli := operatorOn(t)
	ctx := t.Context()
	k := op.Keys()
	if _, ok, err := op.Active(ctx); err != nil || ok {
		t.Fatalf("Active on an empty fleet: ok %v, %v", ok, err)
	}
	put := func(key string, v any) {
		t.Helper()
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Put(ctx, key, string(b)); err != nil {
			t.Fatal(err)
		}
	}
	put(k.Active(), state.Active{Cluster: "B", Epoch: 2, Phase: state.PhaseActive, From: "A", Reason: "pinned"})
	a, ok, err := op.Active(ctx)
	if err != nil || !ok || a.Cluster != "B" || a.Epoch != 2 {
		t.Fatalf("Active = %+v, %v, %v; want cluster B, epoch 2", a, ok, err)
	}
	now := time.Now().UTC()
	put(k.HistoryEvent(1), state.SwitchEvent{Epoch: 1, From: "A", To: "B", Reason: "A down", Started: now, Finished: now})
	put(k.HistoryEvent(2), state.SwitchEvent{Epoch: 2, From: "B", To: "A", Reason: "failback", Started: now, Finished: now})
	if _, err := cli.Put(ctx, k.HistoryEvent(3), "not json"); err != nil {
		t.Fatal(err)
	}
	evs, bad, err := op.Switches(ctx, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 2 || evs[0].Epoch != 2 || evs[1].Epoch != 1 {
		t.Errorf("Switches = %+v, want epochs 2 then 1", evs)
	}
	if len(bad) != 1 || !strings.Contains(bad[0].Error(), k.HistoryEvent(3)) {
		t.Errorf("refused values %v, want one naming %s", bad, k.HistoryEvent(3))
	}
}

func TestNewOperatorRefusesABadName(t *testing.T) {
	t.Parallel()
	cli := testenv.EtcdClientT(t, testenv.StartEtcdT(t))
	if _, err := fleet.NewOperator(cli, "or/ders"); err == nil {
		t.Error("a fleet name with a slash was accepted")
	}
	if _, err := fleet.NewOperator(nil, "orders"); err == nil {
		t.Error("an operator without etcd was accepted")
	}
}

// Routes are checked as every agent will check them, against the
// agents' clusters, before anything is written; a valid change is written
// whole and read back as the layer in force.
func TestOperatorAppliesOnlyValidRoutes(t *testing.T) {
	t.Parallel()
	op, cli := operatorOn(t)
	ctx := t.Context()
	k := op.Keys()
	cfg := config.Default()
	cfg.Fleet = "orders"
	cfg.Clusters = map[string]config.Cluster{
		"A": {Brokers: []string{"127.0.0.1:9092"}, Role: config.RolePrimary, Version: config.DefaultKafkaVersion},
		"C": {Brokers: []string{"127.0.0.1:9094"}, Role: config.RoleSink, Version: config.DefaultKafkaVersion},
	}
	if _, _, _, err := op.ApplyRoutes(ctx, cfg, fleet.RoutingChange{}); err == nil {
		t.Error("an empty change was accepted")
	}
	bad := fleet.RoutingChange{Routes: []byte("default: [far]\n"), Channels: map[string][]byte{"far": []byte("cluster: D\ntopic: far\n")}}
	if _, _, _, err := op.ApplyRoutes(ctx, cfg, bad); err == nil || !strings.Contains(err.Error(), "D") {
		t.Fatalf("a channel on a cluster the agents lack: %v, want a refusal naming D", err)
	}
	if v := value(t, cli, k.Routes()); v != "" {
		t.Fatalf("a refused change was written: routes = %q", v)
	}
	good := fleet.RoutingChange{Routes: []byte("default: [audit]\n"), Channels: map[string][]byte{"audit": []byte("cluster: C\ntopic: audit\n")}}
	v, rev, wrote, err := op.ApplyRoutes(ctx, cfg, good)
	if err != nil {
		t.Fatal(err)
	}
	if len(wrote) != 2 || !slices.Contains(v.ChannelNames(), "audit") {
		t.Errorf("wrote %v, version's channels %v", wrote, v.ChannelNames())
	}
	l, err := op.Routing(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if l.Version() != rev || string(l.Routes) != "default: [audit]\n" || string(l.Channels["audit"]) != "cluster: C\ntopic: audit\n" {
		t.Errorf("read back version %d (applied %d), routes %q, channels %q", l.Version(), rev, l.Routes, l.Channels)
	}
}

// A configuration change is checked as the leader will check it before
// it is written; AwaitConfig reports the leader's verdict, or that none
// came.
func TestOperatorAppliesConfigAndAwaitsTheVerdict(t *testing.T) {
	t.Parallel()
	op, cli := operatorOn(t)
	ctx := t.Context()
	k := op.Keys()
	if _, err := op.ApplyConfig(ctx, fleet.ConfigChange{}, fleet.ConfigCheck{}); err == nil {
		t.Error("an empty change was accepted")
	}
	bad := fleet.ConfigChange{Clusters: map[string][]byte{"C": []byte("brokerz: [127.0.0.1:9094]\nrole: sink\n")}} // a misspelt field
	if _, err := op.ApplyConfig(ctx, bad, fleet.ConfigCheck{}); err == nil || !strings.Contains(err.Error(), "nothing written") {
		t.Fatalf("a misspelt field: %v, want a refusal", err)
	}
	if v := value(t, cli, k.ConfigCluster("C")); v != "" {
		t.Fatalf("a refused change was written: %q", v)
	}
	// With an agent's file, the configuration the change makes is checked
	// whole: a second primary is refused.
	file := config.Default()
	file.Fleet = "orders"
	file.Clusters = map[string]config.Cluster{
		"A": {Brokers: []string{"127.0.0.1:9092"}, Role: config.RolePrimary, Version: config.DefaultKafkaVersion},
		"B": {Brokers: []string{"127.0.0.1:9093"}, Role: config.RoleStandby, Version: config.DefaultKafkaVersion},
	}
	second := fleet.ConfigChange{Clusters: map[string][]byte{"C": []byte("brokers: [127.0.0.1:9094]\nrole: primary\n")}}
	if _, err := op.ApplyConfig(ctx, second, fleet.ConfigCheck{File: &file}); err == nil || !strings.Contains(err.Error(), "primary") {
		t.Fatalf("a second primary: %v, want a refusal naming the primary", err)
	}
	good := fleet.ConfigChange{Clusters: map[string][]byte{"C": []byte("brokers: [127.0.0.1:9094]\nrole: sink\n")}}
	rev, err := op.ApplyConfig(ctx, good, fleet.ConfigCheck{})
	if err != nil {
		t.Fatal(err)
	}
	if v := value(t, cli, k.ConfigCluster("C")); !strings.Contains(v, "127.0.0.1:9094") {
		t.Fatalf("%s = %q after ApplyConfig", k.ConfigCluster("C"), v)
	}
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if _, _, err := op.AwaitConfig(short, rev); !errors.Is(err, fleet.ErrNoConfigVerdict) {
		t.Fatalf("AwaitConfig without a leader: %v, want ErrNoConfigVerdict", err)
	}
	// The leader's verdict, as it writes it: accepted as version 1.
	b, err := json.Marshal(state.ConfigVersion{Number: 1, Revision: rev, Changed: []string{"clusters/C"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, k.StateConfig(), string(b)); err != nil {
		t.Fatal(err)
	}
	n, changed, err := op.AwaitConfig(ctx, rev)
	if err != nil || n != 1 || len(changed) != 1 || changed[0] != "clusters/C" {
		t.Errorf("AwaitConfig = %d %v %v, want version 1 changing clusters/C", n, changed, err)
	}
}

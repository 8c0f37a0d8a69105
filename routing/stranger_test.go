package routing_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/routing"
)

// TestStrangerWritesGarbage has a stranger with access to the fleet's
// etcd prefix write malformed and oversized values to every kind of key
// an agent reads, while an agent relays records (as the leader, the
// consumer and the routing sink). The agent keeps running and ready, the
// state in force stays (not paused, no pin, the same routing version,
// records keep arriving), and kswitch_refused_values_total counts each
// kind.
func TestStrangerWritesGarbage(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	src := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": relayPartitions}})
	dst := testenv.StartKafkaT(t, "D", devstack.KafkaOptions{Topics: map[string]int32{"out": relayPartitions}})
	cli := testenv.EtcdClientT(t, e)
	cfg := relayConfig(e, src, dst)
	cfg.Fleet, cfg.Agent.ID, cfg.Source.Group = "stranger", "agent-1", "stranger"
	cfg.Routing = config.Routing{
		Rules:    []config.RoutingRule{{Name: "orders", Match: `topic == "orders"`, Channels: []string{"out"}}},
		Channels: map[string]config.RoutingChannel{"out": {Cluster: "D", Topic: "out"}},
	}
	k := keys.New(cfg.Fleet)
	put := func(key, value string) {
		t.Helper()
		if _, err := cli.Put(t.Context(), key, value); err != nil {
			t.Fatal(err)
		}
	}
	// Read when the agent starts: the history that restores the leader's
	// breaker, and a partition's committed offset.
	put(k.HistoryEvent(1), `{"epoch": "one"`)
	put(k.Offset("A", "orders", 0), `{"offset": -7}`)

	m := startRelay(t, cfg, zaptest.NewLogger(t))
	t.Cleanup(func() { stopRelay(t, m) })
	a, r := m.Agent(), m.Router()
	hwm := newHighWater(t, cfg.Clusters["D"])
	arrived := func(n int64) {
		t.Helper()
		wait.For(t, 30*time.Second, fmt.Sprintf("%d records relayed to D", n), func() error {
			got, err := hwm.records("out")
			if err == nil && got < n {
				err = fmt.Errorf("%d records on D", got)
			}
			return err
		})
	}
	preProduce(t, src, "orders", 100)
	arrived(100)
	version := r.Version().Number

	big := strings.Repeat("x", routing.MaxValueSize+100) // over every limit, under etcd's request limit
	for _, kv := range []struct{ key, value string }{
		{k.FleetSignal(), "pause please"},
		{k.TopicSignal("orders"), "pause # " + big},
		{k.Pin(), "Z"},
		{k.Pin(), "A" + strings.Repeat(" ", 4<<10)},
		{k.Assignment(), `{"generation": 99, "owned": {"agent-1": [{"topic": "orders", "partition": 0}], "x": [{"topic": "orders", "partition": 0}]}}`},
		{k.Agent("intruder"), "\x00\x01 not json"},
		{k.Routes(), "rules: [{name: all, channels: [nowhere]"},
		{k.Channel("x"), "cluster: Z\ntopic: t\n"},
		{k.Channel("y"), big},
		{k.Active(), "{]"},
	} {
		put(kv.key, kv.value)
	}

	want := map[string]float64{
		refused.Signal: 2, refused.Pin: 2, refused.Assignment: 1, refused.Registration: 1,
		refused.Routes: 1, refused.Channel: 1, refused.History: 1, refused.Offset: 1,
	}
	wait.For(t, 30*time.Second, "every kind of refused value counted", func() error {
		got, err := refusedCounts(a)
		if err != nil {
			return err
		}
		for kind, n := range want {
			if got[kind] < n {
				return fmt.Errorf("counted %v, want at least %v", got, want)
			}
		}
		return nil
	})

	// The state in force stayed: records flow (not paused, routed by the
	// same version), the agent is ready and leads.
	preProduce(t, src, "orders", 100)
	arrived(200)
	if v := r.Version().Number; v != version {
		t.Errorf("routing version %d in force, want %d", v, version)
	}
	if ref := r.Status().LastRefusal; ref == nil || !ref.Current {
		t.Errorf("the refused routing version is not shown: %+v", ref)
	}
	if ok, why := a.Ready(); !ok || !a.Leading() {
		t.Errorf("agent ready %v (%s), leading %v", ok, why, a.Leading())
	}
	if st := a.Status(); len(st.Signals.Refusals()) != 2 {
		t.Errorf("signal refusals on /status: %+v", st.Signals.Refusals())
	}
}

// refusedCounts returns kswitch_refused_values_total by kind, from the
// agent's registry (its /metrics).
func refusedCounts(a *agent.Agent) (map[string]float64, error) {
	mfs, err := a.Metrics().Gather()
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != refused.Name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "kind" {
					out[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	return out, nil
}

package agent

import (
	"encoding/json"
	"math"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/coordinator"
	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// TestMemberViews: the leader counts the views of registered agents
// gossiping from their registered address, with a failure no longer than
// the agent has run; each value refused is counted once.
func TestMemberViews(t *testing.T) {
	t.Parallel()
	now := time.Now()
	a := &Agent{log: zap.NewNop(), metrics: newMetrics(prometheus.NewRegistry()),
		registry: newRegistry(nil, keys.New("orders"), time.Second, zap.NewNop(), nil),
		gossip:   &gossipState{dead: make(chan string, 1), dropped: func() {}}}
	for _, r := range []state.Registration{
		{ID: "old", Gossip: "10.0.0.1:7946", Started: now.Add(-time.Hour)},
		{ID: "young", Gossip: "10.0.0.2:7946", Started: now.Add(-10 * time.Second)},
		{ID: "moved", Gossip: "10.0.0.3:7946", Started: now.Add(-time.Hour)},
	} {
		a.registry.regs[r.ID] = r
	}
	gossip := func(name, ip string, views map[string]coordinator.ClusterView) {
		meta, err := json.Marshal(views)
		if err != nil {
			t.Fatal(err)
		}
		a.gossip.NotifyUpdate(&memberlist.Node{Name: name, Addr: []byte{10, 0, 0, ip[len(ip)-1] - '0'}, Port: 7946, Meta: meta})
	}
	down := func(ms int64) map[string]coordinator.ClusterView {
		return map[string]coordinator.ClusterView{"A": {FailingMs: ms}, "B": {Reachable: true, LatencyMs: 2}}
	}
	gossip("old", "10.0.0.1", down(60_000))          // honest: within its hour
	gossip("young", "10.0.0.2", down(math.MaxInt64)) // longer than it has run, and past any Duration
	gossip("moved", "10.0.0.9", down(60_000))        // not from its registered address
	gossip("stranger", "10.0.0.4", down(60_000))     // not registered
	views := a.memberViews(now)
	if len(views) != 2 {
		t.Fatalf("views of %d members counted, want old and young: %v", len(views), views)
	}
	if got := views["old"]["A"].FailingMs; got != 60_000 {
		t.Errorf("old's honest fail_ms became %d", got)
	}
	if got := views["young"]["A"].FailingMs; got != 10_000 {
		t.Errorf("young's fail_ms of MaxInt64 became %d, want its 10 s run", got)
	}
	if v := views["young"]["B"]; !v.Reachable || v.LatencyMs != 2 {
		t.Errorf("young's view of B changed: %+v", v)
	}
	count := func() float64 {
		var m dto.Metric
		if err := a.metrics.badValues.WithLabelValues(refused.Gossip).Write(&m); err != nil {
			t.Fatal(err)
		}
		return m.GetCounter().GetValue()
	}
	if got := count(); got != 2 {
		t.Errorf("%v values refused, want 2 (young's claim, moved's address)", got)
	}
	a.memberViews(now.Add(time.Second))
	if got := count(); got != 2 {
		t.Errorf("%v values refused after a second turn, want the same 2", got)
	}
	gossip("young", "10.0.0.2", down(-5))
	if got := a.memberViews(now)["young"]["A"].FailingMs; got != 0 || count() != 3 {
		t.Errorf("a negative fail_ms became %d, %v refused", got, count())
	}
}

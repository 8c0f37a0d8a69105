package coordinator

import (
	"testing"
	"time"

	"github.com/kswitch/kswitch/state"
)

// TestClusterHealthInOrder: the report lists the source clusters in order
// of preference with how many live agents reach each, whether a quorum
// does, and since when (the quorum's reach, or the first agent's loss).
func TestClusterHealthInOrder(t *testing.T) {
	live := []string{"a1", "a2", "a3"}
	sources := []string{"A", "B", "D"}
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	views := func(reach map[string]int) AgentViews {
		out := AgentViews{}
		for i, a := range live {
			out[a] = map[string]ClusterView{}
			for _, c := range sources {
				v := ClusterView{Reachable: i < reach[c]}
				if !v.Reachable {
					v.FailingMs = 1000
				}
				out[a][c] = v
			}
		}
		return out
	}
	h := newHealth()
	h.observe(t0, live, views(map[string]int{"A": 3, "B": 3, "D": 3}), sources)
	now := t0.Add(10 * time.Second)
	v := views(map[string]int{"A": 0, "B": 2, "D": 3})
	h.observe(now, live, v, sources)
	got := clusterHealth(sources, live, v, h)
	want := []state.ClusterHealth{
		{Name: "A", Place: 0, Reached: 0, Agents: 3, Up: false, Since: now.Add(-time.Second), Behind: -1, Lacking: -1},
		{Name: "B", Place: 1, Reached: 2, Agents: 3, Up: true, Since: t0, Behind: -1, Lacking: -1},
		{Name: "D", Place: 2, Reached: 3, Agents: 3, Up: true, Since: t0, Behind: -1, Lacking: -1},
	}
	if len(got) != len(want) {
		t.Fatalf("clusterHealth = %+v", got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("cluster %d = %+v, want %+v", i, got[i], want[i])
		}
	}
}

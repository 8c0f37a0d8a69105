package coordinator

import (
	"strings"
	"testing"
	"time"

	"github.com/kswitch/kswitch/internal/config"
)

func TestBreaker(t *testing.T) {
	cfg := config.Default().Failover
	cfg.MaxFailedSwitches = 2
	cfg.BreakerWindow = time.Minute
	cfg.BreakerCooldown = 10 * time.Minute
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	type rec struct {
		at     time.Duration
		failed bool
		trips  bool
	}
	for _, tc := range []struct {
		name string
		recs []rec
	}{
		{"a failover and its failback are not a flap yet", []rec{{0, false, false}, {10 * time.Second, false, false}}},
		{"the third switch in the window trips", []rec{{0, false, false}, {10 * time.Second, false, false}, {20 * time.Second, false, true}}},
		{"switches outside the window are forgotten", []rec{{0, false, false}, {10 * time.Second, false, false}, {80 * time.Second, false, false}}},
		{"two failed switches trip", []rec{{0, true, false}, {time.Second, true, true}}},
		{"a failure and a flap trip", []rec{{0, false, false}, {time.Second, true, false}, {2 * time.Second, false, true}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := &breaker{cfg: cfg}
			for i, r := range tc.recs {
				now := t0.Add(r.at)
				if got := b.record(now, r.failed); got != r.trips {
					t.Fatalf("record #%d at +%v (failed=%v) tripped=%v, want %v", i, r.at, r.failed, got, r.trips)
				}
				if r.trips && (!b.open(now) || !b.openUntil.Equal(now.Add(cfg.BreakerCooldown))) {
					t.Fatalf("tripped at %v but open until %v", now, b.openUntil)
				}
			}
		})
	}
}

func TestVerdictPinAndBreaker(t *testing.T) {
	cfg := config.Default().Failover
	cfg.FailureWindow = time.Second
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	live := []string{"a1", "a2", "a3"}
	down := AgentViews{}
	for _, a := range live {
		down[a] = map[string]ClusterView{"A": {Reachable: false}, "B": {Reachable: true}}
	}
	h := newHealth()
	h.observe(now.Add(-2*time.Second), live, down, []string{"A", "B"})
	h.observe(now, live, down, []string{"A", "B"})
	onA := Active{Cluster: "A", Epoch: 1, Phase: PhaseActive}
	in := func(pin string, b *breaker) verdictInput {
		return verdictInput{now: now, active: onA, primary: "A", standby: "B", pin: pin, live: live, h: h, b: b, cfg: cfg,
			caughtUp: func() (bool, string) { return true, "" }}
	}
	closed := &breaker{cfg: cfg}
	if d, _ := verdict(in("", closed)); d.to != "B" || !d.auto {
		t.Errorf("A down for the window: %+v, want an automatic failover to B", d)
	}
	open := &breaker{cfg: cfg, openUntil: now.Add(time.Minute)}
	if d, why := verdict(in("", open)); d.to != "" || !strings.Contains(why, "circuit breaker open") {
		t.Errorf("breaker open: %+v %q, want no switch", d, why)
	}
	// An operator's pin is obeyed even while the breaker is open, and is
	// not automatic (the breaker does not count it).
	if d, _ := verdict(in("B", open)); d.to != "B" || d.auto {
		t.Errorf("pinned to B with the breaker open: %+v, want a manual switch to B", d)
	}
	if d, why := verdict(in("A", closed)); d.to != "" || why != "pinned to A" {
		t.Errorf("pinned to the dead A: %+v %q, want to stay", d, why)
	}
	switching := in("", closed)
	switching.active.Phase = PhaseSwitching
	if d, why := verdict(switching); d.to != "" || why != "a switch is in progress" {
		t.Errorf("during a switch: %+v %q", d, why)
	}
}

// TestFailureWindowCountsFromTheAgentsLastContact checks that an agent's
// failure counts from its last contact with the cluster, as the duration
// it reports (FailingMs), not from the moment the leader first sees the
// failure, and that nextDown says when the next window ends.
func TestFailureWindowCountsFromTheAgentsLastContact(t *testing.T) {
	const window = 3 * time.Second
	live := []string{"a1", "a2", "a3"}
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	views := func(failing map[string]time.Duration) AgentViews {
		out := AgentViews{}
		for _, a := range live {
			v := ClusterView{Reachable: true}
			if d, ok := failing[a]; ok {
				v = ClusterView{Reachable: false, FailingMs: d.Milliseconds()}
			}
			out[a] = map[string]ClusterView{"A": v}
		}
		return out
	}
	h := newHealth()
	// a1 last reached A 1.2 s before the leader sees its failure, a2 0.4 s,
	// a3 still reaches it.
	h.observe(t0, live, views(map[string]time.Duration{"a1": 1200 * time.Millisecond, "a2": 400 * time.Millisecond}), []string{"A"})
	if d, ok := h.nextDown(t0, "A", window); !ok || d != 1800*time.Millisecond {
		t.Fatalf("next window end in %v (%v), want 1.8s (a1's)", d, ok)
	}
	// Later reports of the same failure do not move its start.
	later := t0.Add(2 * time.Second)
	h.observe(later, live, views(map[string]time.Duration{"a1": 3200 * time.Millisecond, "a2": 2400 * time.Millisecond}), []string{"A"})
	if d, ok := h.nextDown(later, "A", window); !ok || d != 600*time.Millisecond {
		t.Fatalf("next window end in %v (%v), want 0.6s (a2's)", d, ok)
	}
	if down, n := h.down(later, "A", live, window); down {
		t.Fatalf("down with %d agent(s) past the window at +2s: a quorum needs a2 too", n)
	}
	if down, n := h.down(t0.Add(2600*time.Millisecond), "A", live, window); !down || n != 2 {
		t.Fatalf("not down at +2.6s (%d past the window): a1 and a2 last reached A 3 s before", n)
	}
	// Recovery forgets the failure; a report without a duration counts
	// from when the leader sees it; a nonsense one is bounded.
	h.observe(t0.Add(3*time.Second), live, views(nil), []string{"A"})
	if _, ok := h.nextDown(t0.Add(3*time.Second), "A", window); ok {
		t.Fatal("a window pending after every agent reached A again")
	}
	at := t0.Add(4 * time.Second)
	h.observe(at, live, views(map[string]time.Duration{"a1": 0, "a2": -5 * time.Second, "a3": 1 << 62}), []string{"A"})
	if d, ok := h.nextDown(at, "A", window); !ok || d != window {
		t.Fatalf("next window end in %v (%v), want the whole window", d, ok)
	}
}

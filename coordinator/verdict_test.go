package coordinator

import (
	"strings"
	"testing"
	"time"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/state"
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
	onA := state.Active{Cluster: "A", Epoch: 1, Phase: state.PhaseActive}
	in := func(pin string, b *breaker) verdictInput {
		return verdictInput{now: now, active: onA, sources: []string{"A", "B"}, pin: pin, live: live, h: h, b: b, cfg: cfg,
			caughtUp: func(string) (bool, string) { return true, "" }}
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
	switching.active.Phase = state.PhaseSwitching
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

// TestHardFailureHasTheShortWindow: when every live agent finds every
// broker of the active cluster refusing connections, the cluster is down
// after hard_failure_window; if one agent's failure is anything else (a
// timeout), or one agent reaches it, the full failure window applies; the
// breaker still has the last word.
func TestHardFailureHasTheShortWindow(t *testing.T) {
	cfg := config.Default().Failover
	cfg.FailureWindow, cfg.HardFailureWindow = 3*time.Second, 500*time.Millisecond
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	live := []string{"a1", "a2", "a3"}
	views := func(refused ...bool) AgentViews {
		v := AgentViews{}
		for i, a := range live {
			v[a] = map[string]ClusterView{"A": {Reachable: false, Refused: refused[i], FailingMs: 0}, "B": {Reachable: true}}
		}
		return v
	}
	onA := state.Active{Cluster: "A", Epoch: 1, Phase: state.PhaseActive}
	decide := func(v AgentViews, after time.Duration, b *breaker) (decision, string) {
		h := newHealth()
		h.observe(t0, live, v, []string{"A", "B"})
		return verdict(verdictInput{now: t0.Add(after), active: onA, sources: []string{"A", "B"}, live: live, h: h, b: b, cfg: cfg,
			caughtUp: func(string) (bool, string) { return true, "" }})
	}
	closed := &breaker{cfg: cfg}
	if d, why := decide(views(true, true, true), 400*time.Millisecond, closed); d.to != "" {
		t.Errorf("refused everywhere for 400 ms: %+v %q, want no switch yet", d, why)
	}
	d, _ := decide(views(true, true, true), 500*time.Millisecond, closed)
	if d.to != "B" || !d.auto || !strings.Contains(d.reason, "every broker of A refused the connections of all 3 agents for 500ms") {
		t.Errorf("refused everywhere for 500 ms: %+v, want an automatic failover to B for a hard failure", d)
	}
	if d, why := decide(views(true, false, true), 2*time.Second, closed); d.to != "" || why != "A unreachable from a1, a2, a3: 0 of 3 agents for 3s, a failover needs 2" {
		t.Errorf("one agent's failure is not a refusal, 2 s: %+v %q, want the full window, and the verdict to say who sees A down", d, why)
	}
	if d, _ := decide(views(true, false, true), 3*time.Second, closed); d.to != "B" || !strings.Contains(d.reason, "unreachable from 3 of 3 agents for 3s") {
		t.Errorf("one agent's failure is not a refusal, 3 s: %+v, want the ordinary failover", d)
	}
	open := &breaker{cfg: cfg, openUntil: t0.Add(time.Minute)}
	if d, why := decide(views(true, true, true), time.Second, open); d.to != "" || !strings.Contains(why, "circuit breaker open") {
		t.Errorf("hard failure with the breaker open: %+v %q, want no switch", d, why)
	}
	cfg.HardFailureWindow = 0
	if d, _ := decide(views(true, true, true), 2*time.Second, &breaker{cfg: cfg}); d.to != "" {
		t.Errorf("hard_failure_window 0, refused for 2 s: %+v, want the full window", d)
	}
}

// TestVerdictAlongTheChain: with three source clusters a failover goes to
// the most preferred cluster a quorum reaches, and a failback to the most
// preferred cluster healthy for failback_stable, directly, once it has
// caught up; the fleet waits for it rather than stop between.
func TestVerdictAlongTheChain(t *testing.T) {
	cfg := config.Default().Failover
	cfg.FailureWindow, cfg.FailbackStable = time.Second, 10*time.Second
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	live := []string{"a1", "a2", "a3"}
	sources := []string{"A", "B", "D"}
	// up maps each cluster to how long a quorum has reached it; a cluster
	// not in it is unreachable (for longer than the failure window).
	verdictOn := func(on string, up map[string]time.Duration, caughtUp map[string]bool) (decision, string) {
		h := newHealth()
		for _, ago := range []time.Duration{time.Minute, 10 * time.Second, 5 * time.Second, 0} {
			views := AgentViews{}
			for _, a := range live {
				views[a] = map[string]ClusterView{}
				for _, c := range sources {
					d, reached := up[c]
					views[a][c] = ClusterView{Reachable: reached && d >= ago}
				}
			}
			h.observe(now.Add(-ago), live, views, sources)
		}
		return verdict(verdictInput{now: now, active: state.Active{Cluster: on, Epoch: 3, Phase: state.PhaseActive}, sources: sources,
			live: live, h: h, b: &breaker{cfg: cfg}, cfg: cfg,
			caughtUp: func(to string) (bool, string) { return caughtUp[to], to + " lacks a record" }})
	}
	const long, short = time.Minute, 5 * time.Second
	for _, tc := range []struct {
		name     string
		on       string
		up       map[string]time.Duration
		caughtUp map[string]bool
		to, why  string
	}{
		{name: "A fails, B is up", on: "A", up: map[string]time.Duration{"B": long, "D": long}, to: "B"},
		{name: "A and B fail", on: "A", up: map[string]time.Duration{"D": long}, to: "D"},
		{name: "B fails while the fleet is on it, A is back", on: "B", up: map[string]time.Duration{"A": long, "D": long}, to: "A"},
		{name: "B fails while the fleet is on it", on: "B", up: map[string]time.Duration{"D": long}, to: "D"},
		{name: "every cluster fails", on: "D", up: map[string]time.Duration{}, why: "D is down and none of A, B is reachable by a quorum"},
		{name: "A stable and caught up: straight back from D", on: "D", up: map[string]time.Duration{"A": long, "B": long, "D": long},
			caughtUp: map[string]bool{"A": true, "B": true}, to: "A"},
		{name: "A stable but behind: wait on D, not B", on: "D", up: map[string]time.Duration{"A": long, "B": long, "D": long},
			caughtUp: map[string]bool{"B": true}, why: "A is healthy but not caught up: A lacks a record"},
		{name: "only B stable yet", on: "D", up: map[string]time.Duration{"A": short, "B": long, "D": long},
			caughtUp: map[string]bool{"A": true, "B": true}, to: "B"},
		{name: "nothing stable yet", on: "D", up: map[string]time.Duration{"A": short, "D": long},
			why: "waiting for A to be healthy for 10s (5s so far)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, why := verdictOn(tc.on, tc.up, tc.caughtUp)
			if d.to != tc.to || (tc.to != "" && !d.auto) || (tc.why != "" && why != tc.why) {
				t.Errorf("verdict on %s = %+v, %q; want a switch to %q (%q)", tc.on, d, why, tc.to, tc.why)
			}
		})
	}
}

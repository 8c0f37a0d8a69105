package agent_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/state"
)

// A switch interrupted: a leader killed in the middle of one, and a
// switch whose target dies. Like the other failover tests
// (failover_test.go, translation_test.go, cutoff_test.go, breaker_test.go,
// pin_test.go) they share startDC's clusters: A,
// its replica B (topic A.orders, offsets shifted by TargetPrefill) and an
// embedded etcd.

// TestLeaderKilledMidSwitchIsResumedByTheNext: the leader crashes while a
// failover is in its revoke phase (the agents' sinks stall, so they cannot
// release yet). The next leader finds state/active in phase switching,
// resumes the same switch (same epoch) and completes it. Nothing mirrored
// is lost; the only records handled twice are those the dead leader had
// taken and not acknowledged.
func TestLeaderKilledMidSwitchIsResumedByTheNext(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, ho := newLedger(), newHandovers()
	gates, agents := gatedFleet(t, d, l, ho)
	p := startFlow(t, d, l, 300, agents...)
	leader := leaderOf(t, agents...)
	rest := slices.DeleteFunc(slices.Clone(agents), func(a *agent.Agent) bool { return a == leader })

	// The sinks stall: every agent holds records it cannot release.
	stallAll(t, gates)
	cfg := d.config("x")
	d.a.Fail()
	switching := waitSwitching(t, cli, cfg.Failover.FailureWindow)
	t.Logf("switch under way: %+v; killing the leader %s", switching, leader.ID())

	// The leader crashes. Its etcd client is closed first thing, so
	// nothing it does from then on lands; once its HTTP server is gone
	// too, the switch it began can no longer be completed by it.
	killed := time.Now()
	lost := abortStalledLeader(t, leader, gates)

	waitConsuming(t, cfg.Etcd.SessionTTL+cfg.Failover.FailureWindow+10*time.Second, "B", rest...)
	p.halt()
	t.Logf("the fleet consumes B %v after the leader was killed (session TTL %v)", time.Since(killed).Round(time.Millisecond), cfg.Etcd.SessionTTL)
	a, err := readActive(cli)
	if err != nil {
		t.Fatal(err)
	}
	if a.Cluster != "B" || a.Phase != state.PhaseActive || a.Epoch != switching.Epoch {
		t.Errorf("state/active %+v, want B active in the switch's epoch %d", a, switching.Epoch)
	}
	evs := readHistory(t, cli)
	logEvents(t, evs)
	if len(evs) != 1 {
		t.Fatalf("history %+v, want the one switch", evs)
	}
	ev := evs[0]
	if ev.Epoch != switching.Epoch || ev.Leader == leader.ID() || !strings.Contains(ev.Reason, "resumed by "+ev.Leader) {
		t.Errorf("history event epoch %d by %s (%q), want epoch %d resumed by a new leader", ev.Epoch, ev.Leader, ev.Reason, switching.Epoch)
	}
	// The event spans the whole switch, the leader's death included.
	if !ev.Started.Equal(switching.Since) {
		t.Errorf("history event from %s to %s, want it to start when the switch began (%s)", ev.Started, ev.Finished, switching.Since)
	}

	onB := idsOn(t, d.b, "A.orders")
	waitAllHandled(t, l, onB, 20*time.Second)
	_, dups, dupFirst := l.result(0)
	t.Logf("%d records mirrored before the failure, 0 lost, %d duplicates (first handled by %v); the killed leader held %d unacknowledged",
		len(onB), dups, dupFirst, lost)
	for id, n := range dupFirst {
		if id != leader.ID() {
			t.Errorf("%d duplicates of records first handled by %s, which was not killed", n, id)
		}
	}
	if dups > lost {
		t.Errorf("%d duplicates, more than the %d records the killed leader held", dups, lost)
	}
	ho.check(t, l)
}

// TestSwitchIsAbandonedWhenItsTargetDies: A fails, the fleet starts to
// switch to B and releases A, then B fails before the switch completes.
// The leader retries with a backoff (one failed switch for the breaker,
// however many attempts) and, once A is back while B is still down, gives
// the switch up: the fleet consumes A again instead of staying released.
func TestSwitchIsAbandonedWhenItsTargetDies(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, ho := newLedger(), newHandovers()
	gates, agents := gatedFleet(t, d, l, ho)
	waitConsuming(t, 20*time.Second, "A", agents...)
	p := startProducer(t, d.a.Brokers(), "orders", 0)
	flowing := time.Now()
	wait.For(t, 20*time.Second, "records flowing", func() error {
		if n := l.count(); n < 300 {
			return fmt.Errorf("%d handled, %d produced (%d sends failed)", n, p.next.Load(), p.failed.Load())
		}
		return nil
	})
	t.Logf("300 records handled %v after the producer started (%d produced, %d sends failed)",
		time.Since(flowing).Round(time.Millisecond), p.next.Load(), p.failed.Load())
	leader := leaderOf(t, agents...)
	// Stalled sinks hold the switch in its revoke phase until B is down.
	stallAll(t, gates)
	cfg := d.config("x")
	d.a.Fail()
	waitSwitching(t, cli, cfg.Failover.FailureWindow)
	d.b.Fail()
	t.Cleanup(d.b.Recover)
	for _, g := range gates {
		g.open()
	}
	// Both clusters down: the switch fails and is retried, and counts as
	// one failed switch for the breaker (3 would trip it).
	wait.For(t, 15*time.Second, "several failed attempts", func() error {
		if v, _ := metricValue(leader, "kswitch_switch_failures_total", nil); v < 3 {
			return fmt.Errorf("%v failed attempts", v)
		}
		return nil
	})
	wait.For(t, 2*time.Second, "the leader reporting the retries", func() error {
		st := leader.Status().Coordinator
		if st == nil || !strings.Contains(st.Verdict, "switch to B failed, retrying") {
			return fmt.Errorf("leader status %+v", st)
		}
		if !st.Breaker.IsZero() {
			t.Fatalf("leader status %+v: the breaker counted the retries of one switch as several", st)
		}
		return nil
	})
	if a, err := readActive(cli); err != nil || a.Phase != state.PhaseSwitching {
		t.Fatalf("state/active %+v (%v), want the switch still in progress", a, err)
	}

	// A comes back, B stays down: back on A.
	recovered := time.Now()
	d.a.Recover()
	waitConsuming(t, cfg.Failover.FailureWindow+10*time.Second, "A", agents...)
	t.Logf("consuming A again %v after it recovered", time.Since(recovered).Round(time.Millisecond))
	a, err := readActive(cli)
	if err != nil {
		t.Fatal(err)
	}
	if a.Cluster != "A" || a.Phase != state.PhaseActive || !strings.Contains(a.Reason, "abandoned") {
		t.Errorf("state/active %+v, want A active after an abandoned switch", a)
	}
	evs := readHistory(t, cli)
	logEvents(t, evs)
	if len(evs) != 1 || evs[0].Abandoned == "" || evs[0].To != "B" {
		t.Errorf("history %+v, want the abandoned switch to B", evs)
	} else {
		t.Logf("abandoned: %s", evs[0].Abandoned)
	}

	if dups, dupFirst := drain(t, d, l, ho, false, flow{p, "orders"}); dups != 0 {
		t.Errorf("%d duplicates (first handled by %v): every record was committed on A before the switch", dups, dupFirst)
	}
}

// gatedFleet starts three agents whose handlers record to l through a
// gate each (to stall their sinks) and ho (the hand-overs).
func gatedFleet(t *testing.T, d *dc, l *ledger, ho *handovers) (map[string]*gate, []*agent.Agent) {
	t.Helper()
	gates := map[string]*gate{}
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		g := &gate{}
		gates[id] = g
		agents = append(agents, startFleetAgent(t, d.config(id), agent.Options{Handler: ho.wrap(id, g.handler(l, id))}))
	}
	return gates, agents
}

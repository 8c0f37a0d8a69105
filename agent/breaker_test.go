package agent_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// TestFlappingPrimaryTripsTheCircuitBreaker: A fails whenever the fleet is
// on it and recovers whenever the fleet has left it, so the fleet switches
// back and forth. With failover.max_failed_switches 2 the breaker trips at
// the third automatic switch in the breaker window (the first is a
// failover, each further one a flap): automatic switching stops, the fleet
// stays where it is although A is healthy again, and the leader reports
// the breaker in /status and in kswitch_circuit_breaker_open.
func TestFlappingPrimaryTripsTheCircuitBreaker(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, ho := newLedger(), newHandovers()
	cfgOf := func(id string) config.Config {
		cfg := d.config(id)
		cfg.Failover.MaxFailedSwitches = 2
		cfg.Failover.BreakerWindow = 5 * time.Minute
		cfg.Failover.BreakerCooldown = 10 * time.Minute
		return cfg
	}
	cfg := cfgOf("x")
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		agents = append(agents, startFleetAgent(t, cfgOf(id), agent.Options{Handler: ho.wrap(id, l.handler(id))}))
	}
	waitConsuming(t, 20*time.Second, "A", agents...)
	p := startProducer(t, d.a.Brokers(), "orders", 0)
	wait.For(t, 20*time.Second, "records flowing", func() error {
		if n := l.count(); n < 300 {
			return fmt.Errorf("%d handled", n)
		}
		return nil
	})

	// Bounds on each switch generous enough for a loaded machine: this
	// test is about the breaker, not how fast a switch is (the failover
	// tests bound that).
	failover := cfg.Failover.FailureWindow + 15*time.Second
	failback := cfg.Failover.FailbackStable + 20*time.Second
	d.a.Fail()
	t.Logf("1st switch (failover) after %v", waitConsuming(t, failover, "B", agents...))
	d.a.Recover()
	t.Logf("2nd switch (failback) after %v", waitConsuming(t, failback, "A", agents...))
	d.a.Fail()
	t.Logf("3rd switch (failover) after %v", waitConsuming(t, failover, "B", agents...))
	tripped := time.Now()
	d.a.Recover()

	leader := leaderOf(t, agents...)
	wait.For(t, 5*time.Second, "the leader reports the breaker open", func() error {
		st := leader.Status().Coordinator
		if st == nil || !st.Breaker.After(time.Now().Add(cfg.Failover.BreakerCooldown/2)) {
			return fmt.Errorf("leader status %+v", st)
		}
		if v, ok := metricValue(leader, "kswitch_circuit_breaker_open", nil); !ok || v != 1 {
			return fmt.Errorf("kswitch_circuit_breaker_open = %v (found %v)", v, ok)
		}
		return nil
	})
	// A is healthy and caught up, yet no failback: the fleet settles on B.
	hold := 2*cfg.Failover.FailbackStable + 2*time.Second
	staysOn(t, cli, hold, "B", "the fleet stays on B")
	waitConsuming(t, 5*time.Second, "B", agents...)
	st := leader.Status().Coordinator
	t.Logf("settled on B for %v after the trip; leader verdict %q, breaker open until %s",
		time.Since(tripped).Round(time.Millisecond), st.Verdict, st.Breaker.Format(time.RFC3339))
	if !strings.Contains(st.Verdict, "circuit breaker open") {
		t.Errorf("leader verdict %q does not mention the breaker", st.Verdict)
	}
	var status agent.Status
	if _, err := getJSON("http://"+leader.HTTPAddr()+"/status", &status); err != nil || status.Coordinator == nil || status.Coordinator.Breaker.IsZero() {
		t.Errorf("/status of the leader: %v, coordinator %+v", err, status.Coordinator)
	}
	// The breaker outlives its leader: the next one restores it from
	// history/ and does not fail back either.
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := leader.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	rest := slices.DeleteFunc(slices.Clone(agents), func(a *agent.Agent) bool { return a == leader })
	next := leaderOf(t, rest...)
	wait.For(t, 5*time.Second, "the next leader reports the breaker open", func() error {
		if st := next.Status().Coordinator; st == nil || !st.Breaker.After(time.Now().Add(cfg.Failover.BreakerCooldown/2)) {
			return fmt.Errorf("leader status %+v", st)
		}
		if v, ok := metricValue(next, "kswitch_circuit_breaker_open", nil); !ok || v != 1 {
			return fmt.Errorf("kswitch_circuit_breaker_open = %v (found %v)", v, ok)
		}
		return nil
	})
	staysOn(t, cli, cfg.Failover.FailbackStable+2*time.Second, "B", "the fleet stays on B under the next leader")
	waitConsuming(t, 10*time.Second, "B", rest...)
	t.Logf("%s leads after %s stopped; breaker open until %s", next.ID(), leader.ID(), next.Status().Coordinator.Breaker.Format(time.RFC3339))

	evs := readHistory(t, cli)
	logEvents(t, evs)
	if len(evs) != 3 {
		t.Errorf("%d switches, want 3", len(evs))
	}
	for _, ev := range evs {
		if !ev.Automatic {
			t.Errorf("switch epoch %d (%s) not marked automatic", ev.Epoch, ev.Reason)
		}
	}

	dups, _ := drain(t, d, l, ho, true, flow{p, "orders"})
	t.Logf("%d duplicates over 3 switches", dups)
}

package agent_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// TestPinSwitchesAndHoldsUntilRemoved: a pin written with the etcd client
// (as etcdctl would) moves the fleet to B although A is healthy, holds it
// there past failback_stable, and deleting it returns to automatic
// failback. Then the same through `kswitch failover --to B` / `--auto`.
func TestPinSwitchesAndHoldsUntilRemoved(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, ho := newLedger(), newHandovers()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		agents = append(agents, startFleetAgent(t, d.config(id), agent.Options{Handler: ho.wrap(id, l.handler(id))}))
	}
	cfg := d.config("x")
	waitConsuming(t, 20*time.Second, "A", agents...)
	p := startProducer(t, d.a.Brokers(), "orders", 0)
	wait.For(t, 20*time.Second, "records flowing", func() error {
		if n := l.count(); n < 300 {
			return fmt.Errorf("%d handled", n)
		}
		return nil
	})
	leader := leaderOf(t, agents...)
	ctx := context.Background()

	// etcdctl put /kswitch/orders/control/pin B
	if _, err := cli.Put(ctx, fleetKeys.Pin(), "B"); err != nil {
		t.Fatal(err)
	}
	t.Logf("pin B: consuming B after %v", waitConsuming(t, cfg.Failover.ProbeInterval+5*time.Second, "B", agents...))
	hold := 2*cfg.Failover.FailbackStable + time.Second
	staysOn(t, cli, hold, "B", "the fleet stays on B while pinned")
	waitConsuming(t, 5*time.Second, "B", agents...)
	if st := leader.Status().Coordinator; st == nil || st.Pin != "B" || st.Verdict != "pinned to B" {
		t.Errorf("leader status %+v, want pinned to B", st)
	}
	// etcdctl del /kswitch/orders/control/pin
	if _, err := cli.Delete(ctx, fleetKeys.Pin()); err != nil {
		t.Fatal(err)
	}
	t.Logf("pin deleted: failback to A after %v", waitConsuming(t, cfg.Failover.FailbackStable+10*time.Second, "A", agents...))

	// The same through the operator's calls (kswitch failover --to B,
	// then --auto).
	op := operator(t, d.etcd)
	if err := op.Pin(ctx, "B"); err != nil {
		t.Fatal(err)
	}
	t.Logf("Pin(B): consuming B after %v", waitConsuming(t, cfg.Failover.ProbeInterval+5*time.Second, "B", agents...))
	if err := op.Unpin(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("Unpin: failback to A after %v", waitConsuming(t, cfg.Failover.FailbackStable+10*time.Second, "A", agents...))

	evs := readHistory(t, cli)
	logEvents(t, evs)
	var reasons []string
	for _, ev := range evs {
		reasons = append(reasons, fmt.Sprintf("%s→%s %s", ev.From, ev.To, strings.SplitN(ev.Reason, ":", 2)[0]))
	}
	want := []string{"A→B manual", "B→A failback", "A→B manual", "B→A failback"}
	if !slices.Equal(reasons, want) {
		t.Errorf("switches %v, want %v", reasons, want)
	}
	for _, ev := range evs {
		if ev.Automatic != strings.HasPrefix(ev.Reason, "failback") {
			t.Errorf("switch epoch %d (%s) marked automatic=%v", ev.Epoch, ev.Reason, ev.Automatic)
		}
	}

	// Planned switches wait (at most the failure window) for the replica
	// to hold what the fleet consumed; a replica later than that is
	// reported as lagged and its records delivered again, so the count is
	// logged, not bounded (TestPlannedSwitchIsMadeBeforeItIsBroken bounds
	// it with the default window).
	dups, _ := drain(t, d, l, ho, false, flow{p, "orders"})
	t.Logf("%d duplicates over 4 planned switches", dups)
}

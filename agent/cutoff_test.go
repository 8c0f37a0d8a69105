package agent_test

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/state"
)

// TestAgentCutOffFromTheActiveClusterGivesItsPartitionsAway: one agent
// loses its link to A while the others reach it. No failover: that agent
// reports itself unready, its partitions move to the others, and it gets
// some back once the link heals. Nothing is lost or handled twice.
func TestAgentCutOffFromTheActiveClusterGivesItsPartitionsAway(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, ho := newLedger(), newHandovers()
	links := map[string]*devstack.Link{}
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		link := devstack.NewLink()
		links[id] = link
		agents = append(agents, startFleetAgent(t, d.config(id), agent.WithHooks(agent.Options{
			Handler: ho.wrap(id, l.handler(id)),
		}, agent.Hooks{KafkaDialer: through(link, "A")})))
	}
	p := startFlow(t, d, l, 300, agents...)
	before, err := readActive(cli)
	if err != nil {
		t.Fatal(err)
	}

	leader := leaderOf(t, agents...)
	victim := agents[0]
	if victim == leader {
		victim = agents[1]
	}
	rest := slices.DeleteFunc(slices.Clone(agents), func(a *agent.Agent) bool { return a == victim })
	cfg := d.config("x")
	t.Logf("cutting %s (owns %v) off A; %s leads", victim.ID(), victim.Owned(), leader.ID())
	began := time.Now()
	links[victim.ID()].Cut()

	wait.For(t, cfg.Failover.ProbeInterval+cfg.Failover.ProbeTimeout+3*time.Second, victim.ID()+" unready", func() error {
		code, reason, err := readyz(victim)
		if err != nil {
			return err
		}
		if code != http.StatusServiceUnavailable || !strings.Contains(reason, "cannot reach the active cluster A") {
			return fmt.Errorf("/readyz %d %q", code, reason)
		}
		return nil
	})
	wait.For(t, cfg.Failover.FailureWindow+5*time.Second, "the others own every partition", func() error {
		o := owned(agents...)
		if o[victim.ID()] != 0 || o[rest[0].ID()]+o[rest[1].ID()] != failoverPartitions {
			return fmt.Errorf("owned %v", o)
		}
		return nil
	})
	moved := time.Since(began)
	st := leader.Status().Coordinator
	if st == nil || !slices.Contains(st.CutOff, victim.ID()) {
		t.Errorf("leader status %+v does not list %s as cut off", st, victim.ID())
	}
	// No failover, for well over the failure window.
	hold := 3*cfg.Failover.FailureWindow + time.Second
	holdsFor(t, hold, "A stays active and the victim owns nothing", func() error {
		a, err := readActive(cli)
		if err != nil {
			return err
		}
		if a.Cluster != "A" || a.Epoch != before.Epoch || a.Phase != state.PhaseActive {
			return fmt.Errorf("state/active %+v, was %+v", a, before)
		}
		if n := len(victim.Owned()); n != 0 {
			return fmt.Errorf("%s owns %d partitions", victim.ID(), n)
		}
		return nil
	})
	if evs := readHistory(t, cli); len(evs) != 0 {
		t.Fatalf("switches happened: %+v", evs)
	}
	t.Logf("%s's partitions moved %v after the cut; no switch for %v", victim.ID(), moved, hold)

	healed := time.Now()
	links[victim.ID()].Heal()
	waitBalanced(t, failoverPartitions, agents...)
	t.Logf("%s owns %v again %v after the link healed", victim.ID(), victim.Owned(), time.Since(healed))
	wait.For(t, 5*time.Second, victim.ID()+" ready", func() error {
		if code, reason, err := readyz(victim); err != nil || code != http.StatusOK {
			return fmt.Errorf("/readyz %d %q %v", code, reason, err)
		}
		return nil
	})
	// Records produced after the heal reach every agent's partitions.
	if dups, dupFirst := drain(t, d, l, ho, false, flow{p, "orders"}); dups != 0 {
		t.Errorf("%d duplicates (first handled by %v): hand-overs through etcd commits must not repeat records", dups, dupFirst)
	}
}

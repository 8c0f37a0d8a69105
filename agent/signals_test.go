package agent_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/record"
)

// deliveries counts records handed to the handlers after a point in time.
func (l *ledger) total() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, c := range l.seen {
		n += c
	}
	return n
}

func TestPauseAndStartSignals(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 4, "payments": 2}})
	l := newLedger()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2"} {
		cfg := consumeConfig(e, k, id)
		cfg.Source.Topics = []string{"orders", "payments"}
		agents = append(agents, startConsumer(t, cfg, l.handler(id)))
	}
	waitBalanced(t, 6, agents...)
	cli := testenv.EtcdClientT(t, e)
	fk := keys.New("orders")
	put := func(key, val string) int64 {
		t.Helper()
		resp, err := cli.Put(context.Background(), key, val)
		if err != nil {
			t.Fatal(err)
		}
		return resp.Header.Revision
	}

	// Fleet pause, as an operator types it: nothing is delivered while it
	// holds; records produced meanwhile wait; start delivers them.
	paused := put(fk.FleetSignal(), "pause")
	wait.For(t, 5*time.Second, "every agent paused", func() error {
		for _, a := range agents {
			if p, _ := a.Status().Signals.Paused("orders", a.ID()); !p {
				return fmt.Errorf("%s not paused", a.ID())
			}
		}
		return nil
	})
	// Each agent measures how long after it saw the key its partitions
	// stopped delivering.
	wait.For(t, 5*time.Second, "pause apply time measured", func() error {
		for _, a := range agents {
			n, sum, err := histogram(a, "kswitch_signal_apply_seconds")
			if err != nil || n == 0 {
				return fmt.Errorf("%s: %d samples, %v", a.ID(), n, err)
			}
			t.Logf("%s: pause applied in %.1f ms (mean of %d)", a.ID(), 1000*sum/float64(n), n)
		}
		return nil
	})
	// Hold: once every agent obeys the pause (each partition parked, its
	// fetching paused), records produced now are not delivered; the next
	// step, where orders moves on while payments stays paused, shows it
	// with records flowing beside them.
	waitApplied(t, paused, agents...)
	before := l.total()
	produce(t, k, "orders", 0, 200)
	produce(t, k, "payments", 200, 300)
	if n := l.total(); n != before {
		t.Fatalf("%d records delivered while the fleet was paused", n-before)
	}

	// A topic pause under a fleet start: only that topic moves on.
	paymentsPaused := put(fk.TopicSignal("payments"), "  PAUSE  ")
	put(fk.FleetSignal(), "start # maintenance over")
	wait.For(t, 10*time.Second, "orders delivered, payments held", func() error {
		if n := l.count(); n < 200 {
			return fmt.Errorf("%d handled", n)
		}
		return nil
	})
	for i := 200; i < 300; i++ {
		if l.timesHandled(fmt.Sprint(i)) != 0 {
			t.Fatalf("record %d of the paused topic was delivered", i)
		}
	}

	// A bad value is refused; the pause of payments stays in force.
	put(fk.TopicSignal("payments"), "paws")
	wait.For(t, 5*time.Second, "the refusal shows in /status", func() error {
		for _, r := range agents[0].Status().Signals.Refusals() {
			if r.Value == "paws" && strings.Contains(r.Reason, "pause") {
				return nil
			}
		}
		return fmt.Errorf("no refusal of %q in %+v", "paws", agents[0].Status().Signals.Refusals())
	})
	if p, _ := agents[0].Status().Signals.Paused("payments", "agent-1"); !p {
		t.Fatal("a refused value un-paused the topic")
	}

	// The pause holds across a rebalance: agent-2 leaves, agent-1 takes
	// its partitions of payments, paused.
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := agents[1].Stop(ctx); err != nil {
		t.Fatal(err)
	}
	waitBalanced(t, 6, agents[0])
	// ...and across a restart: an agent that starts while the topic is
	// paused delivers nothing of it.
	cfg := consumeConfig(e, k, "agent-3")
	cfg.Source.Topics = []string{"orders", "payments"}
	a3 := startConsumer(t, cfg, l.handler("agent-3"))
	waitBalanced(t, 6, agents[0], a3)
	// Both obey the pause of payments, and orders flows beside it: the
	// records of orders written now are delivered while payments' wait.
	waitApplied(t, paymentsPaused, agents[0], a3)
	produce(t, k, "orders", 300, 340)
	wait.For(t, 10*time.Second, "orders written after the restart delivered", func() error {
		for i := 300; i < 340; i++ {
			if l.timesHandled(fmt.Sprint(i)) == 0 {
				return fmt.Errorf("record %d not handled", i)
			}
		}
		return nil
	})
	for i := 200; i < 300; i++ {
		if l.timesHandled(fmt.Sprint(i)) != 0 {
			t.Fatalf("record %d of the paused topic was delivered after a rebalance", i)
		}
	}

	// Deleting the key means start.
	if _, err := cli.Delete(context.Background(), fk.TopicSignal("payments")); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 10*time.Second, "payments delivered after the pause ended", func() error {
		if n := l.count(); n < 340 {
			return fmt.Errorf("%d handled", n)
		}
		return nil
	})
	if d := l.duplicates(); d != 0 {
		t.Errorf("%d duplicates", d)
	}
	l.check(t)
}

// histogram returns the sample count and sum of an agent's histogram.
func histogram(a *agent.Agent, name string) (uint64, float64, error) {
	mfs, err := a.Metrics().Gather()
	if err != nil {
		return 0, 0, err
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) > 0 {
			h := mf.GetMetric()[0].GetHistogram()
			return h.GetSampleCount(), h.GetSampleSum(), nil
		}
	}
	return 0, 0, nil
}

// waitApplied waits until every agent obeys the signals at revision rev.
func waitApplied(t testing.TB, rev int64, agents ...*agent.Agent) {
	t.Helper()
	wait.For(t, 5*time.Second, "signal applied by every agent", func() error {
		for _, a := range agents {
			if got := a.SignalsApplied(); got < rev {
				return fmt.Errorf("%s applied revision %d < %d", a.ID(), got, rev)
			}
		}
		return nil
	})
}

// byAgent counts the deliveries of each agent.
type counting struct {
	mu sync.Mutex
	n  map[string]map[string]int // agent → topic → records
	l  *ledger
}

func (c *counting) handler(id string) record.Handler {
	inner := c.l.handler(id)
	return record.HandlerFunc(func(ctx context.Context, r *record.Record) error {
		c.mu.Lock()
		if c.n[id] == nil {
			c.n[id] = map[string]int{}
		}
		c.n[id][r.SourceTopic]++
		c.mu.Unlock()
		return inner.Handle(ctx, r)
	})
}

func (c *counting) get(id, topic string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[id][topic]
}

func TestEachScopeStopsOnlyWhatItNames(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 2, "payments": 2}})
	c := &counting{n: map[string]map[string]int{}, l: newLedger()}
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2"} {
		cfg := consumeConfig(e, k, id)
		cfg.Source.Topics = []string{"orders", "payments"}
		agents = append(agents, startConsumer(t, cfg, c.handler(id)))
	}
	waitBalanced(t, 4, agents...)
	cli := testenv.EtcdClientT(t, e)
	fk := keys.New("orders")
	put := func(key, val string) int64 {
		t.Helper()
		resp, err := cli.Put(context.Background(), key, val)
		if err != nil {
			t.Fatal(err)
		}
		return resp.Header.Revision
	}
	next := 0
	produceBoth := func(n int) {
		produce(t, k, "orders", next, next+n)
		produce(t, k, "payments", next+n, next+2*n)
		next += 2 * n
	}

	for _, sc := range []struct {
		name    string
		key     string
		paused  func(agentID, topic string) bool
		resumed string
	}{
		{"agent", fk.AgentSignal("agent-2"), func(a, _ string) bool { return a == "agent-2" }, "start"},
		{"topic", fk.TopicSignal("payments"), func(_, tp string) bool { return tp == "payments" }, ""},
		{"fleet", fk.FleetSignal(), func(string, string) bool { return true }, "start"},
	} {
		t.Run(sc.name, func(t *testing.T) {
			rev := put(sc.key, "pause")
			waitApplied(t, rev, agents...)
			before := map[string]int{}
			for _, a := range agents {
				for _, tp := range []string{"orders", "payments"} {
					before[a.ID()+tp] = c.get(a.ID(), tp)
				}
			}
			produceBoth(100)
			// What is not paused flows; wait for it to arrive, then no
			// paused scope may have received a record.
			wait.For(t, 10*time.Second, "the other scopes flow", func() error {
				for _, a := range agents {
					for _, tp := range []string{"orders", "payments"} {
						if !sc.paused(a.ID(), tp) && len(ownedOf(a, tp)) > 0 && c.get(a.ID(), tp) == before[a.ID()+tp] {
							return fmt.Errorf("%s got nothing of %s", a.ID(), tp)
						}
					}
				}
				return nil
			})
			for _, a := range agents {
				for _, tp := range []string{"orders", "payments"} {
					if sc.paused(a.ID(), tp) && c.get(a.ID(), tp) != before[a.ID()+tp] {
						t.Errorf("%s handled %d records of paused %s after the pause was applied", a.ID(), c.get(a.ID(), tp)-before[a.ID()+tp], tp)
					}
				}
			}
			if sc.resumed == "" {
				if _, err := cli.Delete(context.Background(), sc.key); err != nil {
					t.Fatal(err)
				}
			} else {
				put(sc.key, sc.resumed)
			}
			wait.For(t, 10*time.Second, "everything handled after start", func() error {
				if n := c.l.count(); n < next {
					return fmt.Errorf("%d of %d handled", n, next)
				}
				return nil
			})
		})
	}
	if d := c.l.duplicates(); d != 0 {
		t.Errorf("%d duplicates", d)
	}

	// Values outside the grammar are refused; the state before them stays.
	rev := put(fk.FleetSignal(), "pause")
	waitApplied(t, rev, agents...)
	for _, bad := range []string{"stop", "PAUSED!", "{}", ""} {
		rev := put(fk.FleetSignal(), bad)
		wait.For(t, 5*time.Second, "refusal of "+bad, func() error {
			st := agents[0].Status().Signals
			if st.Revision() < rev {
				return fmt.Errorf("state at %d < %d", st.Revision(), rev)
			}
			if p, _ := st.Paused("orders", "agent-1"); !p {
				return fmt.Errorf("%q un-paused the fleet", bad)
			}
			for _, r := range st.Refusals() {
				if r.Key == fk.FleetSignal() && r.Revision == rev {
					return nil
				}
			}
			return fmt.Errorf("%q not refused: %+v", bad, st.Refusals())
		})
	}
	put(fk.FleetSignal(), "start")
	c.l.check(t)
}

func ownedOf(a *agent.Agent, topic string) []string {
	var out []string
	for _, tp := range a.Owned() {
		if tp.Topic == topic {
			out = append(out, tp.String())
		}
	}
	return out
}

func TestPauseHoldsAcrossCrashSwitchAndRestart(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	l := newLedger()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		agents = append(agents, startConsumer(t, d.config(id), l.handler(id)))
	}
	waitConsuming(t, 20*time.Second, "A", agents...)
	cli := testenv.EtcdClientT(t, d.etcd)
	resp, err := cli.Put(context.Background(), keys.New("orders").TopicSignal("orders"), "pause # hold it")
	if err != nil {
		t.Fatal(err)
	}
	waitApplied(t, resp.Header.Revision, agents...)
	produce(t, d.a, "orders", 0, 400)
	if err := d.mirror.CaughtUp(context.Background()); err != nil {
		t.Fatal(err)
	}

	// An agent crashes: its partitions move, paused.
	victim := agents[2]
	if victim.Leading() {
		victim = agents[1]
	}
	victim.Abort()
	rest := []*agent.Agent{}
	for _, a := range agents {
		if a != victim {
			rest = append(rest, a)
		}
	}
	wait.For(t, 20*time.Second, "partitions moved", func() error { _, err := activeOf(rest...); return err })
	// The fleet switches to B: the replica's partitions (A.orders) start
	// paused too, since signals name the logical topic.
	d.a.Fail()
	waitConsuming(t, 20*time.Second, "B", rest...)
	// Every agent restarts.
	var again []*agent.Agent
	for _, a := range rest {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		if err := a.Stop(ctx); err != nil {
			t.Fatal(err)
		}
		cancel()
	}
	for _, id := range []string{"agent-4", "agent-5"} {
		again = append(again, startConsumer(t, d.config(id), l.handler(id)))
	}
	waitConsuming(t, 20*time.Second, "B", again...)
	// The restarted agents obey the pause (every partition they run is
	// parked), so none of the records the replica holds was handed on.
	waitApplied(t, resp.Header.Revision, again...)
	if n := l.count(); n != 0 {
		t.Fatalf("%d records of the paused topic were delivered through a crash, a switch and restarts", n)
	}
	if _, err := cli.Delete(context.Background(), keys.New("orders").TopicSignal("orders")); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 20*time.Second, "every record delivered after start", func() error {
		if missing, _, _ := l.result(400); len(missing) > 0 {
			return fmt.Errorf("%d not handled", len(missing))
		}
		return nil
	})
	if dups := l.duplicates(); dups != 0 {
		t.Errorf("%d duplicates", dups)
	}
}

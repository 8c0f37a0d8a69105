package agent_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/internal/keys"
	"github.com/kswitch/kswitch/internal/testenv"
	"github.com/kswitch/kswitch/internal/wait"
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
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", testenv.KafkaOptions{Topics: map[string]int32{"orders": 4, "payments": 2}})
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
	put := func(key, val string) {
		t.Helper()
		if _, err := cli.Put(context.Background(), key, val); err != nil {
			t.Fatal(err)
		}
	}

	// Fleet pause, as an operator types it: nothing is delivered while it
	// holds; records produced meanwhile wait; start delivers them.
	put(fk.FleetSignal(), "pause")
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
	before := l.total()
	produce(t, k, "orders", 0, 200)
	produce(t, k, "payments", 200, 300)
	// Hold: a paused fleet must not deliver, however long we look. This
	// is a check of absence, so it watches for a fixed window: longer
	// than two commit intervals and two fetch waits, enough for a leak
	// to show.
	time.Sleep(500 * time.Millisecond)
	if n := l.total(); n != before {
		t.Fatalf("%d records delivered while the fleet was paused", n-before)
	}

	// A topic pause under a fleet start: only that topic moves on.
	put(fk.TopicSignal("payments"), "  PAUSE  ")
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
	time.Sleep(300 * time.Millisecond) // absence window, as above
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
		if n := l.count(); n < 300 {
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

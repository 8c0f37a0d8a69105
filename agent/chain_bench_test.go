package agent_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// BenchmarkChainSwitches measures the switches of two cities, three data
// centres on kfake, 3 agents consuming a steady flow: from A failing to
// every agent consuming B (failover A → B), from B failing to every agent
// consuming D (B → D: no mirror joins B and D, the records' fingerprints
// translate), and from A's return to every agent consuming A again
// (failback D → A, failback_stable included). The baseline, measured in
// the same run on clusters of its own, is the two-cluster failover A → B
// with the same settings: a hop down the chain should cost what a first
// failover costs.
func BenchmarkChainSwitches(b *testing.B) {
	const trials = 3
	var ab, bd, da, base []time.Duration
	var stable time.Duration
	b.ResetTimer()
	for range b.N {
		for range trials {
			t1, t2, t3, s := chainSwitchTimes(b)
			ab, bd, da, stable = append(ab, t1), append(bd, t2), append(da, t3), s
			base = append(base, twoClusterFailover(b))
		}
	}
	b.StopTimer()
	mAB, _ := percentiles(ab)
	mBD, _ := percentiles(bd)
	mDA, _ := percentiles(da)
	mBase, _ := percentiles(base)
	b.ReportMetric(ms(mAB), "a-b-p50-ms")
	b.ReportMetric(ms(mBD), "b-d-p50-ms")
	b.ReportMetric(ms(mDA), "d-a-p50-ms")
	b.ReportMetric(ms(mBase), "two-cluster-a-b-p50-ms")
	b.ReportMetric(float64(mBD)/float64(mBase), "b-d/two-cluster-a-b-p50")
	fmt.Printf("chain switches, median of %d trials, 3 agents: failover A→B %.0f ms, B→D %.0f ms, failback D→A %.0f ms (failback_stable %v included); two-cluster failover A→B %.0f ms; B→D / two-cluster %.2f\n",
		len(ab), ms(mAB), ms(mBD), ms(mDA), stable, ms(mBase), float64(mBD)/float64(mBase))
}

// chainSwitchTimes runs one fleet on A, B and D through A's failure, B's
// and A's return, and returns how long each switch took to show in every
// agent, and the failback_stable in force.
func chainSwitchTimes(b *testing.B) (ab, bd, da, stable time.Duration) {
	d := startThreeDC(b, false)
	agents, p := benchFleet(b, d.config, d.a.Brokers())
	defer p.halt()
	cfg := d.config("x")
	within := cfg.Failover.FailureWindow + 20*time.Second
	at := time.Now()
	d.a.Fail()
	waitConsuming(b, within, "B", agents...)
	ab = time.Since(at)
	at = time.Now()
	d.b.Fail()
	waitConsuming(b, within, "D", agents...)
	bd = time.Since(at)
	at = time.Now()
	d.a.Recover()
	waitConsuming(b, cfg.Failover.FailbackStable+within, "A", agents...)
	da = time.Since(at)
	stopAll(b, agents)
	return ab, bd, da, cfg.Failover.FailbackStable
}

// twoClusterFailover is the baseline: the failover A → B of a fleet on A
// and B alone.
func twoClusterFailover(b *testing.B) time.Duration {
	d := startDC(b)
	agents, p := benchFleet(b, d.config, d.a.Brokers())
	defer p.halt()
	cfg := d.config("x")
	at := time.Now()
	d.a.Fail()
	waitConsuming(b, cfg.Failover.FailureWindow+20*time.Second, "B", agents...)
	took := time.Since(at)
	stopAll(b, agents)
	return took
}

// benchFleet starts agent-1..3 with their configurations from config,
// waits until they consume A, and starts a producer to A (brokers) whose
// records they are handling.
func benchFleet(b *testing.B, config func(id string) config.Config, brokers []string) ([]*agent.Agent, *producer) {
	l := newLedger()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		agents = append(agents, startFleetAgent(b, config(id), agent.Options{Handler: l.handler(id), Logger: zap.NewNop()}))
	}
	waitConsuming(b, 20*time.Second, "A", agents...)
	p := startProducer(b, brokers, "orders", 0)
	waitCounted(b, l, 300, "records flowing")
	return agents, p
}

// waitCounted waits until the ledger holds n more records (what says
// which).
func waitCounted(tb testing.TB, l *ledger, n int, what string) {
	tb.Helper()
	want := l.count() + n
	wait.For(tb, 20*time.Second, what, func() error {
		if c := l.count(); c < want {
			return fmt.Errorf("%d handled, want %d", c, want)
		}
		return nil
	})
}

// stopAll stops the agents, each within 15 s: the next fleet is measured
// on an idle machine; its clusters stop when the benchmark ends.
func stopAll(tb testing.TB, agents []*agent.Agent) {
	for _, a := range agents {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		if err := a.Stop(ctx); err != nil {
			tb.Error(err)
		}
		cancel()
	}
}

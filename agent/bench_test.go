package agent_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/keys"
)

// BenchmarkPauseApply measures, over 200 pause/start flips of the fleet
// signal with 3 agents consuming, the time from the etcd write to the
// last agent having applied it (every affected partition parked, or
// running again). The baseline, measured in the same run on the same
// etcd, is a bare etcd watcher seeing the same writes: the ratio is what
// kswitch adds to etcd's own notification latency.
func BenchmarkPauseApply(b *testing.B) {
	const flips = 200
	e := testenv.StartEtcdT(b)
	k := testenv.StartKafkaT(b, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 12}})
	var agents []*agent.Agent
	l := newLedger()
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		agents = append(agents, startConsumer(b, consumeConfig(e, k, id), l.handler(id)))
	}
	waitBalanced(b, 12, agents...)
	cli := testenv.EtcdClientT(b, e)
	key := keys.New("orders").FleetSignal()

	// The baseline watcher.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	seen := make(chan int64, flips*2)
	wch := cli.Watch(ctx, key)
	go func() {
		for wr := range wch {
			for _, ev := range wr.Events {
				seen <- ev.Kv.ModRevision
			}
		}
	}()

	var apply, watch []time.Duration
	b.ResetTimer()
	for range b.N {
		apply, watch = apply[:0], watch[:0]
		for i := range flips {
			val := "pause"
			if i%2 == 1 {
				val = "start"
			}
			began := time.Now()
			resp, err := cli.Put(context.Background(), key, val)
			if err != nil {
				b.Fatal(err)
			}
			rev := resp.Header.Revision
			watched := false
			for {
				if !watched {
					select {
					case r := <-seen:
						if r >= rev {
							watch = append(watch, time.Since(began))
							watched = true
						}
					default:
					}
				}
				done := true
				for _, a := range agents {
					if a.SignalsApplied() < rev {
						done = false
					}
				}
				if done {
					apply = append(apply, time.Since(began))
					break
				}
				if time.Since(began) > 10*time.Second {
					b.Fatalf("flip %d not applied within 10s", i)
				}
				time.Sleep(100 * time.Microsecond)
			}
			for !watched {
				r := <-seen
				if r >= rev {
					watch = append(watch, time.Since(began))
					watched = true
				}
			}
		}
	}
	b.StopTimer()
	ap50, ap99 := percentiles(apply)
	wp50, wp99 := percentiles(watch)
	b.ReportMetric(ms(ap50), "apply-p50-ms")
	b.ReportMetric(ms(ap99), "apply-p99-ms")
	b.ReportMetric(ms(wp50), "etcd-watch-p50-ms")
	b.ReportMetric(ms(wp99), "etcd-watch-p99-ms")
	b.ReportMetric(float64(ap50)/float64(wp50), "apply/watch-p50")
	fmt.Printf("pause apply over %d flips, 3 agents: p50 %.2f ms, p99 %.2f ms; bare etcd watch p50 %.2f ms, p99 %.2f ms; ratio p50 %.1f\n",
		flips, ms(ap50), ms(ap99), ms(wp50), ms(wp99), float64(ap50)/float64(wp50))
}

func percentiles(d []time.Duration) (p50, p99 time.Duration) {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2], s[min(len(s)-1, len(s)*99/100)]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// BenchmarkPlannedSwitch measures the delivery gap of planned switches:
// the time from the last record the fleet's handlers got from one cluster
// to the first from the other (gapMeter), with 3 agents consuming a
// steady flow and pins moving the fleet A→B→A… six times. The baseline,
// measured in the same run on clusters of its own, is the same fleet with
// Hooks.BreakBeforeMake: no warm-up and no pre-translation, so every
// connection to the target is opened after the revoke, as in a failover.
func BenchmarkPlannedSwitch(b *testing.B) {
	const switches = 6
	var mbb, bbm []time.Duration
	var dups [2]int
	phases := [2]map[string]float64{{}, {}} // summed over the switches
	b.ResetTimer()
	for range b.N {
		bbm = append(bbm, plannedSwitchGaps(b, switches, true, &dups[0], phases[0])...)
		mbb = append(mbb, plannedSwitchGaps(b, switches, false, &dups[1], phases[1])...)
	}
	b.StopTimer()
	for i, mode := range []string{"break-before-make", "make-before-break"} {
		n := float64(len(mbb))
		fmt.Printf("planned switch phases, %s, mean of %d: prepare %.0f ms, revoke %.0f ms, translate %.0f ms (replica wait %.0f ms), activate %.0f ms\n", mode, len(mbb),
			1000*phases[i]["prepare"]/n, 1000*phases[i]["revoke"]/n, 1000*phases[i]["translate"]/n, 1000*phases[i]["replica_wait"]/n, 1000*phases[i]["activate"]/n)
	}
	m50, _ := percentiles(mbb)
	b50, _ := percentiles(bbm)
	mMax, bMax := slices.Max(mbb), slices.Max(bbm)
	b.ReportMetric(ms(m50), "gap-p50-ms")
	b.ReportMetric(ms(mMax), "gap-max-ms")
	b.ReportMetric(ms(b50), "break-before-make-gap-p50-ms")
	b.ReportMetric(ms(bMax), "break-before-make-gap-max-ms")
	b.ReportMetric(float64(b50)/float64(m50), "break-before-make/make-before-break-p50")
	b.ReportMetric(float64(dups[1]), "duplicates")
	fmt.Printf("planned switch delivery gap over %d switches, 3 agents: make-before-break p50 %.0f ms, max %.0f ms (%d duplicates); break-before-make p50 %.0f ms, max %.0f ms (%d duplicates); ratio p50 %.2f\n",
		len(mbb), ms(m50), ms(mMax), dups[1], ms(b50), ms(bMax), dups[0], float64(b50)/float64(m50))
}

// plannedSwitchGaps runs a fleet on clusters of its own through n pinned
// switches under a steady flow and returns the delivery gap of each; it
// adds the records delivered twice to dups and the switches' phase
// durations (seconds) to phases.
func plannedSwitchGaps(b *testing.B, n int, breakBeforeMake bool, dups *int, phases map[string]float64) []time.Duration {
	d := startDC(b)
	cli := testenv.EtcdClientT(b, d.etcd)
	l, gm := newLedger(), &gapMeter{}
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		agents = append(agents, startFleetAgent(b, d.config(id), agent.WithHooks(agent.Options{
			Handler: gm.wrap(l.handler(id)), Logger: zap.NewNop(),
		}, agent.Hooks{BreakBeforeMake: breakBeforeMake})))
	}
	waitConsuming(b, 20*time.Second, "A", agents...)
	waitBalanced(b, failoverPartitions, agents...)
	p := startProducer(b, d.a.Brokers(), "orders", 0)
	waitCounted(b, l, 200, "records flowing")
	var gaps []time.Duration
	for i := range n {
		to := "B"
		if i%2 == 1 {
			to = "A"
		}
		if _, err := cli.Put(context.Background(), keys.New("orders").Pin(), to); err != nil {
			b.Fatal(err)
		}
		waitConsuming(b, 20*time.Second, to, agents...)
		gaps = append(gaps, gm.waitGap(b, i+1, 10*time.Second).gap)
		waitCounted(b, l, 200, "records flowing from "+to)
	}
	p.halt()
	_, dup, _ := l.result(0)
	*dups += dup
	for _, ev := range readHistory(b, cli) {
		for k, v := range ev.Phases {
			phases[k] += v
		}
	}
	// Idle this fleet before the next one is measured; its clusters stop
	// when the benchmark ends.
	for _, a := range agents {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		if err := a.Stop(ctx); err != nil {
			b.Error(err)
		}
		cancel()
	}
	return gaps
}

// BenchmarkEtcdOutage measures the records delivered twice after a 30 s
// etcd outage, 3 agents consuming about 400 records/s with the default
// session TTL (5 s) and a commit interval of 200 ms: with the hold of
// delivery while commits fail (commitHold), and, as the baseline in the
// same run, without it (Hooks.NoCommitHold), where agents deliver until
// their sessions end.
func BenchmarkEtcdOutage(b *testing.B) {
	const down = 30 * time.Second
	conf := func(c *config.Config) { c.Etcd.SessionTTL = config.Default().Etcd.SessionTTL }
	for range b.N {
		held, _ := etcdOutage(b, down, false, conf, nil)
		base, _ := etcdOutage(b, down, true, conf, nil)
		h, n := held.duplicates(), base.duplicates()
		b.ReportMetric(float64(h), "dups-held")
		b.ReportMetric(float64(n), "dups-baseline")
		fmt.Printf("etcd outage of %v, 3 agents: %d records delivered again with the hold of delivery, %d without (%.1fx fewer)\n",
			down, h, n, float64(n)/float64(max(h, 1)))
	}
}

package agent_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/internal/keys"
	"github.com/kswitch/kswitch/internal/testenv"
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
	k := testenv.StartKafkaT(b, "A", testenv.KafkaOptions{Topics: map[string]int32{"orders": 12}})
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

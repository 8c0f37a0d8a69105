package agent_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/keys"
)

// BenchmarkDynamicSourceChange measures how long a source change written
// to etcd takes to be in force across a fleet of 3 agents: the time from
// the put of config/source to the leader accepting the version, to every
// agent applying it, and to the fleet consuming under it: every partition
// of a topic added has delivered a record (changes alternate: a topic
// added, then removed, 20 of each; a removal is in force when no agent
// owns its partitions any more). The baseline, in the same run, is a bare
// etcd watch seeing the same put.
func BenchmarkDynamicSourceChange(b *testing.B) {
	const changes = 20 // of each kind
	const parts = 2
	topics := map[string]int32{"orders": 4}
	for i := range changes {
		topics["new-"+strconv.Itoa(i)] = parts
	}
	e := testenv.StartEtcdT(b)
	k := testenv.StartKafkaT(b, "A", devstack.KafkaOptions{Topics: topics})
	for i := range changes {
		produceTagged(b, k, "new-"+strconv.Itoa(i), "n"+strconv.Itoa(i)+"-", 0, 20)
	}
	l := newLedger()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		agents = append(agents, startConsumer(b, consumeConfig(e, k, id), l.handler(id)))
	}
	waitBalanced(b, 4, agents...)
	cli := testenv.EtcdClientT(b, e)
	key := keys.New("orders").ConfigSource()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	seen := make(chan int64, 4*changes)
	wch := cli.Watch(ctx, key)
	wg.Go(func() {
		for wr := range wch {
			for _, ev := range wr.Events {
				select {
				case seen <- ev.Kv.ModRevision:
				case <-ctx.Done():
					return
				}
			}
		}
	})

	var watch, accepted, applied, consuming, removed []time.Duration
	version := int64(0)
	// await polls cond every 200 µs for up to 30 s and returns the time
	// since began at which it held.
	await := func(what string, began time.Time, cond func() bool) time.Duration {
		for !cond() {
			if time.Since(began) > 30*time.Second {
				b.Fatalf("%s: not within 30s", what)
			}
			time.Sleep(200 * time.Microsecond)
		}
		return time.Since(began)
	}
	allApplied := func(n int64) func() bool {
		return func() bool {
			for _, a := range agents {
				if a.Status().Config.Version < n {
					return false
				}
			}
			return true
		}
	}
	owns := func(topic string) bool {
		for _, a := range agents {
			for _, tp := range a.Owned() {
				if tp.Topic == topic {
					return true
				}
			}
		}
		return false
	}
	put := func(val string) time.Time {
		began := time.Now()
		resp, err := cli.Put(ctx, key, val)
		if err != nil {
			b.Fatal(err)
		}
		version++
		rev := resp.Header.Revision
		watch = append(watch, await("the watch", began, func() bool {
			for {
				select {
				case r := <-seen:
					if r >= rev {
						return true
					}
				default:
					return false
				}
			}
		}))
		return began
	}
	b.ResetTimer()
	for range b.N {
		for i := range changes {
			topic := "new-" + strconv.Itoa(i)
			began := put(fmt.Sprintf("topics: [orders, %s]\n", topic))
			n := version
			leader := agents[slices.IndexFunc(agents, func(a *agent.Agent) bool { return a.Leading() })]
			accepted = append(accepted, await("acceptance", began, func() bool { return leader.Status().Config.Version >= n }))
			applied = append(applied, await("every agent applying it", began, allApplied(n)))
			consuming = append(consuming, await("every new partition delivering", began, func() bool {
				return l.deliveredFrom(topic) == parts
			}))
			began = put("topics: [orders]\n")
			removed = append(removed, await("the topic released", began, func() bool { return !owns(topic) }))
		}
	}
	b.StopTimer()
	report := func(name string, d []time.Duration) float64 {
		p50, _ := percentiles(d)
		b.ReportMetric(ms(p50), name+"-p50-ms")
		b.ReportMetric(ms(slices.Max(d)), name+"-max-ms")
		return ms(p50)
	}
	w := report("etcd-watch", watch)
	report("accepted", accepted)
	report("applied", applied)
	c := report("consuming", consuming)
	report("released", removed)
	b.ReportMetric(c/w, "consuming/watch-p50")
	fmt.Printf("dynamic source change over %d additions and %d removals, 3 agents: accepted p50 %.1f ms, applied p50 %.1f ms (max %.1f), "+
		"consuming a new topic p50 %.1f ms (max %.1f), topic released p50 %.1f ms (max %.1f); bare etcd watch p50 %.2f ms; ratio consuming/watch %.0f\n",
		changes, changes, ms(median(accepted)), ms(median(applied)), ms(slices.Max(applied)), ms(median(consuming)), ms(slices.Max(consuming)),
		ms(median(removed)), ms(slices.Max(removed)), w, c/w)
}

func median(d []time.Duration) time.Duration {
	p50, _ := percentiles(d)
	return p50
}

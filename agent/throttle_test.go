package agent_test

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// TestDirectFetchThrottleIsCounted (F14 at the agent's level): the source
// broker answers every other fetch empty with a 100 ms throttle time. The
// agent counts the throttled time in
// kswitch_kafka_throttle_seconds_total{cluster="A",api="fetch"} (added
// from the Fetcher's Stats().Throttled on each commit tick) and the count
// grows while the agent fetches; every record is handled once, in order.
func TestDirectFetchThrottleIsCounted(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 4}})
	throttled := k.ThrottleFetches(100)
	l := &partitionLog{}
	a := startFleetAgent(t, consumeConfig(e, k, "agent-1"), agent.Options{Handler: l.handler()})
	waitBalanced(t, 4, a)
	want := produceCounted(t, k, "orders", 400)
	waitHandled(t, l, 30*time.Second, want, 0, 1, 2, 3)
	labels := map[string]string{"cluster": "A", "api": "fetch"}
	wait.For(t, 10*time.Second, "the throttled fetches counted", func() error { // on the next commit tick (200 ms)
		if v, _ := metricValue(a, "kswitch_kafka_throttle_seconds_total", labels); v < 0.1 {
			return fmt.Errorf("kswitch_kafka_throttle_seconds_total %v after %d throttled fetches", v, throttled())
		}
		return nil
	})
	first, _ := metricValue(a, "kswitch_kafka_throttle_seconds_total", labels)
	wait.For(t, 10*time.Second, "more throttled fetches counted", func() error { // the agent goes on fetching
		if v, _ := metricValue(a, "kswitch_kafka_throttle_seconds_total", labels); v < first+0.2 {
			return fmt.Errorf("kswitch_kafka_throttle_seconds_total %v, was %v", v, first)
		}
		return nil
	})
	v, _ := metricValue(a, "kswitch_kafka_throttle_seconds_total", labels)
	t.Logf("kswitch_kafka_throttle_seconds_total %.1f, then %.1f", first, v)
	t.Logf("kswitch_kafka_throttle_seconds_total %.1f after %d fetches throttled 100 ms (every other one)", v, throttled())
	if limit := float64(throttled()) * 0.1; v > limit+1e-9 {
		t.Errorf("kswitch_kafka_throttle_seconds_total %v, more than the %d throttled fetches' %v s", v, throttled(), limit)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for p := range int32(4) {
		exp := make([]int64, want[p])
		for i := range exp {
			exp[i] = int64(i)
		}
		if !slices.Equal(l.offsets[p], exp) {
			t.Errorf("partition %d: handled %d offsets, want 0..%d once each, in order", p, len(l.offsets[p]), want[p]-1)
		}
	}
}

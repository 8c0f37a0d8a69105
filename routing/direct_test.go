package routing

import (
	"errors"
	"fmt"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/record"
)

// TestClusterRedefinedDuringAnOutageKeepsSourceOrder: the definition of
// the channel's cluster changes (its client id: another producer) while
// the cluster refuses connections and records wait inside the producer.
// The retired producer never gives a record up by itself: it is closed
// (retireWait), what it did not finish is held and sent again, in source
// order, through the new producer once the cluster is back. Every record
// is acknowledged and each source partition reaches the channel in order.
func TestClusterRedefinedDuringAnOutageKeepsSourceOrder(t *testing.T) {
	t.Parallel()
	w, r, f := orderedWorld(t, nil, nil)
	c := w.kafkas["C"]
	c.Fail()
	waitFailing(t, r, "c")
	clusters := maps.Clone(w.cfg.Clusters)
	cl := clusters["C"]
	cl.ClientID = "kswitch-redefined"
	clusters["C"] = cl
	r.SetClusters(clusters)
	// The outage outlasts the retired producer: what it held comes back
	// to the router, to be sent again through the new one.
	ds := r.cur.Load().channels["c"].ds
	wait.For(t, retireWait+5*time.Second, "the retired producer's records held", func() error {
		r.mu.Lock()
		defer r.mu.Unlock()
		if n := len(ds.rec.held); n == 0 {
			return errors.New("none held")
		}
		return nil
	})
	c.Recover()
	late, counted := w.orderAfterRecovery(r, f, "redefined")
	requireCounted(t, r, late)
	requireInOrder(t, r, late)
	if late > 0 {
		t.Errorf("%d records reached the channel after a later one of their partition (%v counted by the router)", late, counted)
	}
}

// TestRepeatedEpochBumpsTellReadiness: the channel's broker answers a
// produce of a partition OUT_OF_ORDER_SEQUENCE_NUMBER, and once the
// producer has taken a new producer id, another: the producer wants a new
// id twice within seconds, and takes the second 5 s after the first (one
// bump per 5 s). Readiness says that a broker keeps losing producer state
// as soon as the second is wanted, records go on flowing in order, and
// kswitch_routing_epoch_bumps_total counts both bumps. (Both refusals at
// once could fall on batches of one round in flight, which one bump
// answers.)
func TestRepeatedEpochBumpsTellReadiness(t *testing.T) {
	t.Parallel()
	w, r, f := orderedWorld(t, nil, nil)
	refuse := func() {
		w.kafkas["C"].Cluster().Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: "c", Partitions: []int32{0},
			Err: kerr.OutOfOrderSequenceNumber, Count: 1})
	}
	refuse()
	wait.For(t, 10*time.Second, "the first bump counted", func() error { // sampled every second
		if got := metricValue(r.m.bumps.WithLabelValues("C")); got < 1 {
			return fmt.Errorf("kswitch_routing_epoch_bumps_total = %v", got)
		}
		return nil
	})
	refuse()
	wait.For(t, 30*time.Second, "readiness reports the repeated bump", func() error {
		if p := r.DeliveryProblem(time.Minute); !strings.Contains(p, "lost its sequence numbers twice") {
			return fmt.Errorf("DeliveryProblem = %q", p)
		}
		return nil
	})
	late, counted := w.orderAfterRecovery(r, f, "bumped")
	requireCounted(t, r, late)
	requireInOrder(t, r, late)
	wait.For(t, 10*time.Second, "both bumps counted", func() error { // sampled every second
		if got := metricValue(r.m.bumps.WithLabelValues("C")); got != 2 {
			return fmt.Errorf("kswitch_routing_epoch_bumps_total = %v, want 2", got)
		}
		return nil
	})
	t.Logf("late %d, counted %v; DeliveryProblem: %s", late, counted, r.DeliveryProblem(time.Minute))
}

// TestHeadersReachTheChannel: a record's headers reach its channel as
// they were consumed, in order (the producer is handed the record's own
// headers, not a copy).
func TestHeadersReachTheChannel(t *testing.T) {
	t.Parallel()
	w := newWorld(t, map[string][]string{"C": {"c"}}, "A", "C")
	w.cfg.Routing = Config{
		Rules:    []Rule{{Name: "all", Channels: []string{"c"}}},
		Channels: map[string]Channel{"c": {Cluster: "C", Topic: "c"}},
	}
	w.start(nil)
	rec := testRecord("orders", 0, 0, "")
	rec.Key = []byte("k")
	rec.Headers = []record.Header{{Key: []byte("trace"), Value: []byte("t-1")}, {Key: []byte("empty")}, {Key: []byte("trace"), Value: []byte("t-2")}}
	w.handle(rec, 10*time.Second)
	got := w.read("C", "c", 1)[0]
	var hs []string
	for _, h := range got.Headers {
		hs = append(hs, h.Key+"="+string(h.Value))
	}
	if s := strings.Join(hs, ","); s != "trace=t-1,empty=,trace=t-2" || string(got.Key) != "k" || string(got.Value) != "orders/0@0" {
		t.Errorf("channel c got key %q value %q headers %s", got.Key, got.Value, s)
	}
}

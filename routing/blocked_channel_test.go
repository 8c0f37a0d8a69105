package routing

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
)

// TestBlockedRecordStopsOnlyItsPartition: a record refused for good with
// no dead-letter channel stops its partition, not its channel: a quiet
// channel whose only produce waiting is that record is not a stalled
// destination, and once a dead-letter channel takes the record the
// channel's other partitions are not left waiting for an acknowledgement
// that never comes. Before, the loop's stall sampling saw the blocked
// produce in flight for a second without an acknowledgement and marked the
// channel failing (every record of every partition waited), and the
// failing mark was never cleared once the record went to the dead-letter
// channel instead.
func TestBlockedRecordStopsOnlyItsPartition(t *testing.T) {
	t.Parallel()
	w, r, refused := blockedWorld(t, "dead")
	waitSamples(t, r, 3)
	other := testRecord("orders", 1, 0, "")
	if err := r.Handle(t.Context(), other); err != nil {
		t.Errorf("a record of another partition, three health samples after partition 7 stopped: %v", err)
		w.handle(other, 10*time.Second)
	}
	wait.For(t, 10*time.Second, "partition 1 acknowledged", func() error {
		if !w.acks.has(other) {
			return errors.New("not yet")
		}
		return nil
	})

	rev := w.put(keys.New(fleet).Routes(), "rules: [{name: same, channels: [same]}]\ndead_letter: dead\n")
	w.waitVersion(rev)
	wait.For(t, 10*time.Second, "refused record dead-lettered and acknowledged", func() error {
		if !w.acks.has(refused) {
			return errors.New("not yet")
		}
		return nil
	})
	waitSamples(t, r, 3)
	later := testRecord("orders", 1, 1, "")
	if err := r.Handle(t.Context(), later); err != nil {
		t.Errorf("a record of partition 1 after the refused record went to the dead-letter channel: %v", err)
	}
	if p := r.DeliveryProblem(time.Second); p != "" {
		t.Errorf("DeliveryProblem = %q with nothing waiting", p)
	}
}

// waitSamples returns once r's loop has sampled its destinations' health
// n more times (every second): what sampling would do has been done.
func waitSamples(t *testing.T, r *Router, n int64) {
	t.Helper()
	want := r.samples.Load() + n
	wait.For(t, time.Duration(n)*time.Second+10*time.Second, "the router's health samples", func() error {
		if got := r.samples.Load(); got < want {
			return fmt.Errorf("%d of %d", got, want)
		}
		return nil
	})
}

// TestStallMarkClearedWhenNothingIsLeftInside: a destination marked
// failing by the stall sampling (nothing held) whose produces are settled
// without an acknowledgement, or acknowledged just as the mark was set
// (produced reads failing before sampleHealth sets it), is not left
// failing for good: nothing would ever end it, and every record of the
// channel would wait.
func TestStallMarkClearedWhenNothingIsLeftInside(t *testing.T) {
	t.Parallel()
	cfg := config.Default()
	cfg.Clusters = map[string]config.Cluster{
		"A": {Brokers: []string{"127.0.0.1:1"}, Role: config.RolePrimary, Version: config.DefaultKafkaVersion},
		"B": {Brokers: []string{"127.0.0.1:1"}, Role: config.RoleSink, Version: config.DefaultKafkaVersion},
	}
	cfg.Routing = Config{
		Rules:    []Rule{{Name: "all", Channels: []string{"b"}}},
		Channels: map[string]Channel{"b": {Cluster: "B", Topic: "b"}},
	}
	r, err := New(cfg, nil, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	ds := r.Version().channels["b"].ds
	t0 := time.Now()
	ds.inFlight.Add(1) // a produce inside the producer, not acknowledged
	r.sampleHealth(t0)
	r.sampleHealth(t0.Add(1100 * time.Millisecond))
	if ds.failing.Load() == nil {
		t.Fatal("not failing after a second without an acknowledgement while a produce waits")
	}
	ds.inFlight.Add(-1) // settled without an acknowledgement
	r.sampleHealth(t0.Add(2200 * time.Millisecond))
	if f := ds.failing.Load(); f != nil {
		t.Errorf("still failing with nothing inside its producer: %v", f.err)
	}
}

// TestReleaseForgetsABlockedRecord: a partition stopped at a record refused
// for good, then released by its agent (Router.Release), is no longer
// stopped here: the record waited in the loop's queue, not among the held
// produces Release dropped, so it was sent again forever for a partition
// another agent now owns, readiness kept naming the partition, and Close
// counted it unacknowledged.
func TestReleaseForgetsABlockedRecord(t *testing.T) {
	t.Parallel()
	w, r, refused := blockedWorld(t)
	r.Release(refused.Owned())
	if p := r.DeliveryProblem(time.Nanosecond); p != "" {
		t.Errorf("DeliveryProblem = %q once the partition was released", p)
	}
	if n := r.inFlight(); n != 0 {
		t.Errorf("%d produces in flight once the partition was released", n)
	}
	if w.acks.has(refused) {
		t.Error("the refused record was acknowledged")
	}
}

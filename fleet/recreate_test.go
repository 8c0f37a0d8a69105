package fleet

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// produceTagged writes records tag+i, i in [0, n), keyed by i, to A's
// orders.
func (w *world) produceTagged(t *testing.T, tag string, n int) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(w.a.Brokers()...), kgo.DefaultProduceTopic("orders"))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var recs []*kgo.Record
	for i := range n {
		recs = append(recs, &kgo.Record{Key: []byte(strconv.Itoa(i)), Value: []byte(tag + strconv.Itoa(i))})
	}
	if err := cl.ProduceSync(t.Context(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// readCommitted returns how many times each value is in C's delivered, as
// a read_committed consumer sees it.
func (w *world) readCommitted(t *testing.T) map[string]int {
	t.Helper()
	sc, err := kafka.Config(w.cfg.Clusters["C"])
	if err != nil {
		t.Fatal(err)
	}
	c, err := sarama.NewClient(w.c.Brokers(), sc)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	out := map[string]int{}
	for p := range int32(partitions) {
		err := kafka.ReadAll(t.Context(), c, "delivered", p, func(r kafka.Record) bool {
			out[string(r.Value)]++
			return true
		})
		if err != nil {
			t.Fatalf("read C's delivered/%d: %v", p, err)
		}
	}
	return out
}

// tally counts the values tag+[0, n) in got: missing, and delivered more
// than once.
func tally(got map[string]int, tag string, n int) (missing, twice int) {
	for i := range n {
		switch c := got[tag+strconv.Itoa(i)]; {
		case c == 0:
			missing++
		case c > 1:
			twice++
		}
	}
	return missing, twice
}

// recreateOrders deletes A's orders and creates it again (a new topic id,
// offsets from 0).
func (w *world) recreateOrders(t *testing.T) {
	t.Helper()
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	admin, err := sarama.NewClusterAdmin(w.a.Brokers(), sc)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	if err := admin.DeleteTopic("orders"); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 10*time.Second, "orders deleted", func() error {
		ts, err := admin.ListTopics()
		if err != nil {
			return err
		}
		if _, ok := ts["orders"]; ok {
			return fmt.Errorf("still listed")
		}
		return nil
	})
	if err := w.a.CreateTopic("orders", partitions); err != nil {
		t.Fatal(err)
	}
}

// TestExactlyOnceRecreatedSourceTopic: A's orders is deleted and created
// again under a member whose channel is on an exactly_once cluster. The
// new topic's offsets start at 0 again, below what the stream's
// transactional position says was delivered of the old one: each record
// of the new topic reaches C once all the same (read_committed), none
// skipped as delivered before, and none twice.
func TestExactlyOnceRecreatedSourceTopic(t *testing.T) {
	t.Parallel()
	const before, after = 900, 600
	w := newWorld(t)
	c := w.cfg.Clusters["C"]
	c.Delivery = config.ExactlyOnce
	w.cfg.Clusters["C"] = c
	w.cfg.Source.CommitInterval = 200 * time.Millisecond
	m := w.start(t)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = m.Stop(ctx)
	})

	w.produceTagged(t, "old-", before)
	wait.For(t, 30*time.Second, "the old topic's records on C", func() error {
		if missing, _ := tally(w.readCommitted(t), "old-", before); missing > 0 {
			return fmt.Errorf("%d of %d not on C", missing, before)
		}
		return nil
	})
	wait.For(t, 10*time.Second, "the old topic's positions committed", func() error {
		if n := w.committed(t); n != before {
			return fmt.Errorf("committed %d", n)
		}
		return nil
	})

	w.recreateOrders(t)
	start := time.Now()
	w.produceTagged(t, "new-", after)
	var missing, twice int
	err := wait.Until(30*time.Second, func() error {
		got := w.readCommitted(t)
		if missing, twice = tally(got, "new-", after); missing > 0 {
			return fmt.Errorf("%d of %d not on C", missing, after)
		}
		return nil
	})
	t.Logf("the new topic's %d records: %d missing, %d more than once on C after %s", after, missing, twice, time.Since(start).Round(time.Millisecond))
	if err != nil || twice > 0 {
		got := w.readCommitted(t)
		var e []string
		for i := range after {
			if v := "new-" + strconv.Itoa(i); got[v] != 1 && len(e) < 10 {
				e = append(e, fmt.Sprintf("%s %d times", v, got[v]))
			}
		}
		t.Fatalf("the re-created topic's records on C: %d of %d missing, %d more than once (e.g. %s)", missing, after, twice, strings.Join(e, ", "))
	}
	if _, twice := tally(w.readCommitted(t), "old-", before); twice > 0 {
		t.Errorf("%d of the old topic's records on C twice", twice)
	}
}

package kafka_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
)

// TestWaitStable: a record committed after another producer's transaction
// began is unseen by a read_committed reader until that transaction ends;
// WaitStable waits for it, and says which offsets it waited on when its
// context ends first.
func TestWaitStable(t *testing.T) {
	t.Parallel()
	k := testenv.StartKafkaT(t, "S", devstack.KafkaOptions{Topics: map[string]int32{"positions": 1}})
	produce := func(id string, commit bool, value string) *kgo.Client {
		t.Helper()
		cl, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers()...), kgo.TransactionalID(id))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cl.Close)
		if err := cl.BeginTransaction(); err != nil {
			t.Fatal(err)
		}
		if err := cl.ProduceSync(t.Context(), &kgo.Record{Topic: "positions", Value: []byte(value)}).FirstErr(); err != nil {
			t.Fatal(err)
		}
		if commit {
			if err := cl.EndTransaction(t.Context(), kgo.TryCommit); err != nil {
				t.Fatal(err)
			}
		}
		return cl
	}
	open := produce("open", false, "open")
	produce("committed", true, "committed")

	c, err := kafka.NewClient("S", config.Cluster{Brokers: k.Brokers(), Version: config.DefaultKafkaVersion})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	seen := func() []string {
		var vs []string
		if err := kafka.ReadAll(t.Context(), c, "positions", 0, func(r kafka.Record) bool {
			vs = append(vs, string(r.Value))
			return true
		}); err != nil {
			t.Fatal(err)
		}
		return vs
	}
	if vs := seen(); len(vs) != 0 {
		t.Fatalf("read_committed before the open transaction ended: %q, want nothing (the last stable offset is the open one's)", vs)
	}

	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	err = kafka.WaitStable(ctx, c, "positions", 0)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "positions/0: a transaction open since offset 0 has not ended (the high watermark was 3)") {
		t.Fatalf("WaitStable with a transaction open: %v, want the offsets it waited on and the deadline", err)
	}

	ended := make(chan error, 1)
	go func() { ended <- kafka.WaitStable(t.Context(), c, "positions", 0) }()
	select {
	case err := <-ended:
		t.Fatalf("WaitStable returned %v with the transaction still open", err)
	case <-time.After(200 * time.Millisecond):
	}
	if err := open.EndTransaction(t.Context(), kgo.TryAbort); err != nil {
		t.Fatal(err)
	}
	if err := <-ended; err != nil {
		t.Fatal(err)
	}
	if vs := seen(); len(vs) != 1 || vs[0] != "committed" {
		t.Errorf("read_committed once stable: %q, want [committed]", vs)
	}
}

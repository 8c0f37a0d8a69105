package agent

import (
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap/zaptest"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/state"
)

// TestAsksOfAHungClusterAreGivenUp: the worker starts partitions on its
// own loop, and a cluster that hung after the agent's probe last reached
// it must not hold that loop (the next assignment, a switch away from it
// as a rule, waits behind it; a revoke meanwhile evicts the agent). The
// requests of a start (offsets of a partition without a position,
// metadata of partitions not known yet, topic ids) are given up on after
// askWithin; while one given up on still runs, the next is refused at
// once; once the cluster answers again, so do they. Without ask, the first
// ListOffsets took sarama's read timeout and a metadata refresh.
func TestAsksOfAHungClusterAreGivenUp(t *testing.T) {
	t.Parallel()
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 2}})
	c := config.Cluster{Brokers: k.Brokers(), Role: config.RolePrimary, Version: config.DefaultKafkaVersion}
	const within = 300 * time.Millisecond
	conn, err := dialKafka("A", c, "g", within, nil, kafka.FetchConfig{Budget: newByteBudget(1 << 20)})
	if err != nil {
		t.Fatal(err)
	}
	var closeOnce sync.Once
	t.Cleanup(func() { closeOnce.Do(conn.close) })
	tp := state.TopicPartition{Topic: "orders", Partition: 0}
	if _, err := conn.resolve(tp, sarama.OffsetNewest); err != nil {
		t.Fatalf("list offsets of a healthy cluster: %v", err)
	}

	k.Hang()
	began := time.Now()
	_, err = conn.resolve(tp, sarama.OffsetOldest)
	took := time.Since(began)
	if err == nil || !strings.Contains(err.Error(), "no answer within") {
		t.Fatalf("list offsets of the hung cluster = %v, want given up on", err)
	}
	if took > within+time.Second {
		t.Fatalf("the worker waited %v for the hung cluster, want about %v", took, within)
	}
	began = time.Now()
	err = conn.refresh([]string{"orders"})
	if err == nil || !strings.Contains(err.Error(), "earlier requests wait for an answer") || time.Since(began) > 100*time.Millisecond {
		t.Fatalf("metadata asked while a request given up on runs = %v after %v, want refused at once", err, time.Since(began))
	}
	if ids := conn.topicIDs(zaptest.NewLogger(t), []state.TopicPartition{tp}); ids != nil {
		t.Fatalf("topic ids of the hung cluster = %v, want none", ids)
	}

	k.Recover()
	// The swallowed request ends with its read timeout; then the
	// cluster answers again.
	wait.For(t, 30*time.Second, "list offsets of the recovered cluster", func() error {
		_, err := conn.resolve(tp, sarama.OffsetOldest)
		return err
	})
	if err := conn.refresh([]string{"orders"}); err != nil {
		t.Fatalf("metadata of the recovered cluster: %v", err)
	}

	// Closing the connection ends a request given up on at once, rather
	// than after its read timeout and retries.
	k.Hang()
	if _, err := conn.resolve(tp, sarama.OffsetNewest); err == nil {
		t.Fatal("list offsets of the hung cluster answered")
	}
	began = time.Now()
	closeOnce.Do(conn.close)
	if took := time.Since(began); took > time.Second {
		t.Errorf("closing the connection took %v with a request given up on in flight", took)
	}
}

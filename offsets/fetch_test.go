package offsets

import (
	"context"
	"errors"
	"maps"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
)

// commitAsAConsumer commits offsets to group as an assign() consumer
// does: one standalone OffsetCommit to the group's coordinator.
func commitAsAConsumer(t *testing.T, cl sarama.Client, group string, offsets map[TopicPartition]int64) {
	t.Helper()
	req := &sarama.OffsetCommitRequest{Version: 2, ConsumerGroup: group, ConsumerGroupGeneration: -1, RetentionTime: -1}
	for tp, off := range offsets {
		req.AddBlock(tp.Topic, tp.Partition, off, 0, "")
	}
	b, err := cl.Coordinator(group)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := b.CommitOffset(req)
	if err != nil {
		t.Fatal(err)
	}
	for topic, ps := range resp.Errors {
		for p, kerr := range ps {
			if kerr != sarama.ErrNoError {
				t.Fatalf("commit %s/%d: %v", topic, p, kerr)
			}
		}
	}
}

func TestKafkaMirrorFetchReadsTheGroupsOffsets(t *testing.T) {
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 4, "audit": 1}})
	cl := newSaramaClient(t, k)
	ctx := testCtx(t)
	tps := []TopicPartition{tp("orders", 0), tp("orders", 1), tp("orders", 3), tp("audit", 0), tp("orders", 0)}
	m := NewKafkaMirror(cl, "other-fleet", 5*time.Second)

	got, err := m.Fetch(ctx, tps)
	if err != nil || len(got) != 0 {
		t.Fatalf("a group that never committed: %v, %v; want no offsets and no error", got, err)
	}

	want := map[TopicPartition]int64{tp("orders", 0): 42, tp("orders", 3): 7, tp("audit", 0): 9}
	commitAsAConsumer(t, cl, "other-fleet", want)
	got, err = m.Fetch(ctx, tps)
	if err != nil || !maps.Equal(got, want) {
		t.Fatalf("Fetch = %v, %v; want %v (orders/1 has none)", got, err, want)
	}
	if got, err := m.Fetch(ctx, nil); err != nil || len(got) != 0 {
		t.Fatalf("Fetch of no partitions = %v, %v; want nothing (not the whole group)", got, err)
	}
}

func TestKafkaMirrorFetchTimesOutOnHungCluster(t *testing.T) {
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 1}})
	cl := newSaramaClient(t, k)
	m := NewKafkaMirror(cl, "g", 300*time.Millisecond)
	if _, err := m.Fetch(testCtx(t), []TopicPartition{tp("orders", 0)}); err != nil {
		t.Fatal(err)
	}
	k.Hang()
	defer k.Recover()
	start := time.Now()
	_, err := m.Fetch(testCtx(t), []TopicPartition{tp("orders", 0)})
	if took := time.Since(start); took > time.Second {
		t.Fatalf("Fetch on a hung cluster took %v, want about 300ms", took)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Fetch on a hung cluster = %v, want context.DeadlineExceeded", err)
	}
}

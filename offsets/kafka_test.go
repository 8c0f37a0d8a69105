package offsets

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testenv"
	"github.com/kswitch/kswitch/internal/wait"
)

func newSaramaClient(t *testing.T, k *devstack.Kafka) sarama.Client {
	t.Helper()
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V3_6_0_0
	cfg.ClientID = "offsets-test"
	// Bounds the sarama calls that a timed-out mirror call abandons.
	cfg.Net.ReadTimeout = 2 * time.Second
	cfg.Metadata.Retry.Max = 1
	cl, err := sarama.NewClient(k.Brokers(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}

func tp(topic string, p int32) TopicPartition {
	return TopicPartition{Topic: topic, Partition: p}
}

func TestKafkaMirrorCommitThenFetch(t *testing.T) {
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 4, "audit": 1}})
	cl := newSaramaClient(t, k)
	ctx := testCtx(t)
	const group = "kswitch-f1"
	tps := []TopicPartition{tp("orders", 0), tp("orders", 1), tp("orders", 3), tp("audit", 0)}

	// A group that never committed has no offsets (kfake: GROUP_ID_NOT_FOUND).
	got, err := FetchGroupOffsets(ctx, cl, group, tps)
	if err != nil {
		t.Fatal(err)
	}
	for _, tp := range tps {
		if got[tp] != -1 {
			t.Fatalf("offsets of a new group = %v, want all -1", got)
		}
	}

	m := NewKafkaMirror(cl, group, 5*time.Second)
	err = m.Commit(ctx, []Commit{
		{Cluster: "A", Topic: "orders", Partition: 0, Offset: 42, Fingerprints: []Fingerprint{7}},
		{Cluster: "A", Topic: "orders", Partition: 3, Offset: 0},
		{Cluster: "A", Topic: "audit", Partition: 0, Offset: 9},
	})
	if err != nil {
		t.Fatal(err)
	}
	got, err = FetchGroupOffsets(ctx, cl, group, tps)
	if err != nil {
		t.Fatal(err)
	}
	want := map[TopicPartition]int64{tp("orders", 0): 42, tp("orders", 1): -1, tp("orders", 3): 0, tp("audit", 0): 9}
	for tp, w := range want {
		if got[tp] != w {
			t.Fatalf("FetchGroupOffsets = %v, want %v", got, want)
		}
	}

	// A rewind is mirrored as given.
	if err := m.Commit(ctx, []Commit{{Cluster: "A", Topic: "orders", Partition: 0, Offset: 40}}); err != nil {
		t.Fatal(err)
	}
	got, err = FetchGroupOffsets(ctx, cl, group, tps[:1])
	if err != nil || got[tp("orders", 0)] != 40 {
		t.Fatalf("after rewind = %v, %v", got, err)
	}

	// An unknown group has none, and no error.
	got, err = FetchGroupOffsets(ctx, cl, "never-used", tps)
	if err != nil {
		t.Fatal(err)
	}
	for _, tp := range tps {
		if got[tp] != -1 {
			t.Fatalf("offsets of an unknown group = %v, want all -1", got)
		}
	}
}

func TestKafkaMirrorPartitionErrors(t *testing.T) {
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 2}})
	cl := newSaramaClient(t, k)
	ctx := testCtx(t)
	m := NewKafkaMirror(cl, "g", 5*time.Second)
	err := m.Commit(ctx, []Commit{
		{Cluster: "A", Topic: "orders", Partition: 1, Offset: 5},
		{Cluster: "A", Topic: "nosuch", Partition: 0, Offset: 5},
		{Cluster: "A", Topic: "orders", Partition: 9, Offset: 5},
	})
	t.Logf("commit with unknown partitions: %v", err)
	if err == nil {
		t.Fatal("commits for unknown partitions succeeded")
	}
	if !strings.Contains(err.Error(), "nosuch/0") || !strings.Contains(err.Error(), "orders/9") || strings.Contains(err.Error(), "orders/1:") {
		t.Fatalf("error does not name exactly the failed partitions: %v", err)
	}
	got, ferr := FetchGroupOffsets(ctx, cl, "g", []TopicPartition{tp("orders", 1)})
	if ferr != nil || got[tp("orders", 1)] != 5 {
		t.Fatalf("the good partition was not committed: %v, %v", got, ferr)
	}
}

func TestKafkaMirrorTimesOutOnHungCluster(t *testing.T) {
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 1}})
	cl := newSaramaClient(t, k)
	ctx := testCtx(t)
	m := NewKafkaMirror(cl, "g", 300*time.Millisecond)
	c := []Commit{{Cluster: "A", Topic: "orders", Partition: 0, Offset: 1}}
	if err := m.Commit(ctx, c); err != nil {
		t.Fatal(err)
	}

	k.Hang()
	start := time.Now()
	err := m.Commit(ctx, c)
	if took := time.Since(start); took > time.Second {
		t.Fatalf("Commit on a hung cluster took %v, want about 300ms", took)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Commit on a hung cluster = %v, want context.DeadlineExceeded", err)
	}
	fctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err = FetchGroupOffsets(fctx, cl, "g", []TopicPartition{tp("orders", 0)})
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("FetchGroupOffsets on a hung cluster = %v, want context.DeadlineExceeded", err)
	}

	k.Recover()
	c[0].Offset = 2
	wait.For(t, 20*time.Second, "mirror commit after recover", func() error { return m.Commit(ctx, c) })
	got, err := FetchGroupOffsets(ctx, cl, "g", []TopicPartition{tp("orders", 0)})
	if err != nil || got[tp("orders", 0)] != 2 {
		t.Fatalf("after recover = %v, %v", got, err)
	}
}

func TestCommitRequestVersion(t *testing.T) {
	commits := []Commit{{Cluster: "A", Topic: "orders", Partition: 2, Offset: 17}}
	for _, tc := range []struct {
		v    sarama.KafkaVersion
		want int16
	}{
		{sarama.V0_8_2_0, 2}, // sarama would pick v1, which Kafka 4 no longer serves
		{sarama.V0_10_2_0, 2},
		{sarama.V2_1_0_0, 6},
		{sarama.V3_6_0_0, 8},
		{sarama.V4_0_0_0, 8},
	} {
		cfg := sarama.NewConfig()
		cfg.Version = tc.v
		req := newCommitRequest(cfg, "g", commits)
		if req.Version != tc.want || req.ConsumerGroupGeneration != -1 || req.ConsumerID != "" {
			t.Errorf("%s: version %d generation %d member %q; want version %d, standalone", tc.v, req.Version, req.ConsumerGroupGeneration, req.ConsumerID, tc.want)
		}
		if req.Version < 5 && req.RetentionTime != -1 {
			t.Errorf("%s: retention %d, want -1 (broker default)", tc.v, req.RetentionTime)
		}
		if off, _, err := req.Offset("orders", 2); err != nil || off != 17 {
			t.Errorf("%s: offset %d, %v", tc.v, off, err)
		}
	}
}

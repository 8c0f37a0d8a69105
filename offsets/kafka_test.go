package offsets

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
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
	got, err := fetchGroupOffsets(ctx, cl, group, tps)
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
	got, err = fetchGroupOffsets(ctx, cl, group, tps)
	if err != nil {
		t.Fatal(err)
	}
	want := map[TopicPartition]int64{tp("orders", 0): 42, tp("orders", 1): -1, tp("orders", 3): 0, tp("audit", 0): 9}
	for tp, w := range want {
		if got[tp] != w {
			t.Fatalf("fetchGroupOffsets = %v, want %v", got, want)
		}
	}

	// A rewind is mirrored as given.
	if err := m.Commit(ctx, []Commit{{Cluster: "A", Topic: "orders", Partition: 0, Offset: 40}}); err != nil {
		t.Fatal(err)
	}
	got, err = fetchGroupOffsets(ctx, cl, group, tps[:1])
	if err != nil || got[tp("orders", 0)] != 40 {
		t.Fatalf("after rewind = %v, %v", got, err)
	}

	// An unknown group has none, and no error.
	got, err = fetchGroupOffsets(ctx, cl, "never-used", tps)
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
	got, ferr := fetchGroupOffsets(ctx, cl, "g", []TopicPartition{tp("orders", 1)})
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

	k.Recover()
	c[0].Offset = 2
	wait.For(t, 20*time.Second, "mirror commit after recover", func() error { return m.Commit(ctx, c) })
	got, err := fetchGroupOffsets(ctx, cl, "g", []TopicPartition{tp("orders", 0)})
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

// fetchGroupOffsets reads back what the mirror committed, as a tool reading
// the group would: the committed offset of each of tps for group on the
// client's cluster; -1 stands for none. A group that does not exist has
// none: real Kafka answers offset -1 for it, kfake GROUP_ID_NOT_FOUND, and
// both give -1 here. Per-partition errors are joined into the returned
// error, with the map holding what was read. A coordinator error or a broken
// connection makes it look the coordinator up again and retry once.
//
// The call is bounded by ctx, or DefaultKafkaTimeout if ctx has no deadline,
// the same way as KafkaMirror.Commit (an abandoned sarama call ends at the
// client's Net.ReadTimeout).
func fetchGroupOffsets(ctx context.Context, client sarama.Client, group string, tps []TopicPartition) (map[TopicPartition]int64, error) {
	out := make(map[TopicPartition]int64, len(tps))
	if len(tps) == 0 {
		// A fetch with no partitions would mean "all of them".
		return out, nil
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, DefaultKafkaTimeout)
		defer cancel()
	}
	partitions := make(map[string][]int32)
	for _, tp := range tps {
		if _, dup := out[tp]; dup {
			continue
		}
		out[tp] = -1
		partitions[tp.Topic] = append(partitions[tp.Topic], tp.Partition)
	}
	req := sarama.NewOffsetFetchRequest(client.Config().Version, group, partitions)

	wrap := func(err error) error {
		if ctxErr := ctx.Err(); ctxErr != nil && errors.Is(err, ctxErr) {
			return err
		}
		return fmt.Errorf("offsets: fetch offsets of group %q: %w", group, err)
	}
	var resp *sarama.OffsetFetchResponse
	var err error
	for attempt := range 2 {
		if attempt > 0 {
			if rerr := kafka.Call(ctx, func() error { return client.RefreshCoordinator(group) }); rerr != nil {
				return nil, wrap(rerr)
			}
		}
		err = kafka.Call(ctx, func() error {
			b, err := client.Coordinator(group)
			if err != nil {
				return err
			}
			resp, err = b.FetchOffset(req)
			if err != nil {
				kafka.CloseOnTransportError(b, err)
				return err
			}
			if gerr := resp.GroupError(); gerr != sarama.ErrNoError {
				return gerr
			}
			return nil
		})
		if err == nil || !kafka.RetriableError(err) || ctx.Err() != nil {
			break
		}
	}
	if errors.Is(err, sarama.ErrGroupIDNotFound) {
		return out, nil
	}
	if err != nil {
		return nil, wrap(err)
	}
	var errs []error
	for _, tp := range slices.SortedFunc(maps.Keys(out), TopicPartition.Compare) {
		b := resp.GetBlock(tp.Topic, tp.Partition)
		switch {
		case b == nil:
			// Not answered: nothing committed.
		case b.Err != sarama.ErrNoError:
			errs = append(errs, fmt.Errorf("%s: %w", tp, b.Err))
		default:
			out[tp] = b.Offset
		}
	}
	if len(errs) > 0 {
		return out, wrap(errors.Join(errs...))
	}
	return out, nil
}

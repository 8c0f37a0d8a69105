package agent_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/state"
)

// offsetLedger records the offsets handled per partition.
type offsetLedger struct {
	mu   sync.Mutex
	seen map[state.TopicPartition]map[int64]int
}

func (l *offsetLedger) handler() record.Handler {
	return record.HandlerFunc(func(_ context.Context, r *record.Record) error {
		l.mu.Lock()
		tp := state.TopicPartition{Topic: r.Topic, Partition: r.Partition}
		if l.seen[tp] == nil {
			l.seen[tp] = map[int64]int{}
		}
		l.seen[tp][r.Offset]++
		l.mu.Unlock()
		r.Ack()
		return nil
	})
}

// check compares the offsets handled with want: each partition's offsets
// [from, to), each once at least.
func (l *offsetLedger) check(want map[state.TopicPartition][2]int64) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	var errs []string
	for tp, r := range want {
		var missing, early []int64
		for off := r[0]; off < r[1]; off++ {
			if l.seen[tp][off] == 0 {
				missing = append(missing, off)
			}
		}
		for off := range l.seen[tp] {
			if off < r[0] {
				early = append(early, off)
			}
		}
		slices.Sort(early)
		if len(missing) > 0 {
			errs = append(errs, fmt.Sprintf("%s: %d of [%d, %d) not handled (first %d)", tp, len(missing), r[0], r[1], missing[0]))
		}
		if len(early) > 0 {
			errs = append(errs, fmt.Sprintf("%s: %d records before %d handled (%d..%d)", tp, len(early), r[0], early[0], early[len(early)-1]))
		}
	}
	if len(errs) > 0 {
		slices.Sort(errs)
		return fmt.Errorf("%s", strings.Join(errs, "; "))
	}
	return nil
}

// A fleet whose etcd holds no position, sharing its Kafka group with
// another fleet that consumed part of the topic (an agent started with the
// wrong fleet name), starts each partition at the group's committed
// offset: nothing before it is delivered again, nothing after it is lost.
// A group's offset past the log's end is not used: that partition starts
// at source.initial_offset, as one the group has no offset for.
func TestAFleetWithoutPositionsStartsAtTheGroupsOffsets(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 4}})
	produce(t, k, "orders", 0, 400) // round robin: offsets 0-99 on each partition
	tp := func(p int32) state.TopicPartition {
		return state.TopicPartition{Topic: "orders", Partition: p}
	}

	// The other fleet mirrored its commits to the group: orders/0 at 60,
	// orders/1 at 70, orders/3 at 1000 (past the end: a topic created again
	// shorter since); orders/2 has none.
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	client, err := sarama.NewClient(k.Brokers(), sc)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := offsets.NewKafkaMirror(client, "orders", 5*time.Second).Commit(ctx, []offsets.Commit{
		{Cluster: "A", Topic: "orders", Partition: 0, Offset: 60},
		{Cluster: "A", Topic: "orders", Partition: 1, Offset: 70},
		{Cluster: "A", Topic: "orders", Partition: 3, Offset: 1000},
	}); err != nil {
		t.Fatal(err)
	}

	core, logs := observer.New(zap.InfoLevel)
	log := zap.New(zapcore.NewTee(core, zaptest.NewLogger(t).Core()))
	l := &offsetLedger{seen: map[state.TopicPartition]map[int64]int{}}
	a := startFleetAgent(t, consumeConfig(e, k, "agent-1"), agent.Options{Handler: l.handler(), Logger: log})
	want := map[state.TopicPartition][2]int64{tp(0): {60, 100}, tp(1): {70, 100}, tp(2): {0, 100}, tp(3): {0, 100}}
	wait.For(t, 15*time.Second, "the records from the group's offsets handled", func() error { return l.check(want) })

	// What is produced after the start is handled too: 0 lost.
	produce(t, k, "orders", 400, 800)
	for p, r := range want {
		want[p] = [2]int64{r[0], 200}
	}
	wait.For(t, 15*time.Second, "the records produced later handled", func() error { return l.check(want) })
	if err := l.check(want); err != nil {
		t.Fatal(err)
	}

	// The log says where the partitions started, and why orders/3 did not
	// start at the group's offset.
	started := logs.FilterMessageSnippet("start at the group's committed offsets").All()
	if len(started) == 0 {
		t.Fatalf("no log line says that partitions started at the group's offsets")
	}
	if got := fmt.Sprint(started[0].ContextMap()["offsets"]); !strings.Contains(got, "orders/0=60") || !strings.Contains(got, "orders/1=70") ||
		strings.Contains(got, "orders/2") {
		t.Errorf("the start's log line lists %s, want orders/0=60 and orders/1=70 only", got)
	}
	outside := logs.FilterMessageSnippet("outside the partitions' logs").All()
	if len(outside) == 0 || !strings.Contains(fmt.Sprint(outside[0].ContextMap()["offsets"]), "orders/3=1000 (log 0-100)") {
		t.Errorf("no log line says that orders/3's offset 1000 lies past its log: %v", outside)
	}
	if n := len(a.Owned()); n != 4 {
		t.Errorf("agent owns %d partitions, want 4", n)
	}
}

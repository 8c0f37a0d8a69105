package agent_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// recreate deletes topic on k through a DeleteTopics request and creates
// it again with partitions partitions.
func recreate(t *testing.T, k *devstack.Kafka, topic string, partitions int32) {
	t.Helper()
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	admin, err := sarama.NewClusterAdmin(k.Brokers(), sc)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	if err := admin.DeleteTopic(topic); err != nil {
		t.Fatalf("delete %s: %v", topic, err)
	}
	wait.For(t, 10*time.Second, topic+" deleted", func() error {
		ts, err := admin.ListTopics()
		if err != nil {
			return err
		}
		if _, ok := ts[topic]; ok {
			return fmt.Errorf("%s still listed", topic)
		}
		return nil
	})
	if err := k.CreateTopic(topic, partitions); err != nil {
		t.Fatal(err)
	}
}

// handledTagged waits until every record tag+[0, n) was handled.
func handledTagged(t *testing.T, l *ledger, timeout time.Duration, tag string, n int) {
	t.Helper()
	wait.For(t, timeout, fmt.Sprintf("%s0..%d handled", tag, n-1), func() error {
		if missing, _ := l.tally(tag, n); len(missing) > 0 {
			return fmt.Errorf("%d of %d not handled, e.g. %s%d", len(missing), n, tag, missing[0])
		}
		return nil
	})
}

// topicEvents reads the fleet's history/topics/.
func topicEvents(t *testing.T, e *devstack.Etcd) []state.TopicEvent {
	t.Helper()
	cli := testenv.EtcdClientT(t, e)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	evs, bad, err := state.ReadTopicEvents(ctx, cli, keys.New("orders"), 100)
	if err != nil || len(bad) > 0 {
		t.Fatalf("history/topics/: %v %v", err, bad)
	}
	return evs
}

// A source topic deleted and created again with fewer partitions while a
// fleet consumes it and its producer goes on: every record written to the
// new topic is delivered, the leader records and counts the re-creation.
func TestRecreatedTopicIsConsumedFromItsStart(t *testing.T) {
	t.Parallel()
	const before, after = 6000, 3000
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 12}})
	l := newLedger()
	var agents []*agent.Agent
	for i := 1; i <= 3; i++ {
		id := "agent-" + strconv.Itoa(i)
		agents = append(agents, startConsumer(t, consumeConfig(e, k, id), l.handler(id)))
	}
	waitBalanced(t, 12, agents...)
	produceTagged(t, k, "orders", "old-", 0, before)
	handledTagged(t, l, 30*time.Second, "old-", before)
	// Positions committed: about 500 a partition, past the new topic's
	// end at first, inside it once the producer has written more.
	waitAllCommittedAt(t, e, 12, before)

	recreate(t, k, "orders", 10)
	produceTagged(t, k, "orders", "new-", 0, after)
	handledTagged(t, l, 30*time.Second, "new-", after)

	wait.For(t, 10*time.Second, "the re-creation in history/topics/", func() error {
		for _, ev := range topicEvents(t, e) {
			if ev.Kind == state.TopicRecreated && ev.Topic == "orders" && ev.NewPartitions == 10 {
				t.Logf("history: %s", ev)
				return nil
			}
		}
		return fmt.Errorf("none yet")
	})
	leader := leaderOf(t, agents...)
	if n, _ := metricValue(leader, "kswitch_source_topic_recreated_total", map[string]string{"cluster": "A", "topic": "orders"}); n != 1 {
		t.Errorf("kswitch_source_topic_recreated_total = %v on the leader, want 1", n)
	}
	waitBalanced(t, 10, agents...)
	l.check(t)
}

// waitAllCommittedAt waits until the positions of the n partitions of
// orders on A add up to total.
func waitAllCommittedAt(t *testing.T, e *devstack.Etcd, n int32, total int64) {
	t.Helper()
	cli := testenv.EtcdClientT(t, e)
	wait.For(t, 10*time.Second, "every position committed", func() error {
		c, err := committed(cli, "A", "orders", n)
		if err != nil {
			return err
		}
		if s := sum(c); s != total {
			return fmt.Errorf("committed %d of %d", s, total)
		}
		return nil
	})
}

// The old positions lie beyond the new topic's end and no producer writes
// meanwhile: the partition consumers end on an offset out of range, and
// consumption starts again at the new topic's start.
func TestRecreatedTopicBehindItsOldPositionsStartsAtItsStart(t *testing.T) {
	t.Parallel()
	const before, after = 2000, 100
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 2}})
	l := newLedger()
	a := startConsumer(t, consumeConfig(e, k, "agent-1"), l.handler("agent-1"))
	waitBalanced(t, 2, a)
	produceTagged(t, k, "orders", "old-", 0, before)
	handledTagged(t, l, 30*time.Second, "old-", before)
	waitAllCommittedAt(t, e, 2, before)

	recreate(t, k, "orders", 2)
	produceTagged(t, k, "orders", "new-", 0, after)
	handledTagged(t, l, 20*time.Second, "new-", after)
	cli := testenv.EtcdClientT(t, e)
	wait.For(t, 10*time.Second, "the new topic's positions committed", func() error {
		c, err := committed(cli, "A", "orders", 2)
		if err != nil {
			return err
		}
		if s := sum(c); s != after {
			return fmt.Errorf("committed %v, want %d in all", c, after)
		}
		return nil
	})
	wait.For(t, 10*time.Second, "ready", func() error {
		if code, body, err := readyz(a); err != nil || code != 200 {
			return fmt.Errorf("%d %s %v", code, body, err)
		}
		return nil
	})
}

// Partitions added to a source topic and a new topic matching the regex
// are consumed within 3 s at the default refresh interval: discovery lists
// every refresh_interval (1 s), the leader assigns them on the list, and
// the owner's start waits for one fetch (FetchConfig.MaxWait, 250 ms).
func TestNewPartitionsAreConsumedWithinThreeSeconds(t *testing.T) {
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 12}})
	l := newLedger()
	var agents []*agent.Agent
	for i := 1; i <= 3; i++ {
		id := "agent-" + strconv.Itoa(i)
		cfg := consumeConfig(e, k, id)
		cfg.Source.RefreshInterval = config.Default().Source.RefreshInterval
		cfg.Source.TopicRegex = "^orders-"
		agents = append(agents, startConsumer(t, cfg, l.handler(id)))
	}
	waitBalanced(t, 12, agents...)
	// Within 3 s (the bound docs/CONSUMING.md's topic lifecycle promises): a listing every refresh_interval (1 s by
	// default), the leader's turn and a generation, the owner's start
	// and a fetch (about 1.2 s in all measured under -race), the
	// producer's own start, and slack for -race on loaded cores.
	if d := config.Default().Source.RefreshInterval; d > time.Second {
		t.Errorf("the default refresh_interval is %v: discovery alone may take longer than the bound allows", d)
	}
	const bound = 3 * time.Second
	for _, step := range []struct {
		what string
		make func() error
		tp   state.TopicPartition
	}{
		{"orders grown to 16 partitions", func() error { return k.AddPartitions("orders", 16) }, state.TopicPartition{Topic: "orders", Partition: 15}},
		{"orders-v2 created", func() error { return k.CreateTopic("orders-v2", 4) }, state.TopicPartition{Topic: "orders-v2", Partition: 3}},
	} {
		began := time.Now()
		if err := step.make(); err != nil {
			t.Fatal(err)
		}
		// One record into each partition of the topic, written at once.
		produceTagged(t, k, step.tp.Topic, step.what+" ", 0, int(step.tp.Partition)+1)
		var took time.Duration
		wait.For(t, 3*bound, step.what+": every partition's record handled", func() error {
			if missing, _ := l.tally(step.what+" ", int(step.tp.Partition)+1); len(missing) > 0 {
				return fmt.Errorf("%d not handled", len(missing))
			}
			took = time.Since(began)
			return nil
		})
		t.Logf("%s: every record handled %v after", step.what, took.Round(time.Millisecond))
		if took > bound {
			t.Errorf("%s: records handled %v after, over the %v bound", step.what, took.Round(time.Millisecond), bound)
		}
	}
}

// A partition whose consumer ended and whose start fails (the hook holds
// it dead) makes /readyz 503 naming it and why, for as long as it does
// not run; once it starts, /readyz is 200 again and the new topic's
// records are handled.
func TestReadyNamesAPartitionWhileItsConsumerIsDead(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 2}})
	l := newLedger()
	var failing atomic.Bool
	var refused atomic.Int64
	failing.Store(true)
	hooks := agent.Hooks{RestartFails: func(cluster string, tp state.TopicPartition) error {
		if !failing.Load() {
			return nil
		}
		refused.Add(1)
		return fmt.Errorf("test: %s %s held dead", cluster, tp)
	}}
	a := startFleetAgent(t, consumeConfig(e, k, "agent-1"), agent.WithHooks(agent.Options{Handler: l.handler("agent-1")}, hooks))
	waitBalanced(t, 2, a)
	produceTagged(t, k, "orders", "old-", 0, 200)
	handledTagged(t, l, 20*time.Second, "old-", 200)
	waitAllCommittedAt(t, e, 2, 200)
	wait.For(t, 10*time.Second, "ready", func() error {
		if code, body, err := readyz(a); err != nil || code != 200 {
			return fmt.Errorf("%d %s %v", code, body, err)
		}
		return nil
	})

	// Positions past the new topic's end: both consumers end.
	recreate(t, k, "orders", 2)
	var why string
	wait.For(t, 10*time.Second, "/readyz naming both dead partitions", func() error {
		code, body, err := readyz(a)
		if err != nil || code == 200 || !strings.Contains(body, "partition consumers ended and do not run again yet") ||
			!strings.Contains(body, "A:orders/0") || !strings.Contains(body, "A:orders/1") {
			return fmt.Errorf("%d %q %v", code, body, err)
		}
		why = body
		return nil
	})
	t.Logf("/readyz: %s", why)
	// It stays so while the starts fail, not just for a tick.
	seen := refused.Load()
	wait.For(t, 10*time.Second, "starts refused again", func() error {
		if n := refused.Load(); n < seen+2 {
			return fmt.Errorf("%d starts refused, %d when first unready", n, seen)
		}
		return nil
	})
	if code, body, err := readyz(a); err != nil || code == 200 || !strings.Contains(body, "A:orders/0") {
		t.Fatalf("/readyz while both partitions are still dead: %d %q %v", code, body, err)
	}

	failing.Store(false)
	produceTagged(t, k, "orders", "new-", 0, 100)
	handledTagged(t, l, 20*time.Second, "new-", 100)
	wait.For(t, 10*time.Second, "ready again", func() error {
		if code, body, err := readyz(a); err != nil || code != 200 {
			return fmt.Errorf("%d %s %v", code, body, err)
		}
		return nil
	})
}

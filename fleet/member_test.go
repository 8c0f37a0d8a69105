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
	"go.uber.org/zap/zaptest"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/record"
)

func TestMain(m *testing.M) {
	wait.VerifyTestMain(m, testenv.LeakOptions()...)
}

const (
	fleet      = "member"
	partitions = 3
)

// world is an etcd, a source cluster A and a destination cluster C, and
// the configuration of an agent that routes every record of A's orders to
// C's delivered.
type world struct {
	etcd *devstack.Etcd
	a, c *devstack.Kafka
	cfg  config.Config
}

func newWorld(t *testing.T) *world {
	w := &world{
		etcd: testenv.StartEtcdT(t),
		a:    testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": partitions}}),
		c:    testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{"delivered": partitions}}),
	}
	cfg := config.Default()
	cfg.Fleet = fleet
	cfg.Agent.ID = "agent-1"
	cfg.Agent.HTTP = "127.0.0.1:0"
	cfg.Agent.Gossip = "127.0.0.1:0"
	cfg.Etcd.Endpoints = w.etcd.Endpoints()
	cfg.Etcd.SessionTTL = 2 * time.Second
	cfg.Etcd.RequestTimeout = time.Second
	cfg.Clusters = map[string]config.Cluster{
		"A": {Brokers: w.a.Brokers(), Role: config.RolePrimary},
		"C": {Brokers: w.c.Brokers(), Role: config.RoleSink},
	}
	cfg.Source.Topics = []string{"orders"}
	cfg.Source.Group = fleet
	// Commits only on the clean stop, not on the way: the test shows
	// that Stop commits what the router delivered.
	cfg.Source.CommitInterval = time.Hour
	cfg.Routing = config.Routing{
		Channels: map[string]config.RoutingChannel{"out": {Cluster: "C", Topic: "delivered"}},
		Default:  []string{"out"},
	}
	w.cfg = cfg
	return w
}

// produce writes records 0..n-1 to A's orders.
func (w *world) produce(t *testing.T, n int) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(w.a.Brokers()...), kgo.DefaultProduceTopic("orders"))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var recs []*kgo.Record
	for i := range n {
		v := []byte(strconv.Itoa(i))
		recs = append(recs, &kgo.Record{Key: v, Value: v})
	}
	if err := cl.ProduceSync(t.Context(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// delivered returns the number of records in C's delivered: the sum of
// its partitions' end offsets.
func (w *world) delivered(t *testing.T) int64 {
	t.Helper()
	return records(t, w.c, "delivered")
}

// records returns the number of records in topic on k: the sum of its
// partitions' end offsets (the topic has the world's partition count).
func records(t *testing.T, k *devstack.Kafka, topic string) int64 {
	t.Helper()
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	cl, err := sarama.NewClient(k.Brokers(), sc)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var n int64
	for p := range int32(partitions) {
		end, err := cl.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			t.Fatal(err)
		}
		n += end
	}
	return n
}

// waitDelivered waits until C's delivered holds n records.
func (w *world) waitDelivered(t *testing.T, n int64) {
	t.Helper()
	wait.For(t, 20*time.Second, "every record on C", func() error {
		if got := w.delivered(t); got != n {
			return fmt.Errorf("%d of %d records on C", got, n)
		}
		return nil
	})
}

// start starts a member of w's configuration.
func (w *world) start(t *testing.T) *Member {
	t.Helper()
	m, err := NewMember(w.cfg, agent.Options{Logger: zaptest.NewLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	return m
}

// committed returns the sum of the next offsets committed for A's orders.
func (w *world) committed(t *testing.T) int64 {
	t.Helper()
	cli := testenv.EtcdClientT(t, w.etcd)
	pos, _, err := offsets.NewStore(cli, keys.New(fleet)).List(t.Context(), "A")
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, p := range pos {
		n += p.Offset
	}
	return n
}

// TestStopDeliversAndCommitsThenEndsEverything: a member routes every
// record to C; Stop returns promptly, after the agent has committed what
// C acknowledged, and leaves no goroutine behind (TestMain checks).
func TestStopDeliversAndCommitsThenEndsEverything(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	m := w.start(t)
	const n = 300
	w.produce(t, n)
	w.waitDelivered(t, n)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := m.Stop(ctx); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if got := w.committed(t); got != n {
		t.Errorf("committed %d records of A after a clean stop, want %d: a restart would deliver them again", got, n)
	}
	if err := m.Stop(ctx); err != nil {
		t.Errorf("second Stop: %v", err)
	}
	if err := m.Router().Handle(ctx, &record.Record{Cluster: "A", Topic: "orders", SourceTopic: "orders"}); err == nil {
		t.Error("the router takes records after Stop")
	}
}

// TestAbortAndStopBeforeStartEndEverything: an aborted member, and one
// stopped without being started, leave no goroutine behind (TestMain
// checks): the router's loop, Run and the signals watcher all end.
func TestAbortAndStopBeforeStartEndEverything(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	m := w.start(t)
	w.produce(t, 50)
	w.waitDelivered(t, 50)
	m.Abort()
	m.Abort()

	idle, err := NewMember(w.cfg, agent.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := idle.Stop(t.Context()); err != nil {
		t.Fatalf("Stop before Start: %v", err)
	}
}

// TestReadinessSaysWhenRecordsReachNoChannel: while the channel's cluster
// swallows every request (a hung C), the agent answers /readyz 503 with
// the channel and the cause once no record has been acknowledged for
// StuckAfter, and 200 again once C answers and every record is there.
// Before, it answered 200 throughout while the channel took nothing.
func TestReadinessSaysWhenRecordsReachNoChannel(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	m, err := NewMember(w.cfg, agent.Options{Logger: zaptest.NewLogger(t), StuckAfter: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := m.Stop(ctx); err != nil {
			t.Errorf("Stop: %v", err)
		}
	})
	w.produce(t, 50)
	w.waitDelivered(t, 50)
	wait.For(t, 10*time.Second, "ready", func() error {
		if ok, why := m.Agent().Ready(); !ok {
			return fmt.Errorf("not ready: %s", why)
		}
		return nil
	})

	w.c.Hang()
	w.produce(t, 50)
	wait.For(t, 30*time.Second, "/readyz naming the channel that takes nothing", func() error {
		ok, why := m.Agent().Ready()
		if ok || !strings.Contains(why, "records do not reach their channels") || !strings.Contains(why, "channel out (C/delivered) has acknowledged no record for") {
			return fmt.Errorf("ready %v: %q", ok, why)
		}
		return nil
	})
	w.c.Recover()
	wait.For(t, 60*time.Second, "every record on C", func() error {
		if got := w.delivered(t); got < 100 {
			return fmt.Errorf("%d of 100 records on C", got)
		}
		return nil
	})
	wait.For(t, 10*time.Second, "ready again", func() error {
		if ok, why := m.Agent().Ready(); !ok {
			return fmt.Errorf("not ready: %s", why)
		}
		return nil
	})
}

package agent_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/state"
)

func consumeConfig(e *devstack.Etcd, k *devstack.Kafka, id string) config.Config {
	cfg := testConfig(e, id)
	cfg.Clusters = map[string]config.Cluster{"A": {Brokers: k.Brokers(), Role: config.RolePrimary}}
	cfg.Source.Topics = []string{"orders"}
	cfg.Source.CommitInterval = 200 * time.Millisecond
	cfg.Source.RefreshInterval = time.Second
	return cfg
}

func startConsumer(t testing.TB, cfg config.Config, h record.Handler) *agent.Agent {
	t.Helper()
	return startFleetAgent(t, cfg, agent.Options{Handler: h})
}

// produce writes ids [from, to) as record values, keyed by id so they
// spread over the partitions, and waits until Kafka acknowledged them.
func produce(t *testing.T, k *devstack.Kafka, topic string, from, to int) {
	t.Helper()
	produceTagged(t, k, topic, "", from, to)
}

// produceTagged is produce with values tag+id, so that the records of
// several topics can be told apart in one ledger.
func produceTagged(t testing.TB, k *devstack.Kafka, topic, tag string, from, to int) {
	t.Helper()
	if err := produceRecords(k, topic, tag, from, to); err != nil {
		t.Fatal(err)
	}
}

// produceRecords is produceTagged returning its error, for goroutines other
// than the test's.
func produceRecords(k *devstack.Kafka, topic, tag string, from, to int) error {
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	sc.Producer.Return.Successes = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Flush.Messages = 500
	sc.Producer.Flush.Frequency = 5 * time.Millisecond
	sc.Producer.Partitioner = sarama.NewRoundRobinPartitioner
	p, err := sarama.NewAsyncProducer(k.Brokers(), sc)
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	var failed []error
	wg.Add(1)
	go func() {
		defer wg.Done()
		for range to - from {
			select {
			case <-p.Successes():
			case err := <-p.Errors():
				failed = append(failed, err)
			}
		}
	}()
	for i := from; i < to; i++ {
		p.Input() <- &sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder(strconv.Itoa(i)), Value: sarama.StringEncoder(tag + strconv.Itoa(i))}
	}
	wg.Wait()
	if err := p.Close(); err != nil {
		return err
	}
	if len(failed) > 0 {
		return fmt.Errorf("%d records not produced, first: %v", len(failed), failed[0])
	}
	return nil
}

func owned(agents ...*agent.Agent) map[string]int {
	out := map[string]int{}
	for _, a := range agents {
		out[a.ID()] = len(a.Owned())
	}
	return out
}

// waitBalanced waits until the agents own total partitions between them,
// balanced to within one.
func waitBalanced(t testing.TB, total int, agents ...*agent.Agent) {
	t.Helper()
	wait.For(t, 20*time.Second, "a balanced assignment", func() error {
		o := owned(agents...)
		sum, lo, hi := 0, total, 0
		for _, n := range o {
			sum += n
			lo, hi = min(lo, n), max(hi, n)
		}
		if sum != total || hi-lo > 1 {
			return fmt.Errorf("owned %v", o)
		}
		return nil
	})
}

func TestFleetConsumesEveryRecordThroughCrashAndJoin(t *testing.T) {
	t.Parallel()
	const records = 50_000
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 12}})
	l := newLedger()
	a1 := startConsumer(t, consumeConfig(e, k, "agent-1"), l.handler("agent-1"))
	a2 := startConsumer(t, consumeConfig(e, k, "agent-2"), l.handler("agent-2"))
	a3 := startConsumer(t, consumeConfig(e, k, "agent-3"), l.handler("agent-3"))
	waitBalanced(t, 12, a1, a2, a3)

	produce(t, k, "orders", 0, records/3)
	wait.For(t, 30*time.Second, "the first third handled", func() error {
		if n := l.count(); n < records/3 {
			return fmt.Errorf("%d handled", n)
		}
		return nil
	})
	// agent-3 crashes while records keep coming.
	done := make(chan struct{})
	go func() {
		defer close(done)
		produce(t, k, "orders", records/3, 2*records/3)
	}()
	a3.Abort()
	<-done
	waitBalanced(t, 12, a1, a2)

	// A new agent joins.
	a4 := startConsumer(t, consumeConfig(e, k, "agent-4"), l.handler("agent-4"))
	produce(t, k, "orders", 2*records/3, records)
	waitBalanced(t, 12, a1, a2, a4)

	wait.For(t, 60*time.Second, "every record handled", func() error {
		if missing, _, _ := l.result(records); len(missing) > 0 {
			return fmt.Errorf("%d not handled yet, e.g. %v", len(missing), missing[:min(5, len(missing))])
		}
		return nil
	})
	_, dups, dupFirst := l.result(records)
	t.Logf("%d records, 0 lost, %d duplicates (first handled by: %v)", records, dups, dupFirst)
	// Only the crash may cause duplicates: records agent-3 handled after its
	// last commit. Hand-overs by plan are drained and committed first.
	for id, n := range dupFirst {
		if id != "agent-3" {
			t.Errorf("%d duplicates of records first handled by %s, which was never killed", n, id)
		}
	}
	l.check(t)
}

func TestCleanStopHandsOverWithoutDuplicates(t *testing.T) {
	t.Parallel()
	const records = 6000
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 6}})
	l := newLedger()
	a1 := startConsumer(t, consumeConfig(e, k, "agent-1"), l.handler("agent-1"))
	a2 := startConsumer(t, consumeConfig(e, k, "agent-2"), l.handler("agent-2"))
	waitBalanced(t, 6, a1, a2)

	done := make(chan struct{})
	go func() {
		defer close(done)
		produce(t, k, "orders", 0, records)
	}()
	wait.For(t, 30*time.Second, "some records handled", func() error {
		if n := l.count(); n < records/4 {
			return fmt.Errorf("%d handled", n)
		}
		return nil
	})
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := a2.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	<-done
	waitBalanced(t, 6, a1)
	wait.For(t, 30*time.Second, "every record handled", func() error {
		if missing, _, _ := l.result(records); len(missing) > 0 {
			return fmt.Errorf("%d not handled yet", len(missing))
		}
		return nil
	})
	if _, dups, _ := l.result(records); dups != 0 {
		t.Errorf("a clean stop caused %d duplicates", dups)
	}
	l.check(t)
}

func TestNewPartitionsAndTopicsAreConsumed(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 2}})
	l := newLedger()
	cfg := consumeConfig(e, k, "agent-1")
	cfg.Source.TopicRegex = "^orders-"
	a := startConsumer(t, cfg, l.handler("agent-1"))
	waitBalanced(t, 2, a)

	if err := k.AddPartitions("orders", 4); err != nil {
		t.Fatal(err)
	}
	if err := k.CreateTopic("orders-v2", 3); err != nil {
		t.Fatal(err)
	}
	// Discovery runs every refresh interval; planning and starting take
	// milliseconds.
	began := time.Now()
	wait.For(t, cfg.Source.RefreshInterval+2*time.Second, "new partitions and the new topic assigned", func() error {
		var got []string
		for _, tp := range a.Owned() {
			got = append(got, tp.String())
		}
		want := []string{"orders/0", "orders/1", "orders/2", "orders/3", "orders-v2/0", "orders-v2/1", "orders-v2/2"}
		if !slices.Equal(got, want) {
			return fmt.Errorf("owned %v", got)
		}
		return nil
	})
	t.Logf("assigned %v after the change", time.Since(began))
	produce(t, k, "orders-v2", 0, 30)
	wait.For(t, 10*time.Second, "records of the new topic handled", func() error {
		if n := l.count(); n < 30 {
			return fmt.Errorf("%d handled", n)
		}
		return nil
	})
}

func TestStaleAgentStopsAndCommittedOffsetsReachKafka(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 3}})
	l := newLedger()
	a1 := startConsumer(t, consumeConfig(e, k, "agent-1"), l.handler("agent-1"))
	a2 := startConsumer(t, consumeConfig(e, k, "agent-2"), l.handler("agent-2"))
	waitBalanced(t, 3, a1, a2)
	produce(t, k, "orders", 0, 300)
	wait.For(t, 10*time.Second, "records handled", func() error {
		if n := l.count(); n < 300 {
			return fmt.Errorf("%d handled", n)
		}
		return nil
	})

	// The committed offsets are the Kafka group's offsets too.
	cli := testenv.EtcdClientT(t, e)
	wait.For(t, 10*time.Second, "group offsets on the cluster", func() error {
		got, err := groupOffsets(k, "orders", 3)
		if err != nil {
			return err
		}
		etcd, err := committed(cli, "A", "orders", 3)
		if err != nil {
			return err
		}
		if !maps.Equal(got, etcd) || sum(got) != 300 {
			return fmt.Errorf("kafka group %v, etcd %v", got, etcd)
		}
		return nil
	})

	// Revoke a follower's lease behind its back, as etcd does to an agent
	// that stalled past its TTL. The agent is alive: it must stop consuming
	// under the old lease while the leader gives its partitions to the
	// other agent, then register again and get its share back.
	a := a1
	if a1.Leading() {
		a = a2
	}
	lease := a.Status().Etcd.LeaseID
	var oldGen int64
	for i := range 300 {
		oldGen = max(oldGen, l.generationOf(strconv.Itoa(i)))
	}
	if _, err := cli.Revoke(context.Background(), clientv3.LeaseID(lease)); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 10*time.Second, "registered again on a new lease", func() error {
		if ok, why := a.Ready(); !ok || a.Status().Etcd.LeaseID == lease {
			return fmt.Errorf("ready=%v (%s), lease %x", ok, why, a.Status().Etcd.LeaseID)
		}
		return nil
	})
	waitBalanced(t, 3, a1, a2)
	produce(t, k, "orders", 300, 400)
	wait.For(t, 10*time.Second, "consuming again on a new lease", func() error {
		if n := l.count(); n < 400 {
			return fmt.Errorf("%d handled", n)
		}
		return nil
	})
	// What the revoked agent handles now, it consumes under a generation
	// published after its lease was revoked.
	byRevoked := 0
	for i := 300; i < 400; i++ {
		id := strconv.Itoa(i)
		if l.firstHandler(id) != a.ID() {
			continue
		}
		byRevoked++
		if g := l.generationOf(id); g <= oldGen {
			t.Fatalf("record %d handled by %s under generation %d, not after the stale generation %d", i, a.ID(), g, oldGen)
		}
	}
	if byRevoked == 0 {
		t.Fatalf("%s handled none of the records produced after it came back", a.ID())
	}
	l.check(t)
}

// groupOffsets reads the Kafka group's committed offsets of topic's
// partitions [0, n).
func groupOffsets(k *devstack.Kafka, group string, n int32) (map[state.TopicPartition]int64, error) {
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	adm, err := sarama.NewClusterAdmin(k.Brokers(), sc)
	if err != nil {
		return nil, err
	}
	defer adm.Close()
	var ps []int32
	for p := range n {
		ps = append(ps, p)
	}
	resp, err := adm.ListConsumerGroupOffsets(group, map[string][]int32{"orders": ps})
	if err != nil {
		return nil, err
	}
	out := map[state.TopicPartition]int64{}
	for _, p := range ps {
		b := resp.GetBlock("orders", p)
		if b == nil {
			return nil, fmt.Errorf("no offset of orders/%d in the answer", p)
		}
		if b.Err != sarama.ErrNoError {
			return nil, fmt.Errorf("orders/%d: %w", p, b.Err)
		}
		out[state.TopicPartition{Topic: "orders", Partition: p}] = b.Offset
	}
	return out, nil
}

// committed reads the fleet's committed offsets of a cluster from etcd.
func committed(cli *clientv3.Client, cluster, topic string, n int32) (map[state.TopicPartition]int64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ps, _, err := offsets.NewStore(cli, keys.New("orders")).List(ctx, cluster)
	if err != nil {
		return nil, err
	}
	out := map[state.TopicPartition]int64{}
	for _, p := range ps {
		if p.Topic == topic && p.Partition < n {
			out[state.TopicPartition{Topic: p.Topic, Partition: p.Partition}] = p.Offset
		}
	}
	return out, nil
}

func sum(m map[state.TopicPartition]int64) int64 {
	var s int64
	for _, v := range m {
		s += v
	}
	return s
}

func TestGossipDeathMovesPartitionsBeforeTheLeaseExpires(t *testing.T) {
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 6}})
	l := newLedger()
	// A TTL far longer than gossip's failure detection: if the partitions
	// move in time, gossip moved them.
	const longTTL = 60 * time.Second
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		cfg := consumeConfig(e, k, id)
		cfg.Etcd.SessionTTL = longTTL
		agents = append(agents, startConsumer(t, cfg, l.handler(id)))
	}
	waitBalanced(t, 6, agents...)
	wait.For(t, 15*time.Second, "gossip converged", func() error {
		for _, a := range agents {
			if n := len(a.GossipMembers()); n != 3 {
				return fmt.Errorf("%s sees %d members", a.ID(), n)
			}
		}
		return nil
	})
	victim := agents[0]
	if victim.Leading() {
		victim = agents[1]
	}
	rest := slices.DeleteFunc(slices.Clone(agents), func(a *agent.Agent) bool { return a == victim })
	began := time.Now()
	victim.Abort()
	waitBalanced(t, 6, rest...)
	took := time.Since(began)
	t.Logf("partitions of %s moved %v after it died (session TTL %v)", victim.ID(), took, longTTL)
	if took >= longTTL/2 {
		t.Fatalf("partitions moved after %v: gossip did not evict the dead agent", took)
	}
	produce(t, k, "orders", 0, 600)
	wait.For(t, 10*time.Second, "records handled by the survivors", func() error {
		if n := l.count(); n < 600 {
			return fmt.Errorf("%d handled", n)
		}
		return nil
	})
	l.check(t)
}

// TestAReleaseOutlivedByItsGenerationStillCommits: an agent is still
// draining partitions it releases when the leader publishes the next
// generation (agents joined meanwhile), in which those releases still
// stand. The final commit, fenced by the generation that revoked the
// partitions, is then refused as stale; the agent must commit under the
// current generation before it acknowledges, or the partitions' next
// owners consume again what it handled since its last periodic commit.
func TestAReleaseOutlivedByItsGenerationStillCommits(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 4}})
	cli := testenv.EtcdClientT(t, e)
	l := newLedger()
	slow := &gate{}
	a1 := startFleetAgent(t, consumeConfig(e, k, "agent-1"), agent.Options{Handler: slow.handler(l, "agent-1"), DrainTimeout: 30 * time.Second})
	waitBalanced(t, 4, a1)
	produce(t, k, "orders", 0, 200)
	wait.For(t, 20*time.Second, "the first records handled", func() error {
		if n := l.count(); n < 200 {
			return fmt.Errorf("%d handled", n)
		}
		return nil
	})
	// agent-1 now holds what it is given unacknowledged, as a slow sink
	// does: its releases wait for the drain.
	slow.close()
	produce(t, k, "orders", 200, 400)
	wait.For(t, 20*time.Second, "agent-1 holding records", func() error {
		if n := slow.holding(); n < 200 {
			return fmt.Errorf("holds %d", n)
		}
		return nil
	})
	assignment := func() (state.Assignment, error) {
		resp, err := cli.Get(context.Background(), fleetKeys.Assignment())
		if err != nil || len(resp.Kvs) == 0 {
			return state.Assignment{}, fmt.Errorf("no state/assignment (%v)", err)
		}
		return state.ParseAssignment(resp.Kvs[0].Value)
	}
	// A second agent: agent-1 releases two partitions (and drains).
	a2 := startConsumer(t, consumeConfig(e, k, "agent-2"), l.handler("agent-2"))
	var revoked state.Assignment
	wait.For(t, 20*time.Second, "agent-1 releasing", func() error {
		a, err := assignment()
		if err != nil || len(a.Revoking["agent-1"]) == 0 {
			return fmt.Errorf("state/assignment %+v (%v)", a, err)
		}
		revoked = a
		return nil
	})
	// Two more: the next generation takes a third partition from agent-1,
	// while the first two releases still stand.
	a3 := startConsumer(t, consumeConfig(e, k, "agent-3"), l.handler("agent-3"))
	a4 := startConsumer(t, consumeConfig(e, k, "agent-4"), l.handler("agent-4"))
	wait.For(t, 20*time.Second, "a newer generation while agent-1 drains", func() error {
		a, err := assignment()
		if err != nil || a.Generation <= revoked.Generation {
			return fmt.Errorf("state/assignment generation %d (%v)", a.Generation, err)
		}
		for _, tp := range revoked.Revoking["agent-1"] {
			if !a.MayCommit("agent-1", a.Cluster, tp) {
				return fmt.Errorf("generation %d no longer lets agent-1 commit %s: %+v", a.Generation, tp, a)
			}
		}
		return nil
	})
	t.Logf("agent-1 releases %v since generation %d; generation %d published meanwhile; its sink acknowledges %d held records now",
		revoked.Revoking["agent-1"], revoked.Generation, revoked.Generation+1, slow.holding())
	slow.open()
	waitBalanced(t, 4, a1, a2, a3, a4)
	produce(t, k, "orders", 400, 600)
	wait.For(t, 30*time.Second, "every record handled", func() error {
		if missing, _, _ := l.result(600); len(missing) > 0 {
			return fmt.Errorf("%d not handled yet", len(missing))
		}
		return nil
	})
	if _, dups, dupFirst := l.result(600); dups != 0 {
		for _, d := range l.dupDeliveries() {
			t.Log(d)
		}
		t.Errorf("%d duplicates (first handled by %v): a planned hand-over must commit the released position", dups, dupFirst)
	}
	l.check(t)
}

// TestReleasedNamesEachPartitionGivenUp: the agent tells Options.Released
// of each partition it gives up in a rebalance, before the next owner
// starts, naming it and its owner as its records did (the routing sink
// matches them to its exactly_once producers).
func TestReleasedNamesEachPartitionGivenUp(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 4}})
	produce(t, k, "orders", 0, 400)
	var mu sync.Mutex
	seen := map[int32]record.Owned{}
	var released []record.Owned
	h := record.HandlerFunc(func(_ context.Context, r *record.Record) error {
		mu.Lock()
		seen[r.Partition] = r.Owned()
		mu.Unlock()
		r.Ack()
		return nil
	})
	a1 := startFleetAgent(t, consumeConfig(e, k, "agent-1"), agent.Options{Handler: h, Released: func(p record.Owned) {
		mu.Lock()
		released = append(released, p)
		mu.Unlock()
	}})
	wait.For(t, 30*time.Second, "agent-1 handles every partition", func() error {
		mu.Lock()
		defer mu.Unlock()
		if len(seen) != 4 {
			return fmt.Errorf("records of %d partitions handled", len(seen))
		}
		return nil
	})
	a2 := startConsumer(t, consumeConfig(e, k, "agent-2"), record.HandlerFunc(func(_ context.Context, r *record.Record) error {
		r.Ack()
		return nil
	}))
	waitBalanced(t, 4, a1, a2)
	mu.Lock()
	defer mu.Unlock()
	if len(released) != 2 {
		t.Fatalf("agent-1 told of %d partitions released (%+v), want the 2 agent-2 took", len(released), released)
	}
	for _, p := range released {
		if want := seen[p.Partition]; p != want {
			t.Errorf("released %+v, want the owner its records carried: %+v", p, want)
		}
	}
	if released[0].Partition == released[1].Partition {
		t.Errorf("partition %d released twice", released[0].Partition)
	}
}

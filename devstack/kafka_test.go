package devstack_test

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kerr"
	"go.uber.org/goleak"

	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/freeport"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
)

func saramaConfig() *sarama.Config {
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V3_6_0_0
	cfg.ClientID = "testenv-test"
	cfg.Producer.Return.Successes = true
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	cfg.Producer.Partitioner = sarama.NewManualPartitioner
	cfg.Consumer.Return.Errors = true
	cfg.Metadata.AllowAutoTopicCreation = true
	return cfg
}

func newSaramaClient(t *testing.T, k *devstack.Kafka, cfg *sarama.Config) sarama.Client {
	t.Helper()
	if cfg == nil {
		cfg = saramaConfig()
	}
	cl, err := sarama.NewClient(k.Brokers(), cfg)
	if err != nil {
		t.Fatalf("sarama client: %v", err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}

func newSyncProducer(t *testing.T, cl sarama.Client) sarama.SyncProducer {
	t.Helper()
	p, err := sarama.NewSyncProducerFromClient(cl)
	if err != nil {
		t.Fatalf("sync producer: %v", err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// produce sends n records value-prefix-0..n-1 to topic/partition.
func produce(t *testing.T, p sarama.SyncProducer, topic string, partition int32, prefix string, n int) {
	t.Helper()
	for i := range n {
		_, _, err := p.SendMessage(&sarama.ProducerMessage{
			Topic:     topic,
			Partition: partition,
			Value:     sarama.StringEncoder(fmt.Sprintf("%s-%d", prefix, i)),
		})
		if err != nil {
			t.Fatalf("produce %s/%d #%d: %v", topic, partition, i, err)
		}
	}
}

// consumeAll reads topic/partition from the oldest offset up to the high
// watermark (taken first) with a partition consumer, and returns the values.
func consumeAll(t *testing.T, cl sarama.Client, topic string, partition int32) []string {
	t.Helper()
	hwm, err := cl.GetOffset(topic, partition, sarama.OffsetNewest)
	if err != nil {
		t.Fatalf("high watermark of %s/%d: %v", topic, partition, err)
	}
	c, err := sarama.NewConsumerFromClient(cl)
	if err != nil {
		t.Fatalf("consumer: %v", err)
	}
	defer c.Close()
	pc, err := c.ConsumePartition(topic, partition, sarama.OffsetOldest)
	if err != nil {
		t.Fatalf("consume %s/%d: %v", topic, partition, err)
	}
	defer pc.Close()
	var values []string
	timeout := time.NewTimer(20 * time.Second)
	defer timeout.Stop()
	for int64(len(values)) < hwm {
		select {
		case m := <-pc.Messages():
			values = append(values, string(m.Value))
		case err := <-pc.Errors():
			t.Fatalf("consume %s/%d: %v", topic, partition, err)
		case <-timeout.C:
			t.Fatalf("consume %s/%d: got %d of %d records", topic, partition, len(values), hwm)
		}
	}
	return values
}

func wantValues(t *testing.T, got []string, prefix string, n int) {
	t.Helper()
	if len(got) != n {
		t.Fatalf("got %d records %v, want %d", len(got), got, n)
	}
	for i, v := range got {
		if want := fmt.Sprintf("%s-%d", prefix, i); v != want {
			t.Fatalf("record %d = %q, want %q", i, v, want)
		}
	}
}

func partitionCount(cl sarama.Client, topic string) (int, error) {
	if err := cl.RefreshMetadata(topic); err != nil {
		return 0, err
	}
	ps, err := cl.Partitions(topic)
	return len(ps), err
}

func TestKafkaProduceConsumeSurvivesRestart(t *testing.T) {
	t.Parallel()
	const n = 50
	k := testenv.StartKafkaT(t, "east", devstack.KafkaOptions{
		Topics:           map[string]int32{"orders": 3},
		AutoCreateTopics: true,
	})
	if k.Name() != "east" || len(k.Brokers()) != 1 {
		t.Fatalf("Name() = %q, Brokers() = %v", k.Name(), k.Brokers())
	}
	brokersBefore := k.Brokers()
	cl := newSaramaClient(t, k, nil)
	p := newSyncProducer(t, cl)

	if got, err := partitionCount(cl, "orders"); err != nil || got != 3 {
		t.Fatalf("orders partitions = %d, %v; want 3", got, err)
	}
	produce(t, p, "orders", 1, "a", n)
	produce(t, p, "auto", 0, "b", n) // auto-created, 1 partition by default
	wantValues(t, consumeAll(t, cl, "orders", 1), "a", n)
	wantValues(t, consumeAll(t, cl, "auto", 0), "b", n)

	k.Stop()
	k.Stop() // idempotent
	if k.Running() || k.Cluster() != nil {
		t.Fatal("running after Stop")
	}
	if err := k.Restart(); err != nil {
		t.Fatalf("restart: %v", err)
	}
	if err := k.Restart(); err == nil {
		t.Fatal("restart of a running cluster succeeded")
	}
	if fmt.Sprint(k.Brokers()) != fmt.Sprint(brokersBefore) {
		t.Fatalf("brokers changed across restart: %v -> %v", brokersBefore, k.Brokers())
	}

	// The old client and producer reconnect by themselves.
	waitFor(t, 20*time.Second, "produce after restart", func() error {
		_, _, err := p.SendMessage(&sarama.ProducerMessage{Topic: "orders", Partition: 1, Value: sarama.StringEncoder(fmt.Sprintf("a-%d", n))})
		return err
	})

	// A fresh client sees everything written before the restart.
	cl2 := newSaramaClient(t, k, nil)
	wantValues(t, consumeAll(t, cl2, "orders", 1), "a", n+1)
	wantValues(t, consumeAll(t, cl2, "auto", 0), "b", n)
	if got, err := partitionCount(cl2, "orders"); err != nil || got != 3 {
		t.Fatalf("orders partitions after restart = %d, %v; want 3", got, err)
	}
}

func TestKafkaInMemoryRestartStartsEmpty(t *testing.T) {
	t.Parallel()
	k, err := devstack.StartKafka("mem", devstack.KafkaOptions{Topics: map[string]int32{"t": 1}})
	if err != nil {
		t.Fatal(err)
	}
	defer k.Stop()
	cl := newSaramaClient(t, k, nil)
	produce(t, newSyncProducer(t, cl), "t", 0, "x", 3)
	k.Stop()
	if err := k.Restart(); err != nil {
		t.Fatal(err)
	}
	// Seed topics come back, records do not.
	cl2 := newSaramaClient(t, k, nil)
	if got := consumeAll(t, cl2, "t", 0); len(got) != 0 {
		t.Fatalf("in-memory cluster kept %v across restart", got)
	}
}

func TestKafkaFailRecover(t *testing.T) {
	t.Parallel()
	k := testenv.StartKafkaT(t, "west", devstack.KafkaOptions{Topics: map[string]int32{"orders": 1}})
	cl := newSaramaClient(t, k, nil)
	p := newSyncProducer(t, cl)
	produce(t, p, "orders", 0, "a", 1)

	k.Fail()
	err := within(t, 5*time.Second, "metadata while failed", func() error { return cl.RefreshMetadata("orders") })
	if err == nil {
		t.Fatal("metadata refresh succeeded on a failed cluster")
	}
	err = within(t, 10*time.Second, "produce while failed", func() error {
		_, _, err := p.SendMessage(&sarama.ProducerMessage{Topic: "orders", Value: sarama.StringEncoder("lost")})
		return err
	})
	if err == nil {
		t.Fatal("produce succeeded on a failed cluster")
	}

	// A client started during the failure cannot even bootstrap.
	if c, err := sarama.NewClient(k.Brokers(), saramaConfig()); err == nil {
		c.Close()
		t.Fatal("new client bootstrapped on a failed cluster")
	}

	k.Recover()
	waitFor(t, 20*time.Second, "metadata after recover", func() error { return cl.RefreshMetadata("orders") })
	waitFor(t, 20*time.Second, "produce after recover", func() error {
		_, _, err := p.SendMessage(&sarama.ProducerMessage{Topic: "orders", Value: sarama.StringEncoder("a-1")})
		return err
	})
	wantValues(t, consumeAll(t, cl, "orders", 0), "a", 2)
}

func TestKafkaHangRecover(t *testing.T) {
	t.Parallel()
	k := testenv.StartKafkaT(t, "hung", devstack.KafkaOptions{Topics: map[string]int32{"orders": 1}})
	cfg := saramaConfig()
	cfg.Net.ReadTimeout = time.Second
	cfg.Metadata.Retry.Max = 1
	cl := newSaramaClient(t, k, cfg)
	if err := cl.RefreshMetadata("orders"); err != nil {
		t.Fatal(err)
	}

	k.Hang()
	err := within(t, 10*time.Second, "metadata while hung", func() error { return cl.RefreshMetadata("orders") })
	if err == nil {
		t.Fatal("metadata refresh succeeded on a hung cluster")
	}

	k.Recover()
	waitFor(t, 20*time.Second, "metadata after recover", func() error { return cl.RefreshMetadata("orders") })
}

func TestKafkaFailSurvivesRestart(t *testing.T) {
	t.Parallel()
	k := testenv.StartKafkaT(t, "f", devstack.KafkaOptions{Topics: map[string]int32{"orders": 1}})
	k.Fail()
	k.Stop()
	if err := k.Restart(); err != nil {
		t.Fatal(err)
	}
	if c, err := sarama.NewClient(k.Brokers(), saramaConfig()); err == nil {
		c.Close()
		t.Fatal("client bootstrapped on a failed, restarted cluster")
	}
	k.Recover()
	waitFor(t, 20*time.Second, "bootstrap after recover", func() error {
		c, err := sarama.NewClient(k.Brokers(), saramaConfig())
		if err == nil {
			c.Close()
		}
		return err
	})
}

func TestKafkaCreateTopicAddPartitions(t *testing.T) {
	t.Parallel()
	k := testenv.StartKafkaT(t, "admin", devstack.KafkaOptions{})
	cl := newSaramaClient(t, k, nil)

	if err := k.CreateTopic("fresh", 2); err != nil {
		t.Fatal(err)
	}
	if got, err := partitionCount(cl, "fresh"); err != nil || got != 2 {
		t.Fatalf("fresh partitions = %d, %v; want 2", got, err)
	}
	if err := k.CreateTopic("fresh", 2); !errors.Is(err, kerr.TopicAlreadyExists) {
		t.Fatalf("second CreateTopic = %v, want TopicAlreadyExists", err)
	}
	if err := k.CreateTopic("dflt", 0); err != nil {
		t.Fatal(err)
	}
	if got, err := partitionCount(cl, "dflt"); err != nil || got != 1 {
		t.Fatalf("dflt partitions = %d, %v; want 1 (DefaultPartitions)", got, err)
	}

	if err := k.AddPartitions("fresh", 5); err != nil {
		t.Fatal(err)
	}
	if got, err := partitionCount(cl, "fresh"); err != nil || got != 5 {
		t.Fatalf("fresh partitions after AddPartitions = %d, %v; want 5", got, err)
	}
	if err := k.AddPartitions("fresh", 3); !errors.Is(err, kerr.InvalidPartitions) {
		t.Fatalf("shrinking AddPartitions = %v, want InvalidPartitions", err)
	}
	if err := k.AddPartitions("nope", 3); !errors.Is(err, kerr.UnknownTopicOrPartition) {
		t.Fatalf("AddPartitions on a missing topic = %v, want UnknownTopicOrPartition", err)
	}
	p := newSyncProducer(t, cl)
	produce(t, p, "fresh", 4, "n", 2)
	wantValues(t, consumeAll(t, cl, "fresh", 4), "n", 2)

	// CreateTopic acts on the cluster directly, so it works while failed.
	k.Fail()
	if err := k.CreateTopic("during-failure", 1); err != nil {
		t.Fatal(err)
	}
	k.Recover()

	// Topics and partitions made by the helpers survive a restart.
	k.Stop()
	if err := k.CreateTopic("x", 1); !errors.Is(err, devstack.ErrStopped) {
		t.Fatalf("CreateTopic on a stopped cluster = %v, want devstack.ErrStopped", err)
	}
	if err := k.Restart(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, "partitions after restart", func() error {
		for topic, want := range map[string]int{"fresh": 5, "during-failure": 1} {
			got, err := partitionCount(cl, topic)
			if err != nil {
				return err
			}
			if got != want {
				return fmt.Errorf("%s has %d partitions, want %d", topic, got, want)
			}
		}
		return nil
	})
}

func TestKafkaMultiBrokerFixedPorts(t *testing.T) {
	t.Parallel()
	ports, err := freeport.Ports(3)
	if err != nil {
		t.Fatal(err)
	}
	k := testenv.StartKafkaT(t, "multi", devstack.KafkaOptions{Ports: ports, Topics: map[string]int32{"t": 6}})
	for i, b := range k.Brokers() {
		if b != net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[i])) {
			t.Fatalf("Brokers() = %v, want ports %v", k.Brokers(), ports)
		}
	}
	cl := newSaramaClient(t, k, nil)
	if got := len(cl.Brokers()); got != 3 {
		t.Fatalf("sarama sees %d brokers, want 3", got)
	}
	p := newSyncProducer(t, cl)
	for part := range int32(6) {
		produce(t, p, "t", part, fmt.Sprintf("p%d", part), 3)
	}
	k.Stop()
	if err := k.Restart(); err != nil {
		t.Fatal(err)
	}
	cl2 := newSaramaClient(t, k, nil)
	for part := range int32(6) {
		wantValues(t, consumeAll(t, cl2, "t", part), fmt.Sprintf("p%d", part), 3)
	}
}

func TestKafkaOptionsValidation(t *testing.T) {
	t.Parallel()
	if _, err := devstack.StartKafka("bad", devstack.KafkaOptions{Brokers: 2, Ports: []int{1}}); err == nil {
		t.Fatal("Brokers=2 with one port accepted")
	}
	if _, err := devstack.StartKafka("bad", devstack.KafkaOptions{Brokers: -1}); err == nil {
		t.Fatal("Brokers=-1 accepted")
	}
}

func TestKafkaStopLeavesNoGoroutines(t *testing.T) {
	defer goleak.VerifyNone(t, append([]goleak.Option{goleak.IgnoreCurrent()}, testenv.LeakOptions()...)...)

	k, err := devstack.StartKafka("leak", devstack.KafkaOptions{DataDir: t.TempDir(), Topics: map[string]int32{"t": 2}})
	if err != nil {
		t.Fatal(err)
	}
	cl, err := sarama.NewClient(k.Brokers(), saramaConfig())
	if err != nil {
		t.Fatal(err)
	}
	p, err := sarama.NewSyncProducerFromClient(cl)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := p.SendMessage(&sarama.ProducerMessage{Topic: "t", Value: sarama.StringEncoder("v")}); err != nil {
		t.Fatal(err)
	}
	if err := k.AddPartitions("t", 3); err != nil {
		t.Fatal(err)
	}
	k.Hang()
	k.Recover()
	p.Close()
	cl.Close()
	k.Stop()
	if err := k.Restart(); err != nil {
		t.Fatal(err)
	}
	k.Stop()
}

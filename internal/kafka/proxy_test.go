package kafka_test

import (
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/integration/netfault"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
)

// proxied starts a 3-broker cluster and a SOCKS5 server whose link "P"
// carries the connections to every broker, and returns a cluster
// definition that names only the first broker and the proxy.
func proxied(t *testing.T) (*devstack.Kafka, *netfault.SOCKS5, *netfault.Link, config.Cluster) {
	t.Helper()
	k := testenv.StartKafkaT(t, "P", devstack.KafkaOptions{Brokers: 3, Topics: map[string]int32{"t": 6}})
	link := netfault.NewLink("P")
	links := map[string]*netfault.Link{}
	for _, b := range k.Brokers() {
		links[b] = link
	}
	s, err := netfault.ListenSOCKS5("127.0.0.1:0", links)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	cl := config.Cluster{Brokers: k.Brokers()[:1], Version: config.DefaultKafkaVersion, Proxy: config.ProxyURL("socks5://" + s.Addr())}
	return k, s, link, cl
}

func allPartitions(n int32) []kafka.TopicPartition {
	var tps []kafka.TopicPartition
	for p := range n {
		tps = append(tps, kafka.TopicPartition{Topic: "t", Partition: p})
	}
	return tps
}

// TestProxyCarriesEveryConnection: a client and a producer of a cluster
// with a proxy reach the bootstrap broker and the partitions' leaders,
// which they learn from its metadata, through the proxy (its CONNECTs counted per
// destination), and through nothing else: once the proxy's link is cut,
// no broker answers them.
func TestProxyCarriesEveryConnection(t *testing.T) {
	t.Parallel()
	k, s, link, cl := proxied(t)
	client, err := kafka.NewClient("P", cl)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	ends, err := kafka.EndOffsets(client, allPartitions(6))
	if err != nil || len(ends) != 6 {
		t.Fatalf("end offsets through the proxy: %v, %v", ends, err)
	}
	sc, err := kafka.Config(cl) // as the routing producers configure theirs
	if err != nil {
		t.Fatal(err)
	}
	sc.Producer.Return.Successes = true
	sc.Producer.Partitioner = sarama.NewManualPartitioner
	sc.Producer.Retry.Max = 0
	sp, err := sarama.NewSyncProducer(cl.Brokers, sc)
	if err != nil {
		t.Fatal(err)
	}
	defer sp.Close()
	for p := range int32(6) {
		if _, _, err := sp.SendMessage(&sarama.ProducerMessage{Topic: "t", Partition: p, Value: sarama.StringEncoder("v")}); err != nil {
			t.Fatalf("produce to t/%d through the proxy: %v", p, err)
		}
	}

	// The brokers the two used: the bootstrap broker, and the partitions'
	// leaders, which kfake draws at random among its three brokers and
	// the clients learn from the bootstrap broker's metadata.
	used := map[string]bool{cl.Brokers[0]: true}
	for p := range int32(6) {
		b, err := client.Leader("t", p)
		if err != nil {
			t.Fatal(err)
		}
		used[b.Addr()] = true
	}
	if len(used) < 2 {
		t.Fatalf("every partition's leader is the bootstrap broker %s: nothing learned from metadata to check", cl.Brokers[0])
	}
	connects := s.Connects()
	if got, want := slices.Sorted(maps.Keys(connects)), slices.Sorted(maps.Keys(used)); !slices.Equal(got, want) {
		t.Fatalf("CONNECTs went to %v (%v), want the brokers used %v (of %v)", got, connects, want, k.Brokers())
	}
	// Each of the two clients opens a connection to each broker it uses.
	for b, n := range connects {
		if n < 2 {
			t.Errorf("%d CONNECTs to %s, want one of the client and one of the producer at least", n, b)
		}
	}
	t.Logf("CONNECTs per broker: %v", connects)

	link.Set(netfault.Fault{Cut: true})
	if ends, err := kafka.EndOffsets(client, allPartitions(6)); len(ends) != 0 || err == nil {
		t.Errorf("end offsets with the proxy's link cut: %v, %v; want none answered", ends, err)
	}
	for p := range int32(6) {
		if _, _, err := sp.SendMessage(&sarama.ProducerMessage{Topic: "t", Partition: p, Value: sarama.StringEncoder("v")}); err == nil {
			t.Errorf("produce to t/%d with the proxy's link cut succeeded", p)
		}
	}
}

// TestDialerReplacesProxy: an Options.Dialer (a test's link) carries the
// connections instead of the cluster's proxy.
func TestDialerReplacesProxy(t *testing.T) {
	t.Parallel()
	_, s, _, cl := proxied(t)
	d := devstack.NewLink()
	client, err := kafka.NewClientWith("P", cl, kafka.Options{Dialer: d})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	if ends, err := kafka.EndOffsets(client, allPartitions(6)); err != nil || len(ends) != 6 {
		t.Fatalf("end offsets: %v, %v", ends, err)
	}
	if n := s.Connects(); len(n) != 0 {
		t.Errorf("CONNECTs %v with an Options.Dialer, want none", n)
	}
	if d.Dials() == 0 {
		t.Error("the Options.Dialer made no connection")
	}
}

// TestProxyDialIsBounded: a proxy that cannot reach the broker holds its
// CONNECT (the link blackholed); the client's dial gives up after its
// dial timeout instead of waiting for good.
func TestProxyDialIsBounded(t *testing.T) {
	t.Parallel()
	_, _, link, cl := proxied(t)
	link.Set(netfault.Fault{Blackhole: true})
	const timeout = 300 * time.Millisecond
	start := time.Now()
	_, err := kafka.NewClientWith("P", cl, kafka.Options{Timeout: timeout})
	took := time.Since(start)
	if err == nil {
		t.Fatal("a client connected through a proxy that reaches no broker")
	}
	// One seed broker, no metadata retry with a Timeout: one dial of
	// 300 ms; 5 s leaves room for a loaded machine.
	if took > 5*time.Second {
		t.Errorf("NewClientWith failed after %v (%v), want about %v", took, err, timeout)
	}
	t.Logf("failed after %v: %v", took.Round(time.Millisecond), err)
}

func TestBadProxyIsAnError(t *testing.T) {
	t.Parallel()
	_, err := kafka.Config(config.Cluster{Brokers: []string{"h:1"}, Version: config.DefaultKafkaVersion, Proxy: "http://u:pw@h:3128"})
	if err == nil || !strings.Contains(err.Error(), `proxy: http://u:xxxxx@h:3128: scheme "http" is not socks5`) {
		t.Errorf("Config with an http proxy: %v", err)
	}
	if err != nil && strings.Contains(err.Error(), "pw") {
		t.Errorf("the error shows the password: %v", err)
	}
}

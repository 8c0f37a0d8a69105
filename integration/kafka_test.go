//go:build integration

package integration

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/internal/freeport"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// This file runs Apache Kafka and MirrorMaker 2 as real processes, from the
// jars `make kafka-jars` copies into the tool cache (integration/kafka/pom.xml),
// and kcat as the outside producer and reader.

// kafkaVersion is the protocol version the suite's own sarama clients and
// the agents speak: the broker's (integration/kafka/pom.xml).
const kafkaVersion = "4.1.0"

var saramaVersion = sarama.V4_1_0_0

// kafkaEnv locates java, one release's Kafka jars and their logging
// configuration.
type kafkaEnv struct {
	java string
	libs string // a directory of jars
	// release is the broker's, from its jar's name: 4.1.1, 3.9.2.
	release string
	// version is what the agents' clusters.<name>.version says of a
	// cluster of this release (the suite's kafkaVersion for its own).
	version string
	// logging is the JVM flag naming the logging configuration: log4j2
	// for 4.x, log4j 1 (reload4j) for 3.x.
	logging string
}

// kafkaTools is the suite's Kafka (KSWITCH_TEST_KAFKA_DIR,
// integration/kafka/pom.xml), which also runs MirrorMaker 2.
func kafkaTools(t *testing.T) kafkaEnv {
	t.Helper()
	e := kafkaToolsFrom(t, "KSWITCH_TEST_KAFKA_DIR")
	e.version = kafkaVersion
	return e
}

// kafkaToolsOld and kafkaToolsNewest are the brokers of the versions
// scenario (KSWITCH_TEST_KAFKA_DIR_OLD, integration/kafka/old/pom.xml:
// Kafka 3.x; KSWITCH_TEST_KAFKA_DIR_NEWEST, kafka/newest/pom.xml: the
// newest 4.x; each the broker alone); the agents configure a release as
// its clusters' version.
func kafkaToolsOld(t *testing.T) kafkaEnv {
	t.Helper()
	e := kafkaToolsFrom(t, "KSWITCH_TEST_KAFKA_DIR_OLD")
	e.version = e.release
	return e
}

func kafkaToolsNewest(t *testing.T) kafkaEnv {
	t.Helper()
	e := kafkaToolsFrom(t, "KSWITCH_TEST_KAFKA_DIR_NEWEST")
	e.version = e.release
	return e
}

// kafkaToolsFrom locates the jars in the directory the environment
// variable dirVar names, and the logging configuration their binding
// reads: log4j 1's kafka/old/log4j.properties where reload4j is among
// them (Kafka 3.x), else log4j2's kafka/log4j2.properties (4.x).
func kafkaToolsFrom(t *testing.T, dirVar string) kafkaEnv {
	t.Helper()
	dir := os.Getenv(dirVar)
	if dir == "" {
		fatalf(t, "%s is not set: run the suite with `make integration`, which fetches the Kafka jars", dirVar)
	}
	libs := filepath.Join(dir, "libs")
	if _, err := os.Stat(filepath.Join(libs, ".complete")); err != nil {
		fatalf(t, "no Kafka jars in %s (%v): run `make kafka-jars`", libs, err)
	}
	jars, err := filepath.Glob(filepath.Join(libs, "kafka_2.13-*.jar"))
	if err != nil || len(jars) != 1 {
		fatalf(t, "%s: want one broker jar kafka_2.13-<release>.jar, found %v (%v)", libs, jars, err)
	}
	release := strings.TrimSuffix(strings.TrimPrefix(filepath.Base(jars[0]), "kafka_2.13-"), ".jar")
	java, err := exec.LookPath("java")
	if err != nil {
		fatalf(t, "java: %v (the brokers need Java 17 or later)", err)
	}
	if _, err := exec.LookPath("kcat"); err != nil {
		fatalf(t, "kcat: %v (apt-get install kcat)", err)
	}
	logFlag, conf := "-Dlog4j2.configurationFile=", filepath.Join("kafka", "log4j2.properties")
	if log4j1, _ := filepath.Glob(filepath.Join(libs, "reload4j-*.jar")); len(log4j1) > 0 {
		logFlag, conf = "-Dlog4j.configuration=file:", filepath.Join("kafka", "old", "log4j.properties")
	}
	abs, err := filepath.Abs(conf)
	if err != nil {
		fatal(t, err)
	}
	return kafkaEnv{java: java, libs: libs, release: release, logging: logFlag + abs}
}

// jvmArgs are the flags of Kafka's bin/ scripts, with a small heap.
func (e kafkaEnv) jvmArgs(heap, logsDir, main string) []string {
	return []string{
		"-Xms" + heap, "-Xmx" + heap,
		"-server", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true",
		e.logging, "-Dkafka.logs.dir=" + logsDir,
		"-cp", filepath.Join(e.libs, "*"), main,
	}
}

// kafkaBroker is one node of a KRaft cluster (combined broker and
// controller) in its own JVM: the whole cluster for A and B.
type kafkaBroker struct {
	name  string // the cluster's name: A, B; a node's in a larger cluster: C1, C2, …
	id    int32  // node.id
	nodes int    // the cluster's node count: ready wants as many live brokers
	addr  string // host:port of the PLAINTEXT listener
	dir   string // server.properties and data
	conf  string
	env   kafkaEnv
	proc  *proc
	began time.Time // when the current process was started
}

// newKafkaBroker writes the configuration of the single-node cluster name
// and formats its storage (a JVM run of its own, a few seconds); start runs
// it. Safe to call for several clusters concurrently; it reports errors
// instead of failing t.
func newKafkaBroker(env kafkaEnv, name, dir string, logs string) (*kafkaBroker, error) {
	nodes, err := newKafkaCluster(env, name, dir, logs, 1)
	if err != nil {
		return nil, err
	}
	return nodes[0], nil
}

// newKafkaCluster is newKafkaBroker for a cluster of n combined nodes, all
// of them voters of the controller quorum: node i (1…n) is named name+i,
// in dir/node-<i>, when n > 1. Internal topics, and topics createTopic
// makes, are replicated min(n, 3) times; min.insync.replicas is one less
// (2 on three nodes), so that a cluster of three takes acks=all writes
// with a node down.
func newKafkaCluster(env kafkaEnv, name, dir, logs string, n int) ([]*kafkaBroker, error) {
	rf := min(n, 3)
	minISR := max(rf-1, 1)
	nodes := make([]*kafkaBroker, n)
	var voters []string
	cports := make([]int, n)
	for i := range nodes {
		port, err := freeport.Port()
		if err != nil {
			return nil, err
		}
		if cports[i], err = freeport.Port(); err != nil {
			return nil, err
		}
		b := &kafkaBroker{name: name, id: int32(i + 1), nodes: n, addr: fmt.Sprintf("127.0.0.1:%d", port), dir: dir, env: env}
		if n > 1 {
			b.name, b.dir = fmt.Sprintf("%s%d", name, b.id), filepath.Join(dir, fmt.Sprintf("node-%d", b.id))
		}
		b.conf = filepath.Join(b.dir, "server.properties")
		nodes[i] = b
		voters = append(voters, fmt.Sprintf("%d@127.0.0.1:%d", b.id, cports[i]))
	}
	// A cluster id is 16 random bytes in URL-safe base64 (what
	// `kafka-storage random-uuid` prints); like Kafka's, never one that
	// starts with '-', which a command line takes for an option.
	var cid string
	for cid == "" || cid[0] == '-' {
		id := make([]byte, 16)
		_, _ = rand.Read(id)
		cid = base64.RawURLEncoding.EncodeToString(id)
	}
	for i, b := range nodes {
		conf := fmt.Sprintf(`# cluster %[1]s of the kswitch integration suite: node %[6]d of %[7]d, combined broker and controller
process.roles=broker,controller
node.id=%[6]d
controller.quorum.voters=%[5]s
listeners=PLAINTEXT://%[2]s,CONTROLLER://127.0.0.1:%[3]d
advertised.listeners=PLAINTEXT://%[2]s
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=%[4]s
num.partitions=4
auto.create.topics.enable=false
min.insync.replicas=%[9]d
offsets.topic.replication.factor=%[8]d
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=%[8]d
transaction.state.log.min.isr=%[9]d
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=%[8]d
share.coordinator.state.topic.min.isr=%[9]d
share.coordinator.state.topic.num.partitions=1
group.initial.rebalance.delay.ms=0
# A broker restarted after SIGKILL registers again only once the
# controller has expired its old session (default 9 s).
broker.session.timeout.ms=2000
broker.heartbeat.interval.ms=500
# Leadership moves when a test moves it (a node's death), not back to the
# preferred replica on the controller's own schedule.
auto.leader.rebalance.enable=false
`, b.name, b.addr, cports[i], filepath.Join(b.dir, "data"), strings.Join(voters, ","), b.id, n, rf, minISR)
		if err := os.MkdirAll(b.dir, 0o755); err != nil {
			return nil, err
		}
		if err := os.WriteFile(b.conf, []byte(conf), 0o644); err != nil {
			return nil, err
		}
	}
	// Every node's storage, formatted at once (each a JVM run).
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, b := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = b.format(cid, logs)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return nodes, nil
}

// format formats the node's storage for cluster id cid.
func (b *kafkaBroker) format(cid, logs string) error {
	logFile, err := os.Create(filepath.Join(logs, "kafka-"+b.name+"-format.log"))
	if err != nil {
		return err
	}
	defer logFile.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	args := append(b.env.jvmArgs("128m", b.dir, "kafka.tools.StorageTool"),
		"format", "--cluster-id="+cid, "--config="+b.conf, "--ignore-formatted")
	cmd := exec.CommandContext(ctx, b.env.java, args...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("format storage of Kafka %s: %w; last output:\n%s", b.name, err, tail(logFile.Name(), 10))
	}
	return nil
}

// start runs the broker process on its data (again, after a kill).
func (b *kafkaBroker) start(t *testing.T) {
	t.Helper()
	b.began = time.Now()
	b.proc = startProc(t, "kafka-"+b.name, b.env.java, append(b.env.jvmArgs("384m", b.dir, "kafka.Kafka"), b.conf)...)
}

// ready returns nil once the broker answers a metadata request naming
// every node of its cluster as a live broker, and a controller: a
// listening port is not a ready broker.
func (b *kafkaBroker) ready() error {
	conf := saramaConfig(2 * time.Second)
	broker := sarama.NewBroker(b.addr)
	if err := broker.Open(conf); err != nil {
		return err
	}
	defer broker.Close()
	md, err := broker.GetMetadata(&sarama.MetadataRequest{Version: 7, AllowAutoTopicCreation: false})
	if err != nil {
		return err
	}
	if len(md.Brokers) < b.nodes || md.ControllerID < 0 {
		return fmt.Errorf("kafka %s: metadata names %d of %d brokers, controller %d", b.name, len(md.Brokers), b.nodes, md.ControllerID)
	}
	return nil
}

// waitReady waits for ready and returns how long the broker took from its
// process start.
func (b *kafkaBroker) waitReady(t *testing.T, timeout time.Duration) time.Duration {
	t.Helper()
	exited := errors.New("exited")
	err := wait.Until(timeout, func() error {
		if !b.proc.running() {
			return exited
		}
		return b.ready()
	})
	switch {
	case errors.Is(err, exited):
		fatalf(t, "Kafka %s exited while starting: %v (log %s)", b.name, b.proc.err, b.proc.log)
	case err != nil:
		fatalf(t, "Kafka %s does not answer metadata %v after its start: %v", b.name, timeout, err)
	}
	return time.Since(b.began)
}

func saramaConfig(timeout time.Duration) *sarama.Config {
	c := sarama.NewConfig()
	c.Version = saramaVersion
	c.ClientID = "kswitch-integration"
	c.Net.DialTimeout, c.Net.ReadTimeout, c.Net.WriteTimeout = timeout, timeout, timeout
	c.Metadata.Retry.Max = 1
	c.Metadata.Retry.Backoff = 100 * time.Millisecond
	c.Metadata.AllowAutoTopicCreation = false
	return c
}

// createTopic creates topic with n partitions on the broker.
func (b *kafkaBroker) createTopic(t *testing.T, topic string, n int32) {
	t.Helper()
	b.createTopicWith(t, topic, n, nil)
}

// createTopicWith is createTopic with topic configuration entries. The
// topic is replicated on min(nodes, 3) of the broker's cluster.
func (b *kafkaBroker) createTopicWith(t *testing.T, topic string, n int32, config map[string]string) {
	t.Helper()
	adm, err := sarama.NewClusterAdmin([]string{b.addr}, saramaConfig(5*time.Second))
	if err != nil {
		fatal(t, err)
	}
	defer adm.Close()
	var entries map[string]*string
	for k, v := range config {
		if entries == nil {
			entries = map[string]*string{}
		}
		entries[k] = &v
	}
	if err := adm.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: n, ReplicationFactor: int16(min(b.nodes, 3)), ConfigEntries: entries}, false); err != nil {
		fatalf(t, "kafka %s: create topic %s: %v", b.name, topic, err)
	}
}

// endOffsets returns the high watermark of every partition of topic, read
// with a fresh connection (the result must not come from a stale cache).
func endOffsets(addr, topic string) (map[int32]int64, error) {
	cl, err := sarama.NewClient([]string{addr}, saramaConfig(3*time.Second))
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	ps, err := cl.Partitions(topic)
	if err != nil {
		return nil, fmt.Errorf("%s on %s: %w", topic, addr, err)
	}
	out := map[int32]int64{}
	for _, p := range ps {
		o, err := cl.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return nil, fmt.Errorf("%s/%d on %s: %w", topic, p, addr, err)
		}
		out[p] = o
	}
	return out, nil
}

// groupOffsets returns what group has committed on the broker for topic's
// partitions (-1: nothing), with an OffsetFetch as Kafka's own tools send it.
func groupOffsets(addr, group, topic string, partitions int32) (map[int32]int64, error) {
	adm, err := sarama.NewClusterAdmin([]string{addr}, saramaConfig(3*time.Second))
	if err != nil {
		return nil, err
	}
	defer adm.Close()
	var ps []int32
	for p := range partitions {
		ps = append(ps, p)
	}
	resp, err := adm.ListConsumerGroupOffsets(group, map[string][]int32{topic: ps})
	if err != nil {
		return nil, err
	}
	out := map[int32]int64{}
	for _, p := range ps {
		blk := resp.GetBlock(topic, p)
		if blk == nil {
			return nil, fmt.Errorf("group %s: no answer for %s/%d", group, topic, p)
		}
		if blk.Err != sarama.ErrNoError {
			return nil, fmt.Errorf("group %s: %s/%d: %w", group, topic, p, blk.Err)
		}
		out[p] = blk.Offset
	}
	return out, nil
}

// mirrorMaker is a dedicated MirrorMaker 2 process replicating A to B.
type mirrorMaker struct {
	proc  *proc
	began time.Time
}

// Replication policies of MirrorMaker 2 and kswitch's names for them.
type replicationPolicy struct {
	kswitch   string // clusters.B.replication_policy
	class     string // MirrorMaker 2's replication.policy.class
	remote    string // the name of A's topic "orders" on B
	syncTopic string // the offset-syncs topic (on B: offset-syncs.topic.location=target)
}

// remoteOf is the name on B of A's topic under the policy.
func (p replicationPolicy) remoteOf(topic string) string {
	if p == identityPolicy {
		return topic
	}
	return "A." + topic
}

var (
	prefixPolicy = replicationPolicy{kswitch: "prefix", class: "org.apache.kafka.connect.mirror.DefaultReplicationPolicy",
		remote: "A.orders", syncTopic: "mm2-offset-syncs.A.internal"}
	identityPolicy = replicationPolicy{kswitch: "identity", class: "org.apache.kafka.connect.mirror.IdentityReplicationPolicy",
		remote: "orders", syncTopic: "mm2-offset-syncs.A.internal"}
)

// mm2OneBroker gives every topic MirrorMaker 2 creates one replica: the
// suite's clusters have one broker each.
const mm2OneBroker = `replication.factor = 1
checkpoints.topic.replication.factor = 1
heartbeats.topic.replication.factor = 1
offset-syncs.topic.replication.factor = 1
offset.storage.replication.factor = 1
status.storage.replication.factor = 1
config.storage.replication.factor = 1
`

// startMirrorMaker runs MirrorMaker 2 from a to b: topic orders and group
// orders, intervals of a second, offset-syncs for every record, kept on b.
func startMirrorMaker(t *testing.T, env kafkaEnv, a, b *kafkaBroker, policy replicationPolicy) *mirrorMaker {
	t.Helper()
	return startMirrorMakerWith(t, env, a, b, policy, false)
}

// startMirrorMakerWith is startMirrorMaker, with the flow back from b to
// a as well when twoWay (one process, two flows, each configured like
// the other): b's orders is copied to a as B.orders, its offset-syncs
// kept on a (mm2-offset-syncs.B.internal), its checkpoints of group
// orders in B.checkpoints.internal on a. Only with the default policy:
// identity names both ways would copy each record round and round.
// extraTopics are more of a's topics copied from a to b beside orders
// (the flow back copies orders alone).
func startMirrorMakerWith(t *testing.T, env kafkaEnv, a, b *kafkaBroker, policy replicationPolicy, twoWay bool, extraTopics ...string) *mirrorMaker {
	t.Helper()
	if twoWay && policy != prefixPolicy {
		fatalf(t, "MirrorMaker 2 both ways needs the default replication policy, not %s", policy.class)
	}
	// A comma-separated list of patterns, each matching whole topic names.
	topics := strings.Join(append([]string{"orders"}, extraTopics...), ", ")
	back := "B->A.enabled = false\nB->A.emit.heartbeats.enabled = false\n"
	if twoWay {
		back = "B->A.enabled = true\nB->A.topics = orders\nB->A.groups = orders\n"
	}
	dir := t.TempDir()
	conf := filepath.Join(dir, "mm2.properties")
	props := fmt.Sprintf(`clusters = A, B
A.bootstrap.servers = %s
B.bootstrap.servers = %s
A->B.enabled = true
A->B.topics = %s
A->B.groups = orders
%sreplication.policy.class = %s
%s# the offset syncs on the target of each flow (B for A->B), where they
# can be read while the source is down
offset-syncs.topic.location = target
# a sync per record, checkpoints and topic/group discovery every second
offset.lag.max = 0
emit.checkpoints.interval.seconds = 1
emit.heartbeats.interval.seconds = 1
refresh.topics.interval.seconds = 1
refresh.groups.interval.seconds = 1
sync.group.offsets.enabled = false
B.offset.flush.interval.ms = 1000
# every plugin has a ServiceLoader manifest: skip the classpath scan
plugin.discovery = service_load
`, a.addr, b.addr, topics, back, policy.class, mm2OneBroker)
	if err := os.WriteFile(conf, []byte(props), 0o644); err != nil {
		fatal(t, err)
	}
	m := &mirrorMaker{began: time.Now()}
	m.proc = startProc(t, "mirrormaker", env.java,
		append(env.jvmArgs("384m", dir, "org.apache.kafka.connect.mirror.MirrorMaker"), conf)...)
	return m
}

// kcat runs kcat to completion and returns its standard output.
func kcat(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "kcat", args...)
	var out, errOut strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("kcat %s: %w: %s", strings.Join(args, " "), err, errOut.String())
	}
	return out.String(), nil
}

// kRecord is one record read back with kcat.
type kRecord struct {
	Partition int32
	Offset    int64
	Key       string
	Value     string
}

// readTopic reads every record of topic on addr with kcat, up to the end
// of each partition at the time of reading, by partition in offset order.
func readTopic(addr, topic string) (map[int32][]kRecord, error) {
	return readTopicWith(addr, topic)
}

// readCommitted is readTopic as a read_committed consumer sees the topic:
// no aborted transaction's records, up to the last stable offset.
func readCommitted(addr, topic string) (map[int32][]kRecord, error) {
	return readTopicWith(addr, topic, "-X", "isolation.level=read_committed")
}

func readTopicWith(addr, topic string, extra ...string) (map[int32][]kRecord, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// Tab-separated; keys and values of the suite hold no tabs or newlines.
	args := append([]string{"-C", "-b", addr, "-t", topic, "-o", "beginning", "-e", "-q",
		"-f", `%p\t%o\t%k\t%s\n`, "-X", "fetch.wait.max.ms=50"}, extra...)
	out, err := kcat(ctx, args...)
	if err != nil {
		return nil, err
	}
	recs := map[int32][]kRecord{}
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		f := strings.Split(sc.Text(), "\t")
		if len(f) != 4 {
			return nil, fmt.Errorf("kcat line %q: want 4 tab-separated fields", sc.Text())
		}
		p, err1 := strconv.ParseInt(f[0], 10, 32)
		o, err2 := strconv.ParseInt(f[1], 10, 64)
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("kcat line %q: bad partition or offset", sc.Text())
		}
		recs[int32(p)] = append(recs[int32(p)], kRecord{Partition: int32(p), Offset: o, Key: f[2], Value: f[3]})
	}
	return recs, sc.Err()
}

// producer feeds numbered records to one kcat -P process at a steady rate:
// the outside client writing to cluster A. Record i has key k<i> (which
// spreads records over the partitions) and value r<i>, zero-padded. kcat's
// idempotent producer retries through an outage of the broker and delivers
// what it holds once the broker is back; what is on A is the truth the
// verdict reads back, not what was handed to kcat.
type producer struct {
	stdin *os.File
	proc  *proc
	stop  chan struct{}
	done  chan struct{}
	mu    sync.Mutex
	next  int // records handed to kcat
	// handing is the end of the batch being written to kcat: records
	// numbered from it on have not been handed over yet.
	handing int
}

func startProducer(t *testing.T, addr, topic string, perSecond int) *producer {
	t.Helper()
	return startNamedProducer(t, "", addr, topic, perSecond)
}

// startNamedProducer is startProducer for one of several producers (or
// stints of one) in a scenario: its records are k-<name>-<i> and
// r-<name>-<i>, its kcat logs to kcat-producer-<name>.log.
func startNamedProducer(t *testing.T, name, addr, topic string, perSecond int) *producer {
	t.Helper()
	// An OS pipe, not io.Pipe: once kcat is gone, writes fail (EPIPE)
	// instead of blocking.
	r, w, err := os.Pipe()
	if err != nil {
		fatal(t, err)
	}
	pr := &producer{stdin: w, stop: make(chan struct{}), done: make(chan struct{})}
	procName, tag := "kcat-producer", ""
	if name != "" {
		procName, tag = procName+"-"+name, "-"+name+"-"
	}
	// -E: keep going when the broker is down ("all brokers down" is not
	// fatal); the idempotent producer retries until message.timeout.ms.
	pr.proc = startProcWith(t, procOptions{Stdin: r}, procName, "kcat", "-P", "-E", "-b", addr, "-t", topic, "-K", "\t",
		"-X", "enable.idempotence=true", "-X", "linger.ms=5", "-X", "message.timeout.ms=600000")
	r.Close()
	go func() {
		defer close(pr.done)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		start := time.Now()
		for {
			select {
			case <-pr.stop:
				return
			case <-tick.C:
			}
			due := int(time.Since(start).Seconds() * float64(perSecond))
			var b strings.Builder
			pr.mu.Lock()
			from := pr.next
			for i := from; i < due; i++ {
				fmt.Fprintf(&b, "k%s%07d\tr%s%07d\n", tag, i, tag, i)
			}
			pr.handing = max(pr.handing, due)
			pr.mu.Unlock()
			if _, err := io.WriteString(w, b.String()); err != nil {
				return
			}
			pr.mu.Lock()
			pr.next = max(pr.next, due)
			pr.mu.Unlock()
		}
	}()
	t.Cleanup(pr.close)
	return pr
}

func (pr *producer) count() int {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	return pr.next
}

// notHandedYet returns the number of the first record not yet handed to
// kcat, nor being handed: that record and every later one reach A, and so
// the fleet, only after the call.
func (pr *producer) notHandedYet() int {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	return max(pr.next, pr.handing)
}

// close stops feeding records and closes kcat's input: kcat then delivers
// what it holds and exits.
func (pr *producer) close() {
	select {
	case <-pr.stop:
	default:
		close(pr.stop)
	}
	<-pr.done
	pr.proc.expected.Store(true) // kcat ends at the end of its input
	_ = pr.stdin.Close()         // a second Close returns an error: ignored
}

// crash kills kcat (SIGKILL) and stops feeding it: a producer that dies
// with its data centre. What it held unacknowledged is gone; what the
// broker acknowledged is on the broker, which the verdict reads back.
func (pr *producer) crash(t *testing.T) {
	t.Helper()
	stopProc(t, pr.proc, syscall.SIGKILL)
	pr.close()
}

// finish closes the producer and waits for kcat to deliver everything.
func (pr *producer) finish(t *testing.T, timeout time.Duration) {
	t.Helper()
	pr.close()
	if err := pr.proc.wait(timeout); err != nil {
		fatalf(t, "kcat producer: %v", err)
	}
}

// stopProc freezes (SIGSTOP) or kills (SIGKILL) a process; for SIGKILL it
// waits until the process is gone.
func stopProc(t *testing.T, p *proc, sig syscall.Signal) {
	t.Helper()
	p.signal(sig)
	if sig == syscall.SIGKILL {
		if err := p.wait(10 * time.Second); err == nil || p.running() {
			fatalf(t, "%s survived SIGKILL: %v", p.name, err)
		}
	}
}

// checkpoint is MirrorMaker 2's translation of a group's committed offset:
// upstream (on A) to downstream (on B).
type checkpoint struct {
	Upstream, Downstream int64
}

// readCheckpoints reads MirrorMaker 2's checkpoints topic on addr and
// returns the last checkpoint of group per (downstream topic, partition).
// The record format is MirrorMaker 2's (Kafka protocol types): key = group
// STRING, topic STRING, partition INT32; value = version INT16, upstream
// offset INT64, downstream offset INT64, metadata STRING.
func readCheckpoints(addr, topic, group string) (map[string]map[int32]checkpoint, error) {
	cl, err := sarama.NewClient([]string{addr}, saramaConfig(3*time.Second))
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	cons, err := sarama.NewConsumerFromClient(cl)
	if err != nil {
		return nil, err
	}
	defer cons.Close()
	ps, err := cl.Partitions(topic)
	if err != nil {
		return nil, err
	}
	out := map[string]map[int32]checkpoint{}
	for _, p := range ps {
		end, err := cl.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return nil, err
		}
		if end == 0 {
			continue
		}
		pc, err := cons.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			return nil, err
		}
		timeout := time.After(10 * time.Second)
	read:
		for {
			select {
			case m := <-pc.Messages():
				g, tp, part, ok := decodeCheckpointKey(m.Key)
				if ok && g == group && len(m.Value) >= 18 {
					if out[tp] == nil {
						out[tp] = map[int32]checkpoint{}
					}
					out[tp][part] = checkpoint{
						Upstream:   int64(binary.BigEndian.Uint64(m.Value[2:10])),
						Downstream: int64(binary.BigEndian.Uint64(m.Value[10:18])),
					}
				}
				if m.Offset >= end-1 {
					break read
				}
			case <-timeout:
				pc.Close()
				return nil, fmt.Errorf("reading %s/%d up to %d: timed out", topic, p, end)
			}
		}
		pc.Close()
	}
	return out, nil
}

func decodeCheckpointKey(k []byte) (group, topic string, partition int32, ok bool) {
	str := func() (string, bool) {
		if len(k) < 2 {
			return "", false
		}
		n := int(binary.BigEndian.Uint16(k))
		if len(k) < 2+n {
			return "", false
		}
		s := string(k[2 : 2+n])
		k = k[2+n:]
		return s, true
	}
	var ok1, ok2 bool
	group, ok1 = str()
	topic, ok2 = str()
	if !ok1 || !ok2 || len(k) < 4 {
		return "", "", 0, false
	}
	return group, topic, int32(binary.BigEndian.Uint32(k)), true
}

//go:build integration

package integration

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// Ordinary accidents of real clusters, each judged from outside
// by reading the sink back with kcat: a record larger than its channel and
// dead-letter topics accept, a source topic deleted and
// re-created, and the channel's broker stopped and killed under
// load.

const (
	// bigValueBytes is the size of the oversized record's value: under the
	// source's limit (the broker's message.max.bytes, 1 MiB by default)
	// and under sarama's Producer.MaxMessageBytes (1 000 000), so that the
	// sink's broker refuses it (MESSAGE_TOO_LARGE), not the agent's client.
	bigValueBytes = 300_000
	// sinkMaxMessageBytes is max.message.bytes of the channel and
	// dead-letter topics in TestOversizedRecordOnRealKafka.
	sinkMaxMessageBytes = 100_000
	// referenceValueMax is the most of a refused record's value that its
	// reference on the dead-letter topic may carry.
	referenceValueMax = 16 << 10
	// bigPartition is the source partition the oversized record is
	// written to, between ordinary records.
	bigPartition = 1
	// bigKey is the oversized record's key.
	bigKey = "oversized"
	// burstRecords ordinary records are written just before the
	// oversized one into its partition, and as many just after.
	burstRecords = 1000
	// recreatedPartitions is the partition count of orders re-created
	// (it had ordersPartitions).
	recreatedPartitions = 6
	// sinkOutage is how long the channel's broker stays down, from the
	// signal to its start again.
	sinkOutage = 15 * time.Second
	// outageRate is the producer's records per second in
	// TestSinkOutageKeepsOrderOnRealKafka.
	outageRate = 200
)

// TestOversizedRecordOnRealKafka: the channel topic
// and the dead-letter topic on B take at most 100 000 bytes
// (max.message.bytes); kcat writes ordinary records to A and, in the
// middle of partition 1, amid a burst of 2 000 ordinary records, one
// record of 300 000 bytes, which A accepts and B's broker refuses on both
// topics. Read back with kcat: every ordinary
// record is on the channel in source order per partition; the dead-letter
// topic holds one record, a reference to the big one (kswitch-size,
// kswitch-truncated, kswitch-source, kswitch-source-cluster, kswitch-error,
// the value cut to 16 KiB); the fleet's position of partition 1 moved
// past it and the records after it were delivered. routing.refused is
// left at its default (reference).
func TestOversizedRecordOnRealKafka(t *testing.T) {
	rep := newReport("oversized-record")
	rep.Covers = "a 300 000-byte record the channel and dead-letter topics refuse (max.message.bytes 100 000): a reference dead-lettered, the partition moves on"
	defer func() {
		rep.Passed = !t.Failed()
		addReport(rep)
	}()
	timed := rep.timer(t)
	// A's orders takes records up to the broker's message.max.bytes,
	// 1 MiB by default.
	st := startStack(t, timed, prefixPolicy, false)
	limit := map[string]string{"max.message.bytes": strconv.Itoa(sinkMaxMessageBytes)}
	st.b.createTopicWith(t, "bounded", ordersPartitions, limit)
	st.b.createTopicWith(t, "bounded-dead", 1, limit)
	conf := st.agentConfig()
	conf.Extra = routingTo("B", "bounded", "bounded-dead")
	agents := startFleet(t, conf)
	prod := startProducer(t, st.a.addr, "orders", produceRate)
	st.moving(t, "the fleet consumes every partition of A", time.Minute)

	// The big record comes in a burst of ordinary ones in its partition,
	// as it would at any real rate: the agent consumes them in one fetch
	// and its producer batches them with it.
	big := randomText(t, bigValueBytes)
	var burst strings.Builder
	for i := range 2 * burstRecords {
		if i == burstRecords {
			fmt.Fprintf(&burst, "%s\t%s\n", bigKey, big)
		}
		fmt.Fprintf(&burst, "k-burst-%07d\tr-burst-%07d\n", i, i)
	}
	file := filepath.Join(t.TempDir(), "burst")
	if err := os.WriteFile(file, []byte(burst.String()), 0o644); err != nil {
		fatal(t, err)
	}
	written := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	_, err := kcat(ctx, "-P", "-b", st.a.addr, "-t", "orders", "-p", strconv.Itoa(bigPartition), "-K", "\t", "-l", file)
	cancel()
	if err != nil {
		fatal(t, err)
	}
	source, err := readTopic(st.a.addr, "orders")
	if err != nil {
		fatal(t, err)
	}
	bigAt := int64(-1)
	for _, r := range source[bigPartition] {
		if r.Key == bigKey {
			bigAt = r.Offset
			if r.Value != big {
				fatalf(t, "A holds a %d-byte value at orders/%d@%d, kcat wrote %d bytes", len(r.Value), bigPartition, r.Offset, len(big))
			}
		}
	}
	if bigAt < 0 {
		fatalf(t, "the %d-byte record is not on A's orders/%d", len(big), bigPartition)
	}
	t.Logf("the %d-byte record is orders/%d@%d on A", len(big), bigPartition, bigAt)

	// The partition moves on: its position passes the big record and
	// records after it.
	const after = 20
	waitFor(t, time.Minute, fmt.Sprintf("the fleet commits orders/%d past the big record at %d and %d records after it", bigPartition, bigAt, after), func() error {
		if c := st.tl.offsets("A", "orders")[bigPartition]; c.Offset <= bigAt+after {
			return fmt.Errorf("orders/%d committed at %d", bigPartition, c.Offset)
		}
		return nil
	})
	timed("position_past_big_record", time.Since(written))

	prod.finish(t, time.Minute)
	ends, err := endOffsets(st.a.addr, "orders")
	if err != nil {
		fatal(t, err)
	}
	waitFor(t, time.Minute, "the fleet consumes all of A", func() error { return st.tl.caughtUp("A", "orders", ends) })
	if source, err = readTopic(st.a.addr, "orders"); err != nil {
		fatal(t, err)
	}
	channel, err := readTopic(st.b.addr, "bounded")
	if err != nil {
		fatal(t, err)
	}
	ov := judgeOrder(source, func(r kRecord) bool { return r.Key != bigKey }, channel)
	rep.Records, rep.Delivered, rep.LostCount, rep.Lost, rep.Duplicates = ov.Records, ov.Delivered, ov.LostCount, ov.Lost, ov.Duplicates
	later := 0
	for _, r := range source[bigPartition] {
		if r.Offset > bigAt {
			later++
		}
	}
	reordered := ov.requireCounted(t, "the channel", agents)
	d := fmt.Sprintf("ordinary records: %s; %d of them after the big record in orders/%d; kswitch_routing_reordered_total over the agents: %v",
		ov, later, bigPartition, reordered)
	rep.Details = append(rep.Details, d)
	t.Log(d)
	if later < after {
		errorf(t, "only %d records after the big record in orders/%d: the scenario did not show the partition moving on", later, bigPartition)
	}
	for _, recs := range channel {
		for _, r := range recs {
			if r.Key == bigKey {
				errorf(t, "the channel took the %d-byte record (bounded/%d@%d): B's broker did not refuse it", len(r.Value), r.Partition, r.Offset)
			}
		}
	}

	// The dead-letter topic: one reference.
	dead, err := readEnvelopes(st.b.addr, "bounded-dead")
	if err != nil {
		fatal(t, err)
	}
	source1 := fmt.Sprintf("orders/%d@%d", bigPartition, bigAt)
	if len(dead) != 1 {
		errorf(t, "the dead-letter topic holds %d records, want 1 (the reference to %s): %s", len(dead), source1, describeEnvelopes(dead))
	}
	i := slices.IndexFunc(dead, func(e envelope) bool { return e.headers()["kswitch-source"] == source1 })
	if i < 0 {
		errorf(t, "no reference to %s on the dead-letter topic", source1)
	} else {
		e := dead[i]
		h := e.headers()
		t.Logf("dead letter bounded-dead/%d@%d: key %q, value %d bytes, headers %q", e.Partition, e.Offset, e.key(), len(e.value()), h)
		want := map[string]string{
			"kswitch-size":           strconv.Itoa(len(big)),
			"kswitch-truncated":      "true",
			"kswitch-source-cluster": "A",
		}
		for _, k := range sortedKeys(want) {
			if h[k] != want[k] {
				errorf(t, "the reference: header %s is %q, want %q", k, h[k], want[k])
			}
		}
		switch reason := h["kswitch-error"]; {
		case reason == "":
			errorf(t, "the reference has no kswitch-error")
		case strings.Contains(reason, "MaxMessageBytes") || !strings.Contains(reason, "kafka server:"):
			// sarama's errors from a broker's answer say "kafka server:".
			errorf(t, "the reference's kswitch-error %q is not B's broker refusing the record: the sizes miss the real case", reason)
		}
		if v := e.value(); len(v) > referenceValueMax || !strings.HasPrefix(big, v) {
			errorf(t, "the reference's value: %d bytes (at most %d), the start of the big one: %v", len(v), referenceValueMax, strings.HasPrefix(big, v))
		}
		rep.Details = append(rep.Details, fmt.Sprintf("dead letter: a reference to %s, value %d of %d bytes, kswitch-error %q",
			source1, len(e.value()), len(big), h["kswitch-error"]))
	}
	for _, reason := range []string{"produce", "reference", "dropped"} {
		series := fmt.Sprintf("kswitch_routing_dead_lettered_total{reason=%q}", reason)
		if n, _, err := counterSum(agents, series); err == nil {
			t.Logf("%s over the agents: %v", series, n)
		}
	}
	timed("scenario", time.Since(st.began))
}

// TestRecreatedSourceTopicOnRealKafka: while the fleet
// consumes orders on A and kcat writes to it, orders is deleted (a
// DeleteTopics request, as kafka-topics --delete sends) and created again
// with 6 partitions instead of 4; a second producer writes to the new
// topic (r-new-…). Read back with kcat: every record of the new topic is
// on the channel (delivered-wide on B, 8 partitions,
// manual-same-partition), in source order per partition.
func TestRecreatedSourceTopicOnRealKafka(t *testing.T) {
	rep := newReport("recreated-source-topic")
	rep.Covers = "orders deleted and re-created with 6 partitions (was 4) while consumed and written: the new topic consumed from its start"
	defer func() {
		rep.Passed = !t.Failed()
		addReport(rep)
	}()
	timed := rep.timer(t)
	st := startStack(t, timed, prefixPolicy, false)
	st.b.createTopic(t, "delivered-wide", 8)
	conf := st.agentConfig()
	conf.Extra = routingTo("B", "delivered-wide", "")
	agents := startFleet(t, conf)
	old := startNamedProducer(t, "old", st.a.addr, "orders", produceRate)
	st.moving(t, "the fleet consumes every partition of A", time.Minute)

	oldPositions := offsetsOf(st.tl.offsets("A", "orders"))
	deleted := time.Now()
	if err := deleteTopic(st.a.addr, "orders"); err != nil {
		fatal(t, err)
	}
	// The producer of the old topic dies with it: what it still held
	// would go to a topic that no longer exists.
	old.crash(t)
	waitFor(t, 30*time.Second, "orders gone from A's metadata", func() error { return topicAbsent(st.a.addr, "orders") })
	// The fleet's last positions in the old topic: it can consume nothing
	// more of it.
	for p, c := range st.tl.offsets("A", "orders") {
		oldPositions[p] = max(oldPositions[p], c.Offset)
	}
	st.a.createTopic(t, "orders", recreatedPartitions)
	recreated := time.Now()
	timed("recreated_after_delete", recreated.Sub(deleted))
	nw := startNamedProducer(t, "new", st.a.addr, "orders", produceRate)
	waitFor(t, time.Minute, fmt.Sprintf("the fleet commits every one of the %d partitions of the new orders", recreatedPartitions), func() error {
		return committedSince(st.tl, recreated, "A", "orders", recreatedPartitions)
	})
	timed("new_topic_every_partition_committed", time.Since(recreated))
	// The new topic grows past the positions the fleet held in the old
	// one, so that a fleet resuming at its old positions would skip
	// records (it could not merely find them beyond the end).
	const past = 20
	waitFor(t, time.Minute, fmt.Sprintf("the new orders grows %d records past the old positions", past), func() error {
		ends, err := endOffsets(st.a.addr, "orders")
		if err != nil {
			return err
		}
		for p, pos := range oldPositions {
			if ends[p] < pos+past {
				return fmt.Errorf("orders/%d ends at %d, the old position was %d", p, ends[p], pos)
			}
		}
		return nil
	})
	nw.finish(t, time.Minute)
	ends, err := endOffsets(st.a.addr, "orders")
	if err != nil {
		fatal(t, err)
	}
	if len(ends) != recreatedPartitions {
		errorf(t, "orders has %d partitions on A, want %d", len(ends), recreatedPartitions)
	}
	// Not fatal: the verdict below says what a fleet that did not catch
	// up left out.
	if err := wait.Until(time.Minute, func() error {
		if err := committedSince(st.tl, recreated, "A", "orders", recreatedPartitions); err != nil {
			return err
		}
		return st.tl.caughtUp("A", "orders", ends)
	}); err != nil {
		errorf(t, "the fleet does not consume all of the new orders: %v", err)
	}
	source, err := readTopic(st.a.addr, "orders")
	if err != nil {
		fatal(t, err)
	}
	channel, err := readTopic(st.b.addr, "delivered-wide")
	if err != nil {
		fatal(t, err)
	}
	ov := judgeOrder(source, func(kRecord) bool { return true }, channel)
	rep.Records, rep.Delivered, rep.LostCount, rep.Lost, rep.Duplicates = ov.Records, ov.Delivered, ov.LostCount, ov.Lost, ov.Duplicates
	notNew := 0
	for _, recs := range source {
		for _, r := range recs {
			if producerOf(r.Value) != "new" {
				notNew++
			}
		}
	}
	if notNew > 0 {
		errorf(t, "the new orders holds %d records not written by the new producer", notNew)
	}
	oldDelivered := map[string]bool{}
	for _, recs := range channel {
		for _, r := range recs {
			if producerOf(r.Value) == "old" {
				oldDelivered[r.Value] = true
			}
		}
	}
	d := fmt.Sprintf("new topic (%d partitions, ends %v; the fleet's positions in the old one %v): %s; old topic: %d records handed to kcat before the deletion, %d of them on the channel",
		len(ends), ends, oldPositions, ov, old.count(), len(oldDelivered))
	rep.Details = append(rep.Details, d)
	t.Log(d)
	ov.require(t, "the channel")
	for _, series := range []string{`kswitch_source_topic_recreated_total{cluster="A",topic="orders"}`, `kswitch_partition_restarts_total{cluster="A",reason="recreated"}`} {
		if n, _, err := counterSum(agents, series); err == nil {
			t.Logf("%s over the agents: %v", series, n)
		}
	}
	for _, key := range latestUnder(st.tl, "history/topics/") {
		t.Logf("etcd %s%s: %s", fleetPrefix, key[0], key[1])
	}
	timed("scenario", time.Since(st.began))
}

// TestSinkOutageKeepsOrderOnRealKafka: the fleet
// routes every record to the channel ordered on a third cluster, C (one
// broker, role sink), in the partition it came from, while kcat writes to
// A at 200 records a second. C's broker is stopped (SIGTERM) and started
// again 15 s later, then killed (SIGKILL) and started again 15 s later.
// Read back with kcat: every record of A is on the channel; duplicates are
// reported; a record whose first copy lands after a later record of its
// source partition is out of order, and every one must be accounted for
// by kswitch_routing_reordered_total over the agents (the overtakings
// inside sarama's producer the router cannot prevent, only count).
func TestSinkOutageKeepsOrderOnRealKafka(t *testing.T) {
	rep := newReport("sink-outage-order")
	rep.Covers = "the channel's broker (cluster C) SIGTERM for 15 s, then SIGKILL for 15 s, at 200 records/s: 0 lost, order per source partition"
	defer func() {
		rep.Passed = !t.Failed()
		addReport(rep)
	}()
	timed := rep.timer(t)
	// C formats its storage while the stack starts.
	type formatted struct {
		b   *kafkaBroker
		err error
	}
	env, logs, dir := kafkaTools(t), logDir(t), filepath.Join(t.TempDir(), "kafka-C")
	cReady := make(chan formatted, 1)
	go func() {
		b, err := newKafkaBroker(env, "C", dir, logs)
		cReady <- formatted{b, err}
	}()
	st := startStack(t, timed, prefixPolicy, false)
	f := <-cReady
	if f.err != nil {
		fatal(t, f.err)
	}
	c := f.b
	c.start(t)
	timed("kafka_c_ready", c.waitReady(t, 2*time.Minute))
	c.createTopic(t, "ordered", ordersPartitions)
	conf := st.agentConfig()
	conf.Clusters += fmt.Sprintf("  C: {brokers: [%s], role: sink, version: %q}\n", c.addr, kafkaVersion)
	conf.Extra = routingTo("C", "ordered", "")
	agents := startFleet(t, conf)
	prod := startProducer(t, st.a.addr, "orders", outageRate)
	st.moving(t, "the fleet consumes every partition of A", time.Minute)

	for _, fault := range []struct {
		name string
		sig  syscall.Signal
	}{{"sigterm", syscall.SIGTERM}, {"sigkill", syscall.SIGKILL}} {
		down := time.Now()
		c.proc.signal(fault.sig)
		_ = c.proc.wait(time.Minute)
		if c.proc.running() {
			fatalf(t, "Kafka C still runs a minute after %s", fault.name)
		}
		timed(fault.name+"_c_exited", time.Since(down))
		// The outage's length is the scenario's, not a condition.
		time.Sleep(time.Until(down.Add(sinkOutage)))
		c.start(t)
		timed(fault.name+"_c_ready_again", c.waitReady(t, 2*time.Minute))
		back := time.Now()
		want, err := endOffsets(st.a.addr, "orders")
		if err != nil {
			fatal(t, err)
		}
		waitFor(t, 90*time.Second, "the fleet delivers what A held when C was back after "+fault.name, func() error {
			got := offsetsOf(st.tl.offsets("A", "orders"))
			for p, end := range want {
				if got[p] < end {
					return fmt.Errorf("orders/%d committed at %d, A held %d", p, got[p], end)
				}
			}
			return nil
		})
		timed(fault.name+"_caught_up", time.Since(back))
	}

	prod.finish(t, time.Minute)
	ends, err := endOffsets(st.a.addr, "orders")
	if err != nil {
		fatal(t, err)
	}
	waitFor(t, time.Minute, "the fleet consumes all of A", func() error { return st.tl.caughtUp("A", "orders", ends) })
	source, err := readTopic(st.a.addr, "orders")
	if err != nil {
		fatal(t, err)
	}
	channel, err := readTopic(c.addr, "ordered")
	if err != nil {
		fatal(t, err)
	}
	ov := judgeOrder(source, func(kRecord) bool { return true }, channel)
	rep.Records, rep.Delivered, rep.LostCount, rep.Lost, rep.Duplicates = ov.Records, ov.Delivered, ov.LostCount, ov.Lost, ov.Duplicates
	d := fmt.Sprintf("%s; kswitch_routing_reordered_total over the agents: %v", ov, ov.requireCounted(t, "the channel", agents))
	rep.Details = append(rep.Details, d)
	t.Log(d)
	timed("scenario", time.Since(st.began))
}

// startFleet starts three agents with conf.
func startFleet(t *testing.T, conf agentConfig) []*agentProc {
	t.Helper()
	var agents []*agentProc
	for i := 1; i <= 3; i++ {
		agents = append(agents, startAgentWith(t, fmt.Sprintf("agent-%d", i), conf))
	}
	return agents
}

// routingTo is the agents' routing section: every record to the channel
// sink, topic on cluster, in the partition it came from; with deadLetter,
// the dead-letter channel dead, that topic on the same cluster.
func routingTo(cluster, topic, deadLetter string) string {
	s := fmt.Sprintf("routing:\n  default: [sink]\n  channels:\n    sink: {cluster: %s, topic: %s, partitioner: manual-same-partition}\n", cluster, topic)
	if deadLetter != "" {
		s += fmt.Sprintf("    dead: {cluster: %s, topic: %s}\n  dead_letter: dead\n", cluster, deadLetter)
	}
	return s
}

// randomText returns n bytes of base64 text from random bytes: no tab or
// newline (kcat's framing), and no compression brings it near a tenth.
func randomText(t *testing.T, n int) string {
	t.Helper()
	raw := make([]byte, base64.StdEncoding.DecodedLen(n)+3)
	if _, err := rand.Read(raw); err != nil {
		fatal(t, err)
	}
	return base64.StdEncoding.EncodeToString(raw)[:n]
}

// deleteTopic deletes topic on the broker at addr.
func deleteTopic(addr, topic string) error {
	adm, err := sarama.NewClusterAdmin([]string{addr}, saramaConfig(5*time.Second))
	if err != nil {
		return err
	}
	defer adm.Close()
	if err := adm.DeleteTopic(topic); err != nil {
		return fmt.Errorf("delete topic %s on %s: %w", topic, addr, err)
	}
	return nil
}

// topicAbsent returns nil once a fresh metadata request to addr does not
// list topic.
func topicAbsent(addr, topic string) error {
	cl, err := sarama.NewClient([]string{addr}, saramaConfig(3*time.Second))
	if err != nil {
		return err
	}
	defer cl.Close()
	topics, err := cl.Topics()
	if err != nil {
		return err
	}
	if slices.Contains(topics, topic) {
		return fmt.Errorf("%s still listed on %s", topic, addr)
	}
	return nil
}

// committedSince returns nil when the fleet has committed each of the
// first n partitions of cluster/topic since the time given.
func committedSince(tl *timeline, since time.Time, cluster, topic string, n int32) error {
	var missing []int32
	for p := range n {
		key := fmt.Sprintf("offsets/%s/%s/%d", cluster, topic, p)
		if _, ok := tl.first(since, func(ev event) bool { return ev.Key == key && !ev.Deleted }); !ok {
			missing = append(missing, p)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%s/%s partitions %v not committed since %s (committed: %v)", cluster, topic, missing, since.Format("15:04:05.000"), offsetsOf(tl.offsets(cluster, topic)))
	}
	return nil
}

// latestUnder returns the keys under prefix (without the fleet's prefix)
// and their values as the suite's watch last saw them, in key order.
func latestUnder(tl *timeline, prefix string) [][2]string {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	var out [][2]string
	for _, k := range slices.Sorted(maps.Keys(tl.latest)) {
		if strings.HasPrefix(k, prefix) {
			out = append(out, [2]string{k, string(tl.latest[k])})
		}
	}
	return out
}

// orderVerdict is what a channel read back says of the records of a
// source topic: lost, duplicated, and out of order per source partition.
// The channel's partitioner is manual-same-partition, so the records of a
// source partition are in one channel partition, in the order they
// reached it.
type orderVerdict struct {
	// Records are the source records judged; Delivered their copies on
	// the channel, duplicates included.
	Records, Delivered int
	LostCount          int
	Lost               []string // at most 20
	Duplicates         int      // copies beyond the first
	// OutOfOrder counts the records whose first copy landed after a
	// later record of their source partition (OutOfOrderAt: at most 20).
	OutOfOrder   int
	OutOfOrderAt []string
	// WrongPartition counts copies in another channel partition than
	// their source partition.
	WrongPartition int
	// Others counts channel records that are not among those judged.
	Others int
}

func (v orderVerdict) String() string {
	return fmt.Sprintf("%d records, %d copies on the channel: %d lost, %d duplicates, %d out of order, %d in another partition, %d others",
		v.Records, v.Delivered, v.LostCount, v.Duplicates, v.OutOfOrder, v.WrongPartition, v.Others)
}

// require fails t unless nothing was lost, out of order or in the wrong
// partition.
func (v orderVerdict) require(t *testing.T, where string) {
	t.Helper()
	if v.LostCount > 0 {
		errorf(t, "%s lacks %d of %d records: %v", where, v.LostCount, v.Records, v.Lost)
	}
	if v.OutOfOrder > 0 {
		errorf(t, "%s holds %d records after a later record of their source partition: %s", where, v.OutOfOrder, strings.Join(v.OutOfOrderAt, "; "))
	}
	if v.WrongPartition > 0 {
		errorf(t, "%s holds %d records in another partition than their source's (manual-same-partition)", where, v.WrongPartition)
	}
}

// requireCounted is require, except that records out of order pass when
// the agents counted at least as many (kswitch_routing_reordered_total:
// records that sarama's producer let a later record of their partition
// overtake, when the broker refused their batch as too large or out of
// sequence; the router itself never produces behind a held record). It
// returns the agents' count.
func (v orderVerdict) requireCounted(t *testing.T, where string, agents []*agentProc) float64 {
	t.Helper()
	reordered, seen, err := counterSum(agents, "kswitch_routing_reordered_total")
	if err != nil {
		fatal(t, err)
	}
	if v.LostCount > 0 || v.WrongPartition > 0 {
		errorf(t, "%s lacks %d of %d records %v; %d in another partition than their source's", where, v.LostCount, v.Records, v.Lost, v.WrongPartition)
	}
	switch {
	case !seen:
		errorf(t, "no agent shows kswitch_routing_reordered_total; %d records out of order: %s", v.OutOfOrder, strings.Join(v.OutOfOrderAt, "; "))
	case float64(v.OutOfOrder) > reordered:
		errorf(t, "%s holds %d records after a later record of their partition, the agents counted %v: %s",
			where, v.OutOfOrder, reordered, strings.Join(v.OutOfOrderAt, "; "))
	case v.OutOfOrder > 0:
		t.Logf("NOTE (kswitch): %d records reached %s after a later record of their source partition, all counted by kswitch_routing_reordered_total (%v): %s",
			v.OutOfOrder, where, reordered, strings.Join(v.OutOfOrderAt, "; "))
	}
	return reordered
}

// judgeOrder judges the records of source (by partition, in offset order)
// that judged accepts against channel (read back the same way). Values
// name records: each must be unique in source.
func judgeOrder(source map[int32][]kRecord, judged func(kRecord) bool, channel map[int32][]kRecord) orderVerdict {
	var v orderVerdict
	at := map[string]kRecord{}
	for _, recs := range source {
		for _, r := range recs {
			if judged(r) {
				at[r.Value] = r
				v.Records++
			}
		}
	}
	copies := map[string]int{}
	// The latest source record seen first, by channel and source
	// partition: order holds within a channel partition.
	type pair struct{ channel, source int32 }
	last := map[pair]kRecord{}
	for _, p := range slices.Sorted(maps.Keys(channel)) {
		for _, c := range channel[p] {
			r, ok := at[c.Value]
			if !ok {
				v.Others++
				continue
			}
			v.Delivered++
			if c.Partition != r.Partition {
				v.WrongPartition++
			}
			if copies[c.Value]++; copies[c.Value] > 1 {
				v.Duplicates++
				continue
			}
			k := pair{c.Partition, r.Partition}
			if l, ok := last[k]; ok && r.Offset < l.Offset {
				v.OutOfOrder++
				if len(v.OutOfOrderAt) < 20 {
					v.OutOfOrderAt = append(v.OutOfOrderAt, fmt.Sprintf("orders/%d@%d at channel %d@%d after @%d", r.Partition, r.Offset, c.Partition, c.Offset, l.Offset))
				}
				continue
			}
			last[k] = r
		}
	}
	for _, p := range slices.Sorted(maps.Keys(source)) {
		for _, r := range source[p] {
			if judged(r) && copies[r.Value] == 0 {
				v.LostCount++
				if len(v.Lost) < 20 {
					v.Lost = append(v.Lost, fmt.Sprintf("orders/%d@%d", r.Partition, r.Offset))
				}
			}
		}
	}
	return v
}

// envelope is one record as kcat -J prints it.
type envelope struct {
	Partition int32   `json:"partition"`
	Offset    int64   `json:"offset"`
	Key       *string `json:"key"`
	Payload   *string `json:"payload"`
	// Headers are names and values, alternating.
	Headers []string `json:"headers"`
}

func (e envelope) key() string {
	if e.Key == nil {
		return ""
	}
	return *e.Key
}

func (e envelope) value() string {
	if e.Payload == nil {
		return ""
	}
	return *e.Payload
}

func (e envelope) headers() map[string]string {
	h := map[string]string{}
	for i := 0; i+1 < len(e.Headers); i += 2 {
		h[e.Headers[i]] = e.Headers[i+1]
	}
	return h
}

// readEnvelopes reads every record of topic on addr with kcat, headers
// included, up to the end of each partition at the time of reading.
func readEnvelopes(addr, topic string) ([]envelope, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := kcat(ctx, "-C", "-b", addr, "-t", topic, "-o", "beginning", "-e", "-q", "-J", "-X", "fetch.wait.max.ms=50")
	if err != nil {
		return nil, err
	}
	var recs []envelope
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 4<<20)
	for sc.Scan() {
		var e envelope
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			return nil, fmt.Errorf("kcat -J line %.200q: %w", sc.Text(), err)
		}
		recs = append(recs, e)
	}
	return recs, sc.Err()
}

func describeEnvelopes(es []envelope) string {
	var parts []string
	for i, e := range es {
		if i == 5 {
			parts = append(parts, fmt.Sprintf("… %d more", len(es)-i))
			break
		}
		parts = append(parts, fmt.Sprintf("@%d key %q, %d bytes, kswitch-source %q, kswitch-error %q",
			e.Offset, e.key(), len(e.value()), e.headers()["kswitch-source"], e.headers()["kswitch-error"]))
	}
	return strings.Join(parts, "; ")
}

// counterSum adds the sample series (a metric name, with its labels as
// /metrics prints them: name{reason="x"}) over the agents' /metrics;
// an agent that does not show it counts 0. seen says whether any did.
func counterSum(agents []*agentProc, series string) (sum float64, seen bool, err error) {
	c := http.Client{Timeout: time.Second}
	for _, a := range agents {
		resp, err := c.Get("http://" + a.http + "/metrics")
		if err != nil {
			return 0, false, err
		}
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			if f := strings.Fields(sc.Text()); len(f) == 2 && f[0] == series {
				n, err := strconv.ParseFloat(f[1], 64)
				if err != nil {
					resp.Body.Close()
					return 0, false, fmt.Errorf("%s /metrics: %s: %w", a.id, series, err)
				}
				sum, seen = sum+n, true
			}
		}
		err = sc.Err()
		resp.Body.Close()
		if err != nil {
			return 0, false, fmt.Errorf("%s /metrics: %w", a.id, err)
		}
	}
	return sum, seen, nil
}

// TestJudgeOrder checks the order verdict on made-up reads.
func TestJudgeOrder(t *testing.T) {
	// Source partition 0 holds r0..r5, partition 1 holds r6..r7.
	source := map[int32][]kRecord{0: recs(0, 0, 0, 1, 2, 3, 4, 5), 1: recs(1, 0, 6, 7)}
	ch := func(p int32, ns ...int) []kRecord { return recs(p, 0, ns...) }
	for _, tc := range []struct {
		name                                  string
		channel                               map[int32][]kRecord
		lost, dups, outOfOrder, wrong, others int
	}{
		{"in order", map[int32][]kRecord{0: ch(0, 0, 1, 2, 3, 4, 5), 1: ch(1, 6, 7)}, 0, 0, 0, 0, 0},
		{"one lost", map[int32][]kRecord{0: ch(0, 0, 1, 3, 4, 5), 1: ch(1, 6, 7)}, 1, 0, 0, 0, 0},
		{"sent again later: a duplicate, in order", map[int32][]kRecord{0: ch(0, 0, 1, 2, 3, 1, 2, 3, 4, 5), 1: ch(1, 6, 7)}, 0, 3, 0, 0, 0},
		{"two overtaken by a later one", map[int32][]kRecord{0: ch(0, 0, 3, 1, 2, 4, 5), 1: ch(1, 6, 7)}, 0, 0, 2, 0, 0},
		{"in another partition", map[int32][]kRecord{0: ch(0, 0, 1, 2, 3, 4, 5, 7), 1: ch(1, 6)}, 0, 0, 0, 1, 0},
		{"a record not judged", map[int32][]kRecord{0: ch(0, 0, 1, 2, 3, 4, 5, 99), 1: ch(1, 6, 7)}, 0, 0, 0, 0, 1},
	} {
		v := judgeOrder(source, func(kRecord) bool { return true }, tc.channel)
		if v.LostCount != tc.lost || v.Duplicates != tc.dups || v.OutOfOrder != tc.outOfOrder || v.WrongPartition != tc.wrong || v.Others != tc.others {
			errorf(t, "%s: %s; want %d lost, %d duplicates, %d out of order, %d in another partition, %d others",
				tc.name, v, tc.lost, tc.dups, tc.outOfOrder, tc.wrong, tc.others)
		}
	}
}

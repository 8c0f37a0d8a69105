//go:build integration

package integration

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"maps"
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

// docs/RELAY.md §6, rows R1 and R2: a broker of the channel's cluster
// SIGKILLed while the fleet relays at full speed, on real Kafka.

const (
	// relayRecords are written to A's orders at once, by one kcat run
	// from a file (the fastest producer make integration has: Kafka's
	// ProducerPerformance is make bench's), and relayed to the channel
	// as fast as the fleet goes.
	relayRecords = 300_000
	// relayNodes is the channel cluster's size: three combined KRaft
	// nodes, the channel topic replicated three times with
	// min.insync.replicas 2 (newKafkaCluster), so that acks=all writes
	// go on with a node down.
	relayNodes = 3
	// relayTopic is the channel topic on C.
	relayTopic = "relayed"
	// The broker is killed once the fleet has committed 1/relayKillAt
	// of the records: mid-relay.
	relayKillAt = 3
)

// TestRelayBrokerKilledOnRealKafka (docs/RELAY.md §6, R1 and R2): the
// fleet relays A's orders to the channel relayed on cluster C, three
// KRaft nodes, the topic replicated three times with min.insync.replicas
// 2 and LogAppendTime (each record stamped by the leader that took it).
// kcat writes 300 000 records to A at once; when the fleet has committed
// a third of them, the node leading the most channel partitions (two of
// four) gets SIGKILL; the controller moves their leadership to
// followers, the fleet's producers go on with the new leaders, and the
// killed node is started again on its data and rejoins every partition's
// ISR. Read back with kcat (read_committed for exactly_once): every
// record of A once on the channel, in source order per partition;
// kswitch_routing_reordered_total 0 on every agent; every agent ready.
//
// The killed node is started again, rather than left dead, so that the
// verdict reads a healed cluster: its log is truncated to what the new
// leaders hold and it fetches the rest while the relay goes on (a broker
// registering again is one more metadata change for the producers), and
// the ISR of three says so. Leadership does not move back to it
// (auto.leader.rebalance.enable=false): one leader move per partition.
func TestRelayBrokerKilledOnRealKafka(t *testing.T) {
	for _, delivery := range []string{"at_least_once", "exactly_once"} {
		t.Run(delivery, func(t *testing.T) { addReport(runRelayBrokerKilled(t, delivery)) })
	}
}

func runRelayBrokerKilled(t *testing.T, delivery string) (rep scenarioReport) {
	row := map[string]string{"at_least_once": "R1", "exactly_once": "R2"}[delivery]
	rep = newReport("relay-broker-killed-" + delivery)
	rep.Covers = fmt.Sprintf("RELAY.md §6 %s: %d records relayed A → C (3 KRaft nodes, RF 3, min.insync.replicas 2, %s), the leader of half the channel partitions SIGKILLed mid-relay and started again: 0 lost, 0 duplicated, order per partition",
		row, relayRecords, delivery)
	defer func() { rep.Passed = !t.Failed() }()
	timed := rep.timer(t)

	// C formats its storage while the stack starts.
	type formatted struct {
		nodes []*kafkaBroker
		err   error
	}
	env, logs, dir := kafkaTools(t), logDir(t), filepath.Join(t.TempDir(), "kafka-C")
	cFormatted := make(chan formatted, 1)
	go func() {
		nodes, err := newKafkaCluster(env, "C", dir, logs, relayNodes)
		cFormatted <- formatted{nodes, err}
	}()
	st := startStack(t, timed, prefixPolicy, false)
	f := <-cFormatted
	if f.err != nil {
		fatal(t, f.err)
	}
	c := f.nodes
	for _, n := range c {
		n.start(t)
	}
	for _, n := range c {
		timed("kafka_"+n.name+"_ready", n.waitReady(t, 2*time.Minute))
	}
	c[0].createTopicWith(t, relayTopic, ordersPartitions, map[string]string{
		"min.insync.replicas":    "2",
		"message.timestamp.type": "LogAppendTime",
	})
	cAddrs := make([]string, len(c))
	for i, n := range c {
		cAddrs[i] = n.addr
	}
	read := readTopic
	if delivery == "exactly_once" {
		read = readCommitted
	}

	conf := st.agentConfig()
	conf.Clusters += fmt.Sprintf("  C: {brokers: [%s], role: sink, version: %q, delivery: %s}\n", strings.Join(cAddrs, ", "), kafkaVersion, delivery)
	conf.Extra = routingTo("C", relayTopic, "")
	agents := startFleet(t, conf)
	waitFor(t, time.Minute, "every agent owns a partition of orders and is ready", func() error { return ownsAll(st.tl, agents) })

	// A takes every record at once; the fleet relays them as they come.
	began := time.Now()
	writeNumbered(t, st.a.addr, "orders", relayRecords)
	timed("records_written_to_a", time.Since(began))
	ends, err := endOffsets(st.a.addr, "orders")
	if err != nil {
		fatal(t, err)
	}
	if n := sumOffsets(ends); n != relayRecords {
		fatalf(t, "A's orders holds %d records (%v), kcat wrote %d", n, ends, relayRecords)
	}

	// Mid-relay: the node leading the most channel partitions dies.
	var committedAtKill int64
	waitFor(t, 2*time.Minute, fmt.Sprintf("the fleet commits 1/%d of the %d records", relayKillAt, relayRecords), func() error {
		committedAtKill = sumOffsets(offsetsOf(st.tl.offsets("A", "orders")))
		if committedAtKill < relayRecords/relayKillAt {
			return fmt.Errorf("%d committed", committedAtKill)
		}
		return nil
	})
	if committedAtKill >= relayRecords {
		fatalf(t, "the fleet relayed all %d records before the kill: the relay outran the test, raise relayRecords", relayRecords)
	}
	before, controller, err := metadataOf(c, relayTopic)
	if err != nil {
		fatal(t, err)
	}
	victim, moved := mostLeader(c, before)
	killed := time.Now()
	stopProc(t, victim.proc, syscall.SIGKILL)
	rateBefore := float64(committedAtKill) / killed.Sub(began).Seconds()
	t.Logf("killed %s (node %d; the active controller was node %d) at %d of %d records committed (%.0f records/s since the write began); it led %s partitions %v; leaders and ISRs were %s",
		victim.name, victim.id, controller, committedAtKill, relayRecords, rateBefore, relayTopic, moved, describePartitions(before))
	// With exactly_once the node may also have led transaction
	// coordinators and the positions topic: their moves are part of the
	// fault.
	for _, internal := range []string{"__transaction_state", "__kswitch.positions"} {
		if ps, err := partitionsOf(c, internal); err == nil {
			t.Logf("%s before the kill: %s", internal, describePartitions(ps))
		}
	}

	// The controller fences it (broker.session.timeout.ms 2 s, a
	// controller election first if it was the active controller) and
	// moves its partitions' leadership to followers in the ISR.
	var after map[int32]*sarama.PartitionMetadata
	waitFor(t, time.Minute, fmt.Sprintf("the leadership of %s partitions %v moves off %s", relayTopic, moved, victim.name), func() error {
		var err error
		if after, err = partitionsOf(c, relayTopic); err != nil {
			return err
		}
		for _, p := range moved {
			if l := after[p].Leader; l == victim.id || l < 0 {
				return fmt.Errorf("%s/%d led by %d", relayTopic, p, l)
			}
		}
		return nil
	})
	timed("leaders_moved", time.Since(killed))
	t.Logf("leaders and ISRs after the kill: %s", describePartitions(after))
	// The fleet's producers write to the new leaders: each moved
	// partition is committed further (or it was done).
	atMove := offsetsOf(st.tl.offsets("A", "orders"))
	waitFor(t, time.Minute, "the fleet commits the moved partitions further on their new leaders", func() error {
		got := offsetsOf(st.tl.offsets("A", "orders"))
		for _, p := range moved {
			if got[p] <= atMove[p] && got[p] < ends[p] {
				return fmt.Errorf("orders/%d committed at %d since the leaders moved (A holds %d)", p, got[p], ends[p])
			}
		}
		return nil
	})
	timed("moved_partitions_committed", time.Since(killed))

	// The killed node comes back on its data and catches up.
	victim.start(t)
	timed("killed_node_ready_again", victim.waitReady(t, 2*time.Minute))
	waitFor(t, 2*time.Minute, victim.name+" back in the ISR of every "+relayTopic+" partition", func() error {
		ps, err := partitionsOf(c, relayTopic)
		if err != nil {
			return err
		}
		for p, pm := range ps {
			if !slices.Contains(pm.Isr, victim.id) {
				return fmt.Errorf("%s/%d: ISR %v", relayTopic, p, pm.Isr)
			}
		}
		return nil
	})
	timed("killed_node_in_sync", time.Since(killed))

	// The fleet relays everything. Bound: the relay's own pace on this
	// machine (tens of thousands of records a second) leaves minutes to
	// spare.
	waitFor(t, 3*time.Minute, "the fleet commits all of A", func() error { return st.tl.caughtUp("A", "orders", ends) })
	relayed := time.Since(began)
	timed("relayed_all", relayed)
	rate := float64(relayRecords) / relayed.Seconds()

	source, err := readTopic(st.a.addr, "orders")
	if err != nil {
		fatal(t, err)
	}
	// A read_committed reader sees a transaction once its markers are
	// written, which the coordinator does after EndTxn's answer.
	var channel map[int32][]kRecord
	var ov orderVerdict
	all := func(kRecord) bool { return true }
	if err := wait.Until(30*time.Second, func() error {
		if channel, err = read(strings.Join(cAddrs, ","), relayTopic); err != nil {
			return err
		}
		if ov = judgeOrder(source, all, channel); ov.LostCount > 0 {
			return fmt.Errorf("%d of %d records missing: %v", ov.LostCount, ov.Records, ov.Lost)
		}
		return nil
	}); err != nil {
		errorf(t, "the channel (%s) lacks records of A after the fleet committed all of A: %v", delivery, err)
	}
	rep.Records, rep.Delivered, rep.LostCount, rep.Lost, rep.Duplicates = ov.Records, ov.Delivered, ov.LostCount, ov.Lost, ov.Duplicates
	ov.require(t, relayTopic+" on C")
	if ov.Records != relayRecords {
		errorf(t, "A holds %d distinct records, kcat wrote %d", ov.Records, relayRecords)
	}
	if ov.Duplicates > 0 {
		errorf(t, "%s holds %d duplicates (copies beyond the first): %s", relayTopic, ov.Duplicates, strings.Join(duplicateCopies(source, channel), "; "))
	}
	if ov.Others > 0 {
		errorf(t, "%s holds %d records A does not", relayTopic, ov.Others)
	}
	reordered := fleetSettled(t, st, agents)

	// The first record the new leaders took: the earliest append time
	// after the kill in a moved partition.
	firstTaken := "not found"
	if first, at, err := firstAppendAfter(strings.Join(cAddrs, ","), relayTopic, moved, killed, delivery); err != nil {
		errorf(t, "the first record taken by a new leader: %v", err)
	} else {
		timed("kill_to_first_record_on_new_leader", first.Sub(killed))
		firstTaken = fmt.Sprintf("%v after the kill (%s)", first.Sub(killed).Round(time.Millisecond), at)
	}
	// What the kill did to the producers, from the agents' logs (told,
	// not judged: the verdict above is what counts).
	var hit []string
	for _, msg := range []string{"produce connection lost", "transactional producer failed"} {
		hit = append(hit, fmt.Sprintf("%q ×%d", msg, logLines(agents, `"msg":"`+msg)))
	}
	d := fmt.Sprintf("%s: %d records relayed in %.1f s (%.0f records/s; %.0f before the kill); %s killed (%s) at %d committed, leading %s partitions %v; leaders moved %v after the kill; first record taken by a new leader %s; %s; kswitch_routing_reordered_total %v over the agents; %s; agents' logs: %s",
		row, relayRecords, relayed.Seconds(), rate, rateBefore, victim.name, controllerNote(victim, controller), committedAtKill, relayTopic, moved,
		time.Duration(rep.Timings["leaders_moved"]*float64(time.Second)).Round(time.Millisecond), firstTaken, ov, reordered,
		relayCounters(agents, delivery), strings.Join(hit, ", "))
	rep.Details = append(rep.Details, d)
	t.Log(d)
	timed("scenario", time.Since(st.began))
	return rep
}

// writeNumbered writes n numbered records to topic on addr with one kcat
// run from a file, as fast as kcat goes: key k<i>, value r<i>,
// zero-padded, as the suite's producer numbers them (its partitioner
// spreads them by key).
func writeNumbered(t *testing.T, addr, topic string, n int) {
	t.Helper()
	writeNumberedFrom(t, addr, topic, 0, n)
}

// writeNumberedFrom is writeNumbered for the records numbered from on.
func writeNumberedFrom(t *testing.T, addr, topic string, from, n int) {
	t.Helper()
	file := filepath.Join(t.TempDir(), "records")
	fd, err := os.Create(file)
	if err != nil {
		fatal(t, err)
	}
	w := bufio.NewWriter(fd)
	for i := from; i < from+n; i++ {
		fmt.Fprintf(w, "k%07d\tr%07d\n", i, i)
	}
	if err := errors.Join(w.Flush(), fd.Close()); err != nil {
		fatal(t, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, err := kcat(ctx, "-P", "-b", addr, "-t", topic, "-K", "\t", "-l",
		"-X", "enable.idempotence=true", "-X", "linger.ms=5", file); err != nil {
		fatalf(t, "writing %d records to %s: %v", n, topic, err)
	}
}

func sumOffsets(m map[int32]int64) int64 {
	var n int64
	for _, o := range m {
		n += o
	}
	return n
}

// fleetSettled checks what a relay scenario ends with: no partition
// committed by two agents in one generation, kswitch_routing_reordered_total
// 0 on every agent (it returns their sum), and every agent ready within
// 90 s (a destination that took no record for a while, or two epoch bumps
// within 5 s, make an agent unready for a minute).
func fleetSettled(t *testing.T, st *stack, agents []*agentProc) (reordered float64) {
	t.Helper()
	if dc := st.tl.doubleCommits(); len(dc) > 0 {
		errorf(t, "two agents committed one partition in one generation: %v", dc)
	}
	for _, a := range agents {
		n, err := a.metric("kswitch_routing_reordered_total")
		if err != nil {
			errorf(t, "%s: %v", a.id, err)
		} else if n != 0 {
			errorf(t, "%s: kswitch_routing_reordered_total %v, want 0", a.id, n)
		}
		reordered += n
	}
	waitFor(t, 90*time.Second, "every agent ready at the end", func() error { return allReady(agents) })
	return reordered
}

// allReady returns nil when every agent answers /readyz 200.
func allReady(agents []*agentProc) error {
	for _, a := range agents {
		var body map[string]string
		code, err := getJSON("http://"+a.http+"/readyz", &body)
		if err != nil {
			return fmt.Errorf("%s /readyz: %w", a.id, err)
		}
		if code != 200 {
			return fmt.Errorf("%s /readyz %d: %v", a.id, code, body)
		}
	}
	return nil
}

// partitionsOf reads topic's partitions (leader, replicas, ISR) from the
// first running node of the cluster that answers a metadata request.
func partitionsOf(nodes []*kafkaBroker, topic string) (map[int32]*sarama.PartitionMetadata, error) {
	ps, _, err := metadataOf(nodes, topic)
	return ps, err
}

// metadataOf is partitionsOf, with the node id of the active controller.
func metadataOf(nodes []*kafkaBroker, topic string) (map[int32]*sarama.PartitionMetadata, int32, error) {
	var errs []error
	for _, n := range nodes {
		if n.proc == nil || !n.proc.running() {
			continue
		}
		b := sarama.NewBroker(n.addr)
		if err := b.Open(saramaConfig(2 * time.Second)); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", n.name, err))
			continue
		}
		md, err := b.GetMetadata(&sarama.MetadataRequest{Version: 7, Topics: []string{topic}})
		_ = b.Close()
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", n.name, err))
			continue
		}
		if len(md.Topics) != 1 || md.Topics[0].Err != sarama.ErrNoError {
			errs = append(errs, fmt.Errorf("%s: metadata of %s: %v", n.name, topic, md.Topics))
			continue
		}
		out := map[int32]*sarama.PartitionMetadata{}
		for _, pm := range md.Topics[0].Partitions {
			out[pm.ID] = pm
		}
		return out, md.ControllerID, nil
	}
	return nil, -1, fmt.Errorf("no node of the cluster answers metadata of %s: %w", topic, errors.Join(errs...))
}

// controllerNote says whether the killed node was the active controller,
// whose death adds the quorum's election to the leaders' move.
func controllerNote(victim *kafkaBroker, controller int32) string {
	if victim.id == controller {
		return "the active controller"
	}
	return fmt.Sprintf("the active controller was node %d", controller)
}

// mostLeader returns the node leading the most of the partitions (the
// lowest node id among equals) and those partitions.
func mostLeader(nodes []*kafkaBroker, ps map[int32]*sarama.PartitionMetadata) (*kafkaBroker, []int32) {
	led := map[int32][]int32{}
	for _, p := range slices.Sorted(maps.Keys(ps)) {
		led[ps[p].Leader] = append(led[ps[p].Leader], p)
	}
	best := nodes[0]
	for _, n := range nodes {
		if len(led[n.id]) > len(led[best.id]) {
			best = n
		}
	}
	return best, led[best.id]
}

func describePartitions(ps map[int32]*sarama.PartitionMetadata) string {
	var parts []string
	for _, p := range slices.Sorted(maps.Keys(ps)) {
		parts = append(parts, fmt.Sprintf("%d: leader %d, ISR %v", p, ps[p].Leader, ps[p].Isr))
	}
	return strings.Join(parts, "; ")
}

// firstAppendAfter returns the earliest append time (the topic's
// LogAppendTime: when its leader took it) later than since among the
// records of the partitions, read with kcat (read_committed for
// exactly_once), and where that record is.
func firstAppendAfter(addrs, topic string, partitions []int32, since time.Time, delivery string) (time.Time, string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	args := []string{"-C", "-b", addrs, "-t", topic, "-o", "beginning", "-e", "-q", "-f", `%p\t%o\t%T\n`, "-X", "fetch.wait.max.ms=50"}
	if delivery == "exactly_once" {
		args = append(args, "-X", "isolation.level=read_committed")
	}
	out, err := kcat(ctx, args...)
	if err != nil {
		return time.Time{}, "", err
	}
	var first time.Time
	var at string
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		f := strings.Split(sc.Text(), "\t")
		if len(f) != 3 {
			return time.Time{}, "", fmt.Errorf("kcat line %q: want 3 tab-separated fields", sc.Text())
		}
		p, err1 := strconv.ParseInt(f[0], 10, 32)
		ms, err2 := strconv.ParseInt(f[2], 10, 64)
		if err1 != nil || err2 != nil {
			return time.Time{}, "", fmt.Errorf("kcat line %q: bad partition or timestamp", sc.Text())
		}
		ts := time.UnixMilli(ms)
		if !slices.Contains(partitions, int32(p)) || !ts.After(since) {
			continue
		}
		if first.IsZero() || ts.Before(first) {
			first, at = ts, fmt.Sprintf("%s/%s@%s", topic, f[0], f[1])
		}
	}
	if err := sc.Err(); err != nil {
		return time.Time{}, "", err
	}
	if first.IsZero() {
		return time.Time{}, "", fmt.Errorf("no record of %s partitions %v appended after %s", topic, partitions, since.Format("15:04:05.000"))
	}
	return first, at, nil
}

// duplicateCopies names the records the channel holds more than once and
// where each copy is (at most 20).
func duplicateCopies(source, channel map[int32][]kRecord) []string {
	from := map[string]kRecord{}
	for _, recs := range source {
		for _, r := range recs {
			from[r.Value] = r
		}
	}
	copies := map[string][]string{}
	for _, p := range slices.Sorted(maps.Keys(channel)) {
		for _, r := range channel[p] {
			copies[r.Value] = append(copies[r.Value], fmt.Sprintf("%d@%d", r.Partition, r.Offset))
		}
	}
	var out []string
	for _, v := range slices.Sorted(maps.Keys(copies)) {
		if len(copies[v]) < 2 {
			continue
		}
		if len(out) == 20 {
			return append(out, "…")
		}
		s := from[v]
		out = append(out, fmt.Sprintf("%s (orders/%d@%d) at %s", v, s.Partition, s.Offset, strings.Join(copies[v], ", ")))
	}
	return out
}

// relayCounters sums over the agents the producer's counters for C that
// explain what the kill did: resends the broker already had, epoch bumps,
// and with exactly_once transactions by outcome.
func relayCounters(agents []*agentProc, delivery string) string {
	series := []string{
		`kswitch_routing_duplicate_sequence_total{cluster="C"}`,
		`kswitch_routing_epoch_bumps_total{cluster="C"}`,
	}
	if delivery == "exactly_once" {
		for _, outcome := range []string{"committed", "aborted", "failed", "fenced"} {
			series = append(series, fmt.Sprintf(`kswitch_routing_transactions_total{cluster="C",outcome=%q}`, outcome))
		}
		series = append(series, "kswitch_routing_exactly_once_skipped_total")
	}
	var parts []string
	for _, series := range series {
		// A labelled series appears once counted: unseen is 0.
		n, _, err := counterSum(agents, series)
		if err != nil {
			parts = append(parts, fmt.Sprintf("%s: %v", series, err))
			continue
		}
		parts = append(parts, fmt.Sprintf("%s %v", series, n))
	}
	return strings.Join(parts, ", ")
}

// logLines counts the lines of the agents' logs (every process of each,
// restarts included) that contain s.
func logLines(agents []*agentProc, s string) int {
	n := 0
	for _, a := range agents {
		out, err := os.ReadFile(a.log)
		if err != nil {
			continue
		}
		n += strings.Count(string(out), s)
	}
	return n
}

//go:build integration

package integration

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// docs/RELAY.md §5 and §6, row R3: the relay and a failover across two
// Kafka releases far apart, a 3.x (integration/kafka/old/pom.xml) and the
// newest 4.x served (integration/kafka/newest/pom.xml), with MirrorMaker
// 2 from the suite's release (integration/kafka/pom.xml) between them.

const (
	// versionsRecords are written to A at once and relayed at full speed
	// before the failover story starts.
	versionsRecords = 100_000
	// versionsTopic is the channel topic on C.
	versionsTopic = "relayed"
)

// versionsLeg is one run of the versions scenario.
type versionsLeg struct {
	delivery string // the channel's cluster C: at_least_once or exactly_once
	// aOld runs A on the older release and B and C on the newest; else
	// A on the newest and B and C on the older. Either way C is on the
	// other release from A, so the relay reads one release and writes
	// the other until the failover, and MirrorMaker 2 (the suite's
	// release) copies between the two.
	aOld bool
}

// TestRelayAcrossKafkaVersions (docs/RELAY.md §6, R3): A on one Kafka
// release, B and C on the other, MirrorMaker 2 from the suite's jars (a
// third release: the newest's connect-mirror is not served) copying A
// to B. The fleet relays 100 000 records from A to the channel
// on C at full speed, then a kcat producer writes 100 records a second.
// The fleet is paused while A takes 100 000 more, which MirrorMaker 2
// copies to B; A's broker gets SIGKILL and the fleet is resumed: it fails
// over to B (the other release from A), its positions translated into
// the middle of the copy, and relays that backlog from B at full speed.
// A's broker is started again on its data (failback). Two legs:
// at_least_once with A on the older release (fetch from 3.x, produce to
// 4.x), exactly_once with A on the newest (fetch from 4.x, transactions
// on 3.x). Read back
// with kcat (read_committed for exactly_once): every record of A on the
// channel, in source order per partition; exactly_once: none twice;
// at_least_once: duplicates only where the failover explains them (the
// verdict of TestFailoverOnRealKafka). The Produce and Fetch versions
// the agents send are read off each broker's request log and must be
// what an ApiVersions negotiation gives: min(kswitch's ceiling for the
// cluster's configured version, the broker's maximum).
func TestRelayAcrossKafkaVersions(t *testing.T) {
	for _, leg := range []versionsLeg{{delivery: "at_least_once", aOld: true}, {delivery: "exactly_once", aOld: false}} {
		t.Run(leg.delivery, func(t *testing.T) { addReport(runRelayAcrossVersions(t, leg)) })
	}
}

func runRelayAcrossVersions(t *testing.T, leg versionsLeg) (rep scenarioReport) {
	newer, older, mm := kafkaToolsNewest(t), kafkaToolsOld(t), kafkaTools(t)
	envA, envBC := older, newer
	if !leg.aOld {
		envA, envBC = newer, older
	}
	rep = newReport("relay-across-versions-" + leg.delivery)
	rep.Covers = fmt.Sprintf("RELAY.md §6 R3: A on Kafka %s, B and C on %s, MirrorMaker 2 (%s) A → B; %d records relayed A → C at full speed, %d more held back and relayed from B after a failover (SIGKILL of A), a producer at %d/s throughout, a failback; %s: 0 lost, order per partition, %s",
		envA.release, envBC.release, mm.release, versionsRecords, versionsRecords, produceRate, leg.delivery,
		map[bool]string{true: "0 duplicated (read_committed)", false: "duplicates only where the failover explains them"}[leg.delivery == "exactly_once"])
	defer func() { rep.Passed = !t.Failed() }()
	timed := rep.timer(t)
	t.Logf("A on Kafka %s, B and C on Kafka %s, MirrorMaker 2 from %s; channel %s", envA.release, envBC.release, mm.release, leg.delivery)

	// C formats its storage while the stack starts.
	type formatted struct {
		b   *kafkaBroker
		err error
	}
	logs, dir := logDir(t), filepath.Join(t.TempDir(), "kafka-C")
	cFormatted := make(chan formatted, 1)
	go func() {
		b, err := newKafkaBroker(envBC, "C", dir, logs)
		cFormatted <- formatted{b, err}
	}()
	st := startStackOpts(t, timed, prefixPolicy, stackOptions{mirror: true, kafkaA: &envA, kafkaB: &envBC})
	f := <-cFormatted
	if f.err != nil {
		fatal(t, f.err)
	}
	c := f.b
	c.start(t)
	timed("kafka_c_ready", c.waitReady(t, 2*time.Minute))
	c.createTopic(t, versionsTopic, ordersPartitions)
	remote := prefixPolicy.remote

	// What an ApiVersions negotiation gives on each broker, computed as
	// the agents' fetcher and producer compute it.
	negotiated := map[string]negotiatedVersions{}
	for _, b := range []*kafkaBroker{st.a, st.b, c} {
		n, err := negotiate(b)
		if err != nil {
			fatal(t, err)
		}
		negotiated[b.name] = n
		t.Logf("%s", n)
		rep.Details = append(rep.Details, n.String())
	}

	read := readTopic
	if leg.delivery == "exactly_once" {
		read = readCommitted
	}
	conf := st.agentConfig()
	conf.Clusters += fmt.Sprintf("  C: {brokers: [%s], role: sink, version: %q, delivery: %s}\n", c.addr, envBC.version, leg.delivery)
	conf.Extra = routingTo("C", versionsTopic, "")
	agentsAt := time.Now()
	agents := startFleet(t, conf)
	waitFor(t, time.Minute, "every agent owns a partition of orders and is ready", func() error { return ownsAll(st.tl, agents) })
	timed("fleet_ready", time.Since(agentsAt))

	// 1. Full speed: A takes every record at once; the fleet relays them
	// from one release to the other.
	began := time.Now()
	writeNumbered(t, st.a.addr, "orders", versionsRecords)
	timed("records_written_to_a", time.Since(began))
	bulk, err := endOffsets(st.a.addr, "orders")
	if err != nil {
		fatal(t, err)
	}
	if n := sumOffsets(bulk); n != versionsRecords {
		fatalf(t, "A's orders holds %d records (%v), kcat wrote %d", n, bulk, versionsRecords)
	}
	waitFor(t, 3*time.Minute, fmt.Sprintf("the fleet commits the %d records of A", versionsRecords), func() error { return st.tl.caughtUp("A", "orders", bulk) })
	relayed := time.Since(began)
	timed("bulk_relayed", relayed)
	rate := float64(versionsRecords) / relayed.Seconds()
	t.Logf("%d records relayed from Kafka %s to Kafka %s in %.1f s: %.0f records/s (the write included)", versionsRecords, envA.release, envBC.release, relayed.Seconds(), rate)

	// 2. A steady producer; the versions on the wire, from the brokers'
	// request logs: the agents fetch from A and produce to C.
	prod := startNamedProducer(t, "live", st.a.addr, "orders", produceRate)
	timed("fleet_moving", st.moving(t, "the fleet consumes every partition of A's live records", time.Minute))
	cKeys := []int16{apiProduce}
	if leg.delivery == "exactly_once" {
		cKeys = append(cKeys, apiEndTxn)
	}
	wire := map[string]map[int16][]int16{
		"A": requestVersions(t, st.a, apiFetch),
		"C": requestVersions(t, c, cKeys...),
	}
	// 3. A backlog on B: the fleet is paused, A takes a second bulk,
	// and MirrorMaker 2 copies it to B. A's broker crashes with the fleet
	// that far behind; the fleet, resumed, moves to B (the other release
	// from A), where the translated positions are in the middle of the
	// copy, and relays the backlog from there at full speed.
	pauseRev := putRev(t, st.etcd, fleetPrefix+"signals/fleet", "pause")
	waitFor(t, 10*time.Second, "every agent obeys the pause", func() error { return signalsApplied(agents, pauseRev) })
	writeNumberedFrom(t, st.a.addr, "orders", versionsRecords, versionsRecords)
	atPause, err := endOffsets(st.a.addr, "orders")
	if err != nil {
		fatal(t, err)
	}
	waitFor(t, 2*time.Minute, "MirrorMaker 2 copies the second bulk to B", func() error { return atLeast(st.b.addr, remote, atPause) })
	fault := time.Now()
	stopProc(t, st.a.proc, syscall.SIGKILL)
	put(t, st.etcd, fleetPrefix+"signals/fleet", "start")
	waitFailedOver(t, st.tl, fault, timed)
	// When state/active named B, by the suite's watch of etcd.
	switched := fault.Add(time.Duration(rep.Timings["failover_switched"] * float64(time.Second)))
	replicatedAtFault, err := endOffsets(st.b.addr, remote)
	if err != nil {
		fatal(t, err)
	}
	failover := lastSwitch(t, st.tl, "A", "B")
	rep.Methods["failover"] = methods(failover)
	t.Logf("failover: %s", describe(failover))
	var backlog int64
	for _, ps := range failover.Partitions {
		backlog += replicatedAtFault[ps.Partition] - ps.ToOffset
	}
	if backlog < versionsRecords {
		errorf(t, "the fleet had %d records to relay from B after the failover, want the second bulk (%d) or more: the pause did not hold it back", backlog, versionsRecords)
	}
	for _, ps := range failover.Partitions {
		// As in TestFailoverOnRealKafka: by fingerprint, or by the
		// offset-syncs where B lacked the last record consumed.
		lagged := ps.Method == "mm2" && strings.Contains(ps.Detail, "the last consumed record is not on the target")
		if ps.Method != "fingerprint" && !lagged {
			errorf(t, "failover translated orders/%d by %s (%s), want fingerprint: MirrorMaker 2 %s copied Kafka %s to Kafka %s", ps.Partition, ps.Method, ps.Detail, mm.release, envA.release, envBC.release)
		}
	}
	waitFor(t, 3*time.Minute, "the fleet consumes everything B holds", func() error { return st.tl.caughtUp("B", remote, replicatedAtFault) })
	timed("failover_drained", time.Since(fault))
	drain := time.Since(switched)
	rateB := float64(backlog) / drain.Seconds()
	t.Logf("%d records relayed from B (Kafka %s) to C (Kafka %s) in %.1f s after the switch: %.0f records/s", backlog, envBC.release, envBC.release, drain.Seconds(), rateB)
	wire["B"] = requestVersions(t, st.b, apiFetch)

	// 4. Failback: A's broker is started again on its data.
	recovered := time.Now()
	st.a.start(t)
	timed("kafka_a_restart_ready", st.a.waitReady(t, 2*time.Minute))
	activeA := st.tl.waitActive(t, recovered, "A", failbackStable+time.Minute)
	timed("failback_switched", activeA.Sub(recovered))
	failback := lastSwitch(t, st.tl, "B", "A")
	rep.Methods["failback"] = methods(failback)
	t.Logf("failback: %s", describe(failback))

	// The versions each broker saw are the negotiated ones.
	var seen []string
	for _, cl := range slices.Sorted(maps.Keys(wire)) {
		n := negotiated[cl]
		for _, key := range slices.Sorted(maps.Keys(wire[cl])) {
			vs := wire[cl][key]
			seen = append(seen, fmt.Sprintf("%s (Kafka %s) %s %v", cl, n.release, apiName(key), vs))
			want, checked := n.want[key]
			if checked && (len(vs) != 1 || vs[0] != want) {
				errorf(t, "Kafka %s (%s) received the agents' %s requests at versions %v; the negotiation gives v%d (%s)", cl, n.release, apiName(key), vs, want, n)
			}
		}
	}
	wireNote := "the agents' requests on the wire (brokers' request logs): " + strings.Join(seen, "; ")
	t.Log(wireNote)

	// 5. Verdict: the producer stops, the fleet finishes A, kcat reads
	// A, B's copy and the channel back.
	prod.finish(t, time.Minute)
	ends, err := endOffsets(st.a.addr, "orders")
	if err != nil {
		fatal(t, err)
	}
	if got, want := sumOffsets(ends), int64(2*versionsRecords+prod.count()); got != want {
		errorf(t, "A holds %d records, %d were written (twice %d at once, %d by the producer)", got, want, versionsRecords, prod.count())
	}
	waitFor(t, time.Minute, "the fleet consumes all of A", func() error { return st.tl.caughtUp("A", "orders", ends) })
	timed("relayed_all", time.Since(began))
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
		if channel, err = read(c.addr, versionsTopic); err != nil {
			return err
		}
		if ov = judgeOrder(source, all, channel); ov.LostCount > 0 {
			return fmt.Errorf("%d of %d records missing: %v", ov.LostCount, ov.Records, ov.Lost)
		}
		return nil
	}); err != nil {
		errorf(t, "the channel (%s, Kafka %s) lacks records of A (Kafka %s) after the fleet committed all of A: %v", leg.delivery, envBC.release, envA.release, err)
	}
	where := fmt.Sprintf("%s on C (Kafka %s)", versionsTopic, envBC.release)
	ov.require(t, where)
	if ov.Others > 0 {
		errorf(t, "%s holds %d records A does not", where, ov.Others)
	}
	verdictNote := ov.String()
	if leg.delivery == "exactly_once" {
		rep.Records, rep.Delivered, rep.LostCount, rep.Lost, rep.Duplicates = ov.Records, ov.Delivered, ov.LostCount, ov.Lost, ov.Duplicates
		if ov.Duplicates > 0 {
			errorf(t, "%s holds %d duplicates read_committed: %s", where, ov.Duplicates, strings.Join(duplicateCopies(source, channel), "; "))
		}
	} else {
		// Duplicates only where the failover explains them: the
		// committed ranges of each cluster, hand-overs, records B lacked
		// at the fault (verdict_test.go).
		contentB, err := readTopic(st.b.addr, remote)
		if err != nil {
			fatal(t, err)
		}
		events, err := st.tl.history()
		if err != nil {
			fatal(t, err)
		}
		topicOn := func(cluster string) string {
			if cluster == "B" {
				return remote
			}
			return "orders"
		}
		segs, err := segments(events, topicOn, ordersPartitions, "A", offsetsOf(st.tl.offsets("A", "orders")))
		if err != nil {
			fatal(t, err)
		}
		handOvers := map[string]map[int32]map[int64]bool{"A": st.tl.handOvers("A", "orders"), "B": st.tl.handOvers("B", remote)}
		v, err := judge(segs, map[string]map[int32][]kRecord{"A": source, "B": contentB}, channel, redeliverableFrom(replicatedAtFault, failover, remote), handOvers)
		if err != nil {
			fatal(t, err)
		}
		rep.verdict = v
		verdictNote += "; " + v.String()
		if !v.ok() {
			errorf(t, "lost %v (%d); duplicates of records B had at the fault %v; deliveries the committed ranges do not explain %v", v.Lost, v.LostCount, v.BadDuplicates, v.PositionMismatch)
		}
	}
	t.Logf("verdict: %s", verdictNote)
	reordered := fleetSettled(t, st, agents)

	d := fmt.Sprintf("R3 %s, A on Kafka %s, B and C on %s: %d records relayed from A at %.0f records/s (the write included); a second %d held back by a pause, copied to B; %d records by a producer at %d/s throughout; failover %s; %d records relayed from B at %.0f records/s; failback %s; %s; kswitch_routing_reordered_total %v over the agents; %s; %s",
		leg.delivery, envA.release, envBC.release, versionsRecords, rate, versionsRecords, prod.count(), produceRate,
		describe(failover), backlog, rateB, describe(failback), verdictNote, reordered, relayCounters(agents, leg.delivery), wireNote)
	rep.Details = append(rep.Details, d)
	t.Log(d)
	timed("scenario", time.Since(st.began))
	return rep
}

// ownsAll returns nil once every agent owns a partition of orders, all
// of them are owned, and every agent is ready.
func ownsAll(tl *timeline, agents []*agentProc) error {
	owners := tl.owners()
	n := 0
	for _, a := range agents {
		if owners[a.id] == 0 {
			return fmt.Errorf("%s owns nothing: %v", a.id, owners)
		}
		n += owners[a.id]
	}
	if n != ordersPartitions {
		return fmt.Errorf("%d of %d partitions owned: %v", n, ordersPartitions, owners)
	}
	return allReady(agents)
}

// Request types (api keys) the versions scenario watches.
const (
	apiProduce int16 = 0
	apiFetch   int16 = 1
	apiEndTxn  int16 = 26
)

func apiName(key int16) string {
	switch key {
	case apiProduce:
		return "Produce"
	case apiFetch:
		return "Fetch"
	case 10:
		return "FindCoordinator"
	case 22:
		return "InitProducerId"
	case 24:
		return "AddPartitionsToTxn"
	case apiEndTxn:
		return "EndTxn"
	}
	return fmt.Sprintf("api %d", key)
}

// negotiatedVersions is what the agents' fetcher and producer send to a
// broker: kswitch's ceiling for the cluster's configured version
// (internal/kafka's FetchVersion, ProduceVersion), lowered to the
// broker's maximum (kafka.Conn.Negotiate, as fetch.go and
// produce_sink.go call it).
type negotiatedVersions struct {
	cluster, release, configured string
	serves                       map[int16][2]int16 // the broker's ApiVersions: min, max
	want                         map[int16]int16    // Produce and Fetch as negotiated
}

func (n negotiatedVersions) String() string {
	return fmt.Sprintf("%s (Kafka %s, configured version %s) serves Produce v%d-v%d, Fetch v%d-v%d; negotiated: Produce v%d, Fetch v%d",
		n.cluster, n.release, n.configured, n.serves[apiProduce][0], n.serves[apiProduce][1], n.serves[apiFetch][0], n.serves[apiFetch][1],
		n.want[apiProduce], n.want[apiFetch])
}

// negotiate opens an internal/kafka connection to b, as an agent
// configured with b's release's version does, and negotiates Produce
// and Fetch with the floors the agents use.
func negotiate(b *kafkaBroker) (negotiatedVersions, error) {
	n := negotiatedVersions{cluster: b.name, release: b.env.release, configured: b.env.version, serves: map[int16][2]int16{}, want: map[int16]int16{}}
	v, err := sarama.ParseKafkaVersion(b.env.version)
	if err != nil {
		return n, fmt.Errorf("kafka %s: version %q: %w", b.name, b.env.version, err)
	}
	conf := saramaConfig(5 * time.Second)
	conf.Version = v
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := kafka.DialConn(ctx, conf, b.addr)
	if err != nil {
		return n, err
	}
	defer conn.Close()
	resp, err := conn.Broker().ApiVersions(&sarama.ApiVersionsRequest{Version: 3, ClientSoftwareName: "kswitch-integration", ClientSoftwareVersion: "1"})
	if err != nil {
		return n, fmt.Errorf("kafka %s: ApiVersions: %w", b.name, err)
	}
	for _, k := range resp.ApiKeys {
		n.serves[k.ApiKey] = [2]int16{k.MinVersion, k.MaxVersion}
	}
	for _, x := range []struct {
		key            int16
		ceiling, floor int16
	}{{apiProduce, kafka.ProduceVersion(v), 3}, {apiFetch, kafka.FetchVersion(v), 4}} {
		got, err := conn.Negotiate(kafka.APIKey(x.key), x.ceiling, x.floor)
		if err != nil {
			return n, fmt.Errorf("kafka %s (Kafka %s): %w", b.name, b.env.release, err)
		}
		n.want[x.key] = got
	}
	return n, nil
}

// requestVersions turns b's request log on (kafka.request.logger at
// DEBUG: a broker-logger config change, no restart) until the log shows a
// request of each of keys from the agents (client.id kswitch), turns it
// off again, and returns the versions the agents' requests carried, by
// api key: what went over the wire, as the broker read it.
func requestVersions(t *testing.T, b *kafkaBroker, keys ...int16) map[int16][]int16 {
	t.Helper()
	info, err := os.Stat(b.proc.log)
	if err != nil {
		fatal(t, err)
	}
	from := info.Size()
	if err := setRequestLog(b, "DEBUG"); err != nil {
		fatal(t, err)
	}
	defer func() {
		if err := setRequestLog(b, "WARN"); err != nil {
			errorf(t, "%v", err)
		}
	}()
	var got map[int16][]int16
	waitFor(t, 30*time.Second, fmt.Sprintf("Kafka %s logs the agents' %v requests", b.name, keys), func() error {
		var clients []string
		if got, clients, err = agentRequests(b.proc.log, from); err != nil {
			return err
		}
		for _, k := range keys {
			if len(got[k]) == 0 {
				return fmt.Errorf("no %s request from client.id kswitch yet (the agents' versions by api key: %v; client ids logged: %v)", apiName(k), got, clients)
			}
		}
		return nil
	})
	return got
}

// setRequestLog sets the level of b's kafka.request.logger.
func setRequestLog(b *kafkaBroker, level string) error {
	adm, err := sarama.NewClusterAdmin([]string{b.addr}, saramaConfig(5*time.Second))
	if err != nil {
		return fmt.Errorf("kafka %s: %w", b.name, err)
	}
	defer adm.Close()
	if err := adm.IncrementalAlterConfig(sarama.BrokerLoggerResource, fmt.Sprint(b.id),
		map[string]sarama.IncrementalAlterConfigsEntry{"kafka.request.logger": {Operation: sarama.IncrementalAlterConfigsOperationSet, Value: &level}}, false); err != nil {
		return fmt.Errorf("kafka %s: kafka.request.logger to %s: %w", b.name, level, err)
	}
	return nil
}

// agentRequests reads the broker's request log lines ("Completed
// request:{json}") written at or after offset from of the log file, and
// returns the versions of the requests whose client.id is the agents'
// (kswitch), by api key, sorted; and every client.id logged.
func agentRequests(log string, from int64) (map[int16][]int16, []string, error) {
	fd, err := os.Open(log)
	if err != nil {
		return nil, nil, err
	}
	defer fd.Close()
	if _, err := fd.Seek(from, 0); err != nil {
		return nil, nil, err
	}
	out := map[int16][]int16{}
	var clients []string
	sc := bufio.NewScanner(fd)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		line := sc.Text()
		i := strings.Index(line, "Completed request:")
		j := strings.LastIndex(line, "}")
		if i < 0 || j < i {
			continue
		}
		var r struct {
			Header struct {
				Key     int16  `json:"requestApiKey"`
				Version int16  `json:"requestApiVersion"`
				Client  string `json:"clientId"`
			} `json:"requestHeader"`
		}
		if json.Unmarshal([]byte(line[i+len("Completed request:"):j+1]), &r) != nil {
			continue
		}
		if !slices.Contains(clients, r.Header.Client) {
			clients = append(clients, r.Header.Client)
		}
		if r.Header.Client != "kswitch" {
			continue
		}
		if !slices.Contains(out[r.Header.Key], r.Header.Version) {
			out[r.Header.Key] = append(out[r.Header.Key], r.Header.Version)
			slices.Sort(out[r.Header.Key])
		}
	}
	return out, clients, sc.Err()
}

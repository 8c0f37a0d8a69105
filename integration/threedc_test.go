//go:build integration

package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// TestThreeDataCentresOnRealKafka is two cities, three data centres, on
// real processes: Kafka A (the primary), B (the same-city standby,
// priority 1) and D (the remote one, priority 2), each a single KRaft node
// with a small heap; one MirrorMaker 2 copying A to B and A to D (star:
// A.orders on both) or A to B and B to D (chain: B.A.orders on D), default
// naming, offset-syncs on the targets; etcd ×3,
// three kswitch agents, kcat producing to A at a steady rate, and the
// fleet's channel "delivered" on D. A's broker is killed (SIGKILL) and the
// fleet fails over to B; one agent stays paused there, so that its
// partitions' backlog waits for D; B's broker is killed while the fleet
// consumes it and the fleet fails over to D (star: no flow joins B and D,
// the records' fingerprints translate; chain: along B -> D); A's broker is
// started again on its data while B stays down, and the fleet fails back
// from D to A directly. Read back
// with kcat: every record written to A is in the channel; a record is
// delivered twice only when it reached the standby the fleet moved to
// after the fleet had consumed it elsewhere (MirrorMaker 2 stopped with A,
// and copied the rest once A returned).
func TestThreeDataCentresOnRealKafka(t *testing.T) {
	for _, chain := range []bool{false, true} {
		name := map[bool]string{false: "star", true: "chain"}[chain]
		t.Run(name, func(t *testing.T) { addReport(runThreeDC(t, chain)) })
	}
}

// threeDCStack is the three clusters, MirrorMaker 2 and etcd.
type threeDCStack struct {
	env     kafkaEnv
	etcd    *etcdCluster
	a, b, d *kafkaBroker
	mm      *mirrorMaker
	tl      *timeline
}

func runThreeDC(t *testing.T, chain bool) (rep scenarioReport) {
	rep = newReport("three-dc-star")
	rep.Covers = "three clusters, MirrorMaker 2 as a star A->B, A->D; SIGKILL of A, then of B: failover A->B->D; A back: failback D->A directly"
	flowD, onD := "{from: A, to: D, offset_syncs_on: target}", "A.orders"
	if chain {
		rep = newReport("three-dc-chain")
		rep.Covers = "three clusters, MirrorMaker 2 as a chain A->B->D (B.A.orders on D); SIGKILL of A, then of B: failover A->B->D; A back: failback D->A directly"
		flowD, onD = "{from: B, to: D, offset_syncs_on: target}", "B.A.orders"
	}
	defer func() { rep.Passed = !t.Failed() }()
	timed := rep.timer(t)
	began := time.Now()
	st := startThreeDCStack(t, timed, chain, onD)
	etcd, a, b, d, tl := st.etcd, st.a, st.b, st.d, st.tl
	conf := agentConfig{
		Endpoints: etcd.endpoints(),
		Clusters: fmt.Sprintf("  A: {brokers: [%s], role: primary, version: %q}\n  B: {brokers: [%s], role: standby, priority: 1, version: %q}\n  D: {brokers: [%s], role: standby, priority: 2, version: %q}\n",
			a.addr, a.env.version, b.addr, b.env.version, d.addr, d.env.version),
		Source: fmt.Sprintf("  topics: [orders]\n  group: orders\n  initial_offset: oldest\n  refresh_interval: 2s\n  commit_interval: %s\n", commitInterval),
		Failover: fmt.Sprintf("  probe_interval: %s\n  probe_timeout: 1s\n  failure_window: %s\n  failback: auto\n  failback_stable: %s\n",
			probeInterval, failureWindow, failbackStable),
		Extra: "replication:\n  - {from: A, to: B, offset_syncs_on: target}\n  - " + flowD + "\n" +
			"routing:\n  default: [delivered]\n  channels:\n    delivered: {cluster: D, topic: delivered, partitioner: manual-same-partition}\n",
	}
	agentsAt := time.Now()
	for i := 1; i <= 3; i++ {
		startAgentWith(t, fmt.Sprintf("agent-%d", i), conf)
	}
	prod := startProducer(t, a.addr, "orders", produceRate)
	var err error
	waitFor(t, time.Minute, "the fleet commits offsets on A for every partition", func() error {
		got := offsetsOf(tl.offsets("A", "orders"))
		if len(got) < ordersPartitions || sum(got) < 4*ordersPartitions {
			return fmt.Errorf("committed: %v", got)
		}
		return nil
	})
	timed("fleet_consuming_a", time.Since(agentsAt))
	topicOn := func(cluster string) string {
		return map[string]string{"A": "orders", "B": "A.orders", "D": onD}[cluster]
	}
	for _, k := range []*kafkaBroker{b, d} {
		waitFor(t, 30*time.Second, "MirrorMaker 2 copies the records to "+k.name, func() error {
			ends, err := endOffsets(k.addr, topicOn(k.name))
			if err != nil {
				return err
			}
			if sum(ends) < 4*ordersPartitions {
				return fmt.Errorf("%s on %s holds %d records", topicOn(k.name), k.name, sum(ends))
			}
			return nil
		})
	}

	// The fleet falls behind A by a backlog that B and D hold, so that it
	// has records to consume on B after the failover (paused through the
	// fault, started once on B).
	put(t, etcd, fleetPrefix+"signals/fleet", "pause")
	atPause := sum(offsetsOf(tl.offsets("A", "orders")))
	for _, k := range []*kafkaBroker{b, d} {
		waitFor(t, 30*time.Second, "a backlog of 150 records on "+k.name, func() error {
			ends, err := endOffsets(k.addr, topicOn(k.name))
			if err != nil {
				return err
			}
			if sum(ends) < atPause+150 {
				return fmt.Errorf("%s holds %d records, the fleet is at %d", k.name, sum(ends), atPause)
			}
			return nil
		})
	}

	// 1. A dies: the fleet moves to B, the first standby.
	faultA := time.Now()
	stopProc(t, a.proc, syscall.SIGKILL)
	timed("failover_a_b_switched", tl.waitActive(t, faultA, "B", failureWindow+45*time.Second).Sub(faultA))
	// agent-3 stays paused on B: its partitions' backlog waits for D.
	put(t, etcd, fleetPrefix+"signals/agent/agent-3", "pause")
	put(t, etcd, fleetPrefix+"signals/fleet", "start")
	// Nothing reaches B while A is down: what it holds now is what
	// MirrorMaker 2 copied before the fault (D's copy is read when B
	// goes: in the chain it is filled from B until then).
	atFault := map[string]map[int32]int64{}
	if atFault["B"], err = endOffsets(b.addr, "A.orders"); err != nil {
		fatal(t, err)
	}
	toB := lastSwitch(t, tl, "A", "B")
	rep.Methods["failover_a_b"] = methods(toB)
	t.Logf("failover A → B: %s", describe(toB))
	waitFor(t, time.Minute, "the fleet consumes every partition of B but agent-3's", func() error {
		done := 0
		for p, c := range offsetsOf(tl.offsets("B", "A.orders")) {
			if c >= atFault["B"][p] {
				done++
			}
		}
		if done == 0 || done == ordersPartitions {
			return fmt.Errorf("%d of %d partitions consumed to B's end (%v of %v)", done, ordersPartitions, offsetsOf(tl.offsets("B", "A.orders")), atFault["B"])
		}
		return nil
	})
	// What the fleet consumed on B, read before B goes.
	contentB, err := readTopic(b.addr, "A.orders")
	if err != nil {
		fatal(t, err)
	}

	// 2. B dies too, while the fleet consumes it: on to D.
	faultB := time.Now()
	stopProc(t, b.proc, syscall.SIGKILL)
	timed("failover_b_d_switched", tl.waitActive(t, faultB, "D", failureWindow+45*time.Second).Sub(faultB))
	if atFault["D"], err = endOffsets(d.addr, onD); err != nil {
		fatal(t, err)
	}
	put(t, etcd, fleetPrefix+"signals/agent/agent-3", "start")
	toD := lastSwitch(t, tl, "B", "D")
	rep.Methods["failover_b_d"] = methods(toD)
	t.Logf("failover B → D: %s", describe(toD))
	for _, ps := range toD.Partitions {
		if !chain && ps.Method == "mm2" {
			errorf(t, "B → D translated orders/%d by MirrorMaker 2's data (%s); no flow joins B and D", ps.Partition, ps.Detail)
		}
	}
	waitFor(t, time.Minute, "the fleet consumes everything D holds", func() error { return tl.caughtUp("D", onD, atFault["D"]) })

	// 3. A returns (B stays down): once A has been healthy for
	// failback_stable and holds what the fleet consumed on D, the fleet
	// goes straight back to A.
	recovered := time.Now()
	a.start(t)
	timed("kafka_a_restart_ready", a.waitReady(t, 2*time.Minute))
	timed("failback_d_a_switched", tl.waitActive(t, recovered, "A", failbackStable+time.Minute).Sub(recovered))
	back := lastSwitch(t, tl, "D", "A")
	rep.Methods["failback_d_a"] = methods(back)
	t.Logf("failback D → A: %s", describe(back))
	// Each cluster of the chain had records to deliver: the backlog on
	// B, and on D what MirrorMaker 2 copied once A returned.
	for _, seg := range []struct {
		on       string
		from, to switchEvent
	}{{"B", toB, toD}, {"D", toD, back}} {
		consumed := int64(0)
		for _, ps := range seg.to.Partitions {
			for _, in := range seg.from.Partitions {
				if in.Partition == ps.Partition {
					consumed += ps.FromOffset - in.ToOffset
				}
			}
		}
		if consumed <= 0 {
			errorf(t, "the fleet delivered nothing on %s (%s, then %s): the scenario does not test the chain", seg.on, describe(seg.from), describe(seg.to))
		}
	}

	// 4. Verdict.
	prod.finish(t, time.Minute)
	ends, err := endOffsets(a.addr, "orders")
	if err != nil {
		fatal(t, err)
	}
	if got := sum(ends); got != int64(prod.count()) {
		errorf(t, "A holds %d records, the producer wrote %d", got, prod.count())
	}
	waitFor(t, time.Minute, "the fleet consumes all of A", func() error { return tl.caughtUp("A", "orders", ends) })
	content := map[string]map[int32][]kRecord{}
	for _, src := range []struct {
		k     *kafkaBroker
		topic string
	}{{a, "orders"}, {d, onD}} {
		if content[src.k.name], err = readTopic(src.k.addr, src.topic); err != nil {
			fatal(t, err)
		}
	}
	content["B"] = contentB
	delivered := readDelivered(t, d, prod.count())
	events, err := tl.history()
	if err != nil {
		fatal(t, err)
	}
	segs, err := segments(events, topicOn, ordersPartitions, "A", offsetsOf(tl.offsets("A", "orders")))
	if err != nil {
		fatal(t, err)
	}
	in := judgeInput{segs: segs, content: map[physical]map[int32][]kRecord{}, written: map[string]bool{}, delivered: delivered,
		handOvers: map[physical]map[int32]map[int64]bool{}}
	for _, recs := range content["A"] {
		for _, r := range recs {
			in.written[r.Value] = true
		}
	}
	for _, c := range []string{"A", "B", "D"} {
		pt := physical{c, topicOn(c)}
		in.content[pt], in.handOvers[pt] = content[c], tl.handOvers(c, topicOn(c))
	}
	// A record delivered before a switch and again after it, from a
	// standby that lacked it at A's fault (copied once A returned) or
	// from where the switch into it declared a rewind.
	redeliverable := map[string]map[int32]int64{"B": redeliverableFrom(atFault["B"], toB, "A.orders"), "D": redeliverableFrom(atFault["D"], toD, onD)}
	in.unreplicated = func(ds []delivery) bool {
		last := ds[len(ds)-1]
		from, ok := redeliverable[last.Cluster][last.Partition]
		return len(ds) == 2 && ds[1].Segment > ds[0].Segment && ok && last.Offset >= from
	}
	v, err := judgeStreams(in)
	if err != nil {
		fatal(t, err)
	}
	verdictHolds(t, &rep, v, tl, "duplicates not explained by a standby lacking them")
	var path []string
	for _, ev := range events {
		path = append(path, ev.From+"→"+ev.To)
	}
	if got := strings.Join(path, " "); got != "A→B B→D D→A" {
		errorf(t, "switches %s, want A→B B→D D→A", got)
	}
	timed("scenario", time.Since(began))
	return rep
}

// startThreeDCStack starts etcd ×3, Kafka A, B and D (orders on A, the
// channel delivered on D) and MirrorMaker 2 from A to B and D (star) or
// from A to B and B to D (chain), and waits until A.orders is on B and
// onD on D.
func startThreeDCStack(t *testing.T, timed func(string, time.Duration), chain bool, onD string) *threeDCStack {
	t.Helper()
	st := &threeDCStack{env: kafkaTools(t)}
	logs := logDir(t)
	names := []string{"A", "B", "D"}
	brokers := make([]*kafkaBroker, len(names))
	errs := make([]error, len(names))
	var wg sync.WaitGroup
	for i, name := range names {
		wg.Go(func() {
			brokers[i], errs[i] = newKafkaBroker(st.env, name, filepath.Join(t.TempDir(), "kafka-"+name), logs)
		})
	}
	st.etcd = startEtcdCluster(t, 3)
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			fatal(t, err)
		}
	}
	st.a, st.b, st.d = brokers[0], brokers[1], brokers[2]
	for _, k := range brokers {
		k.start(t)
	}
	for _, k := range brokers {
		timed("kafka_"+strings.ToLower(k.name)+"_ready", k.waitReady(t, 2*time.Minute))
	}
	st.a.createTopic(t, "orders", ordersPartitions)
	st.d.createTopic(t, "delivered", ordersPartitions)
	st.mm = startThreeDCMirrorMaker(t, st.env, st.a, st.b, st.d, chain)
	for _, k := range []struct {
		*kafkaBroker
		topic string
	}{{st.b, "A.orders"}, {st.d, onD}} {
		waitFor(t, 2*time.Minute, "MirrorMaker 2 creates "+k.topic+" on "+k.name, func() error {
			if !st.mm.proc.running() {
				return fmt.Errorf("MirrorMaker 2 exited: %v", st.mm.proc.err)
			}
			ends, err := endOffsets(k.addr, k.topic)
			if err != nil {
				return err
			}
			if len(ends) != ordersPartitions {
				return fmt.Errorf("%s on %s has %d partitions", k.topic, k.name, len(ends))
			}
			return nil
		})
	}
	timed("mirrormaker_topics", time.Since(st.mm.began))
	st.tl = startTimeline(t, st.etcd.endpoints())
	return st
}

// startThreeDCMirrorMaker runs one MirrorMaker 2 with the flows A->B and
// A->D (star: topic orders each) or A->B and B->D (chain: B's copy
// A.orders goes on to D as B.A.orders), group orders, the offset-syncs on
// each target, a sync per record; every other pair is off, heartbeats
// included.
func startThreeDCMirrorMaker(t *testing.T, env kafkaEnv, a, b, d *kafkaBroker, chain bool) *mirrorMaker {
	t.Helper()
	on := map[string]string{"A->B": "orders", "A->D": "orders"}
	if chain {
		on = map[string]string{"A->B": "orders", "B->D": `A\\.orders`}
	}
	var flows strings.Builder
	for _, pair := range []string{"A->B", "A->D", "B->A", "D->A", "B->D", "D->B"} {
		if topics, ok := on[pair]; ok {
			fmt.Fprintf(&flows, "%[1]s.enabled = true\n%[1]s.topics = %[2]s\n%[1]s.groups = orders\n", pair, topics)
		} else {
			fmt.Fprintf(&flows, "%[1]s.enabled = false\n%[1]s.emit.heartbeats.enabled = false\n", pair)
		}
	}
	dir := t.TempDir()
	conf := filepath.Join(dir, "mm2.properties")
	props := fmt.Sprintf(`clusters = A, B, D
A.bootstrap.servers = %s
B.bootstrap.servers = %s
D.bootstrap.servers = %s
%sreplication.policy.class = org.apache.kafka.connect.mirror.DefaultReplicationPolicy
%soffset-syncs.topic.location = target
offset.lag.max = 0
emit.checkpoints.interval.seconds = 1
emit.heartbeats.interval.seconds = 1
refresh.topics.interval.seconds = 1
refresh.groups.interval.seconds = 1
sync.group.offsets.enabled = false
B.offset.flush.interval.ms = 1000
D.offset.flush.interval.ms = 1000
plugin.discovery = service_load
`, a.addr, b.addr, d.addr, flows.String(), mm2OneBroker)
	if err := os.WriteFile(conf, []byte(props), 0o644); err != nil {
		fatal(t, err)
	}
	m := &mirrorMaker{began: time.Now()}
	m.proc = startProc(t, "mirrormaker", env.java, append(env.jvmArgs("384m", dir, "org.apache.kafka.connect.mirror.MirrorMaker"), conf)...)
	return m
}

//go:build integration

package integration

import (
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// A real data-centre outage: A goes away for everyone, its producers
// included. The producers move to B and write B's own orders; MirrorMaker
// 2 runs both ways with its default naming, so the logical topic orders is
// two physical topics on each cluster: on A, orders (written on A) and
// B.orders (B's orders copied back); on B, A.orders (A's copied) and
// orders. The fleet consumes both on the active cluster: 8 partitions.

// outagePartitions is the fleet's partition count: orders on the active
// cluster and the copy of the other cluster's orders.
const outagePartitions = 2 * ordersPartitions

// tailRecords is how many records A takes while MirrorMaker 2 is stopped
// before A dies: its unmirrored tail, which the failback must count.
const tailRecords = 150

// streamTopic names the physical topic of the records written on origin,
// as found on cluster (MirrorMaker 2's default policy).
func streamTopic(origin, cluster string) string {
	if origin == cluster {
		return "orders"
	}
	return origin + ".orders"
}

// TestOutageOnRealKafka runs the outage on real processes: Kafka A and B
// (KRaft), one MirrorMaker 2 with the flows A->B and B->A, etcd ×3, three
// kswitch agents and kcat producers. A kcat producer writes to A's orders;
// with the fleet paused and MirrorMaker 2 stopped (SIGSTOP) A takes
// tailRecords more, then A's broker and its producer get SIGKILL. A
// producer writes to B's orders; the fleet fails over to B. A's broker is
// started again on its data, the producer moves back to A, and the fleet
// fails back once A has been healthy for failback_stable and holds what it
// consumed of B's orders. Read back with kcat: every record written to A's
// or B's orders is in the channel topic; the failback counts A's
// unmirrored tail exactly.
func TestOutageOnRealKafka(t *testing.T) { addReport(runOutage(t)) }

func runOutage(t *testing.T) (rep scenarioReport) {
	rep = newReport("outage")
	rep.Covers = "MirrorMaker 2 both ways; SIGKILL of A and its producer with an unmirrored tail; producer to B; failover; A back, producer back; failback counts the tail"
	defer func() { rep.Passed = !t.Failed() }()
	timed := rep.timer(t)
	st := startStackWith(t, timed, prefixPolicy, true, true)
	etcd, a, b, tl, began := st.etcd, st.a, st.b, st.tl, st.began
	conf := st.agentConfig()
	agentsAt := time.Now()
	var agents []*agentProc
	for i := 1; i <= 3; i++ {
		agents = append(agents, startAgentWith(t, fmt.Sprintf("agent-%d", i), conf))
	}
	pa1 := startNamedProducer(t, "a1", a.addr, "orders", produceRate)

	// 1. Steady state: the fleet owns orders and B.orders on A (empty: no
	// producer writes to B yet) and consumes orders.
	waitFor(t, time.Minute, "the fleet owns 8 partitions on A and commits on every partition of orders", func() error {
		if a, ok := tl.active(); ok && a.Cluster != "A" {
			return fmt.Errorf("state/active: %+v", a)
		}
		owned := 0
		for _, n := range tl.owners() {
			owned += n
		}
		if owned != outagePartitions {
			return fmt.Errorf("the assignment owns %d partitions (%v), want %d: orders and B.orders", owned, tl.owners(), outagePartitions)
		}
		got := offsetsOf(tl.offsets("A", "orders"))
		for p := range int32(ordersPartitions) {
			if got[p] == 0 {
				return fmt.Errorf("nothing consumed of orders/%d yet: %v", p, got)
			}
		}
		return nil
	})
	timed("fleet_consuming_a", time.Since(agentsAt))

	// 2. The unmirrored tail. The fleet is paused, and once every agent
	// obeys the pause nothing past A's ends at that moment is delivered;
	// MirrorMaker 2 copies up to there, and is then stopped (SIGSTOP: a
	// replication link that stalls), so that what A takes from now on is
	// on neither B nor the channel when A dies.
	pauseRev := putRev(t, etcd, fleetPrefix+"signals/fleet", "pause")
	waitFor(t, 10*time.Second, "every agent obeys the pause", func() error { return signalsApplied(agents, pauseRev) })
	atPause, err := endOffsets(a.addr, "orders")
	if err != nil {
		fatal(t, err)
	}
	waitFor(t, 30*time.Second, "MirrorMaker 2 copies to B what the fleet may have consumed", func() error {
		return atLeast(b.addr, "A.orders", atPause)
	})
	st.mm.proc.signal(syscall.SIGSTOP)
	stopped := time.Now()
	var mirrored map[int32]int64
	waitFor(t, 30*time.Second, fmt.Sprintf("A takes %d records MirrorMaker 2 does not copy", tailRecords), func() error {
		ea, err := endOffsets(a.addr, "orders")
		if err != nil {
			return err
		}
		if mirrored, err = endOffsets(b.addr, "A.orders"); err != nil {
			return err
		}
		if d := sum(ea) - sum(mirrored); d < tailRecords {
			return fmt.Errorf("A holds %d records, B %d", sum(ea), sum(mirrored))
		}
		return nil
	})

	// 3. A's data centre fails: the broker and its producer.
	fault := time.Now()
	t.Logf("SIGKILL to A's broker (pid %d) and its producer; MirrorMaker 2 stopped %v before", a.proc.cmd.Process.Pid, fault.Sub(stopped).Round(time.Millisecond))
	a.proc.signal(syscall.SIGKILL)
	pa1.crash(t)
	stopProc(t, a.proc, syscall.SIGKILL) // waits until A is gone
	pb1 := startNamedProducer(t, "b1", b.addr, "orders", produceRate)
	st.mm.proc.signal(syscall.SIGCONT)

	waitFailedOver(t, tl, fault, timed)
	// The fleet starts again once it is on B: started before, it would
	// hand on the records of A's tail that sarama had fetched while it
	// was paused, until the switch revoked A's partitions (consumed, not
	// on B: the failover could not translate them by fingerprint).
	put(t, etcd, fleetPrefix+"signals/fleet", "start")
	// Nothing reaches B's A.orders while A is down.
	replicatedAtFault, err := endOffsets(b.addr, "A.orders")
	if err != nil {
		fatal(t, err)
	}
	failover := lastSwitchOf(t, tl, "A", "B", outagePartitions, 10*time.Second)
	timed("failover_in_history", failover.Finished.Sub(fault))
	rep.Methods["failover"] = streamMethods(failover)
	t.Logf("failover: %s", describeStreams(failover))
	checkStreams(t, failover, "A", "B")
	for _, ps := range failover.Partitions {
		if ps.Origin == "A" && ps.Method != "fingerprint" {
			errorf(t, "failover translated %s/%d (written on A) by %s (%s), want fingerprint: B holds everything the fleet consumed", ps.FromTopic, ps.Partition, ps.Method, ps.Detail)
		}
	}
	// The first record of B's own orders delivered: an agent commits past
	// the translated position.
	to := map[int32]int64{}
	for _, ps := range failover.Partitions {
		if ps.Origin == "B" {
			to[ps.Partition] = ps.ToOffset
		}
	}
	var first event
	waitFor(t, 30*time.Second, "an agent commits on B's orders past the translated offsets", func() error {
		var ok bool
		first, ok = tl.first(fault, func(ev event) bool {
			p, c, ok := offsetEvent(ev, "B", "orders")
			return ok && !strings.HasPrefix(c.Agent, "leader:") && c.Offset > max(to[p], 0)
		})
		if !ok {
			return fmt.Errorf("committed on B's orders: %v, translated %v", offsetsOf(tl.offsets("B", "orders")), to)
		}
		return nil
	})
	timed("failover_first_record", first.At.Sub(fault))
	waitFor(t, 30*time.Second, "the fleet consumes 300 records of B's orders", func() error {
		if n := sum(offsetsOf(tl.offsets("B", "orders"))); n < 300 {
			return fmt.Errorf("committed on B's orders: %d records", n)
		}
		return nil
	})

	// 4. A's broker comes back on its data; the producer moves back.
	a.start(t)
	timed("kafka_a_restart_ready", a.waitReady(t, 2*time.Minute))
	aReady := time.Now()
	pb1.finish(t, time.Minute)
	pa2 := startNamedProducer(t, "a2", a.addr, "orders", produceRate)
	activeA := tl.waitActive(t, aReady, "A", failbackStable+time.Minute)
	timed("failback_switched", activeA.Sub(aReady))
	failback := lastSwitchOf(t, tl, "B", "A", outagePartitions, 10*time.Second)
	// The leader counts the unmirrored tail after the failback and then
	// writes its history entry again, with late_counted.
	waitFor(t, 45*time.Second, "the failback's entry in history/ with the unmirrored tail counted", func() error {
		evs, err := tl.history()
		if err != nil {
			return err
		}
		if failback = evs[len(evs)-1]; failback.From != "B" || failback.To != "A" || !failback.LateCounted {
			return fmt.Errorf("history/%d %s → %s: late_counted %v", failback.Epoch, failback.From, failback.To, failback.LateCounted)
		}
		return nil
	})
	timed("failback_late_counted", time.Since(activeA))
	rep.Methods["failback"] = streamMethods(failback)
	t.Logf("failback: %s", describeStreams(failback))
	checkStreams(t, failback, "B", "A")
	for _, ps := range failback.Partitions {
		if ps.Method != "fingerprint" {
			errorf(t, "failback translated %s/%d (written on %s) by %s (%s), want fingerprint: A holds everything consumed on B", ps.FromTopic, ps.Partition, ps.Origin, ps.Method, ps.Detail)
		}
	}
	for _, c := range failbackChecks(tl, aReady) {
		t.Logf("state/failback: %s", c)
		rep.Details = append(rep.Details, "state/failback after A was ready: "+c)
	}

	// 5. Verdict: the producer stops; MirrorMaker 2 copies the rest of B's
	// orders to A; the fleet consumes everything on A.
	waitFor(t, 30*time.Second, "the fleet consumes A's orders again", func() error {
		return movedPast(tl.offsets("A", "orders"), failback, "A")
	})
	pa2.finish(t, time.Minute)
	bEnds, err := endOffsets(b.addr, "orders")
	if err != nil {
		fatal(t, err)
	}
	waitFor(t, time.Minute, "MirrorMaker 2 copies B's orders to A's B.orders", func() error { return atLeast(a.addr, "B.orders", bEnds) })
	aEnds, err := endOffsets(a.addr, "orders")
	if err != nil {
		fatal(t, err)
	}
	// The fleet consumes B.orders to the end of A's copy, read on each
	// look: MirrorMaker 2 copies at least once, so the copy may hold
	// records twice (what it had sent but not committed when it was
	// stopped, sent again once continued) and end past B's orders.
	waitFor(t, time.Minute, "the fleet consumes all of A's orders and B.orders", func() error {
		if err := tl.caughtUp("A", "orders", aEnds); err != nil {
			return err
		}
		copyEnds, err := endOffsets(a.addr, "B.orders")
		if err != nil {
			return err
		}
		return tl.caughtUp("A", "B.orders", copyEnds)
	})
	if s, ok := tl.active(); !ok || s.Cluster != "A" || s.Phase != "active" {
		errorf(t, "the fleet ends on %+v, want A active", s)
	}

	content := map[physical]map[int32][]kRecord{}
	for _, pt := range []physical{{"A", "orders"}, {"A", "B.orders"}, {"B", "A.orders"}, {"B", "orders"}} {
		on := a.addr
		if pt.Cluster == "B" {
			on = b.addr
		}
		if content[pt], err = readTopic(on, pt.Topic); err != nil {
			fatal(t, err)
		}
	}
	written := map[string]bool{}
	byProducer := map[string]int{}
	for _, pt := range []physical{{"A", "orders"}, {"B", "orders"}} {
		for _, recs := range content[pt] {
			for _, r := range recs {
				if written[r.Value] {
					errorf(t, "%s is twice on %s's %s: the idempotent producer wrote it once", r.Value, pt.Cluster, pt.Topic)
				}
				written[r.Value] = true
				byProducer[producerOf(r.Value)]++
			}
		}
	}
	t.Logf("written: %d to A before it failed (of %d handed to kcat), %d to B, %d to A after its return",
		byProducer["a1"], pa1.count(), byProducer["b1"], byProducer["a2"])
	if byProducer["b1"] != pb1.count() || byProducer["a2"] != pa2.count() {
		errorf(t, "B's orders holds %d records of the %d written to it, A's orders %d of the %d written after its return",
			byProducer["b1"], pb1.count(), byProducer["a2"], pa2.count())
	}
	if byProducer["a1"] == 0 || byProducer["a1"] > pa1.count() || len(byProducer) != 3 {
		errorf(t, "records by producer on A's and B's orders: %v; the producer of A wrote at most %d", byProducer, pa1.count())
	}
	delivered := readDelivered(t, b, len(written))

	// What an operator sees: etcdctl get --prefix …/history/.
	shown := historyByEtcdctl(t, etcd)
	if len(shown) != 2 {
		fatalf(t, "etcdctl shows %d switches in history/, want the failover and the failback", len(shown))
	}
	for _, ev := range shown {
		for _, line := range partitionLines(ev) {
			t.Logf("history/%d %s → %s: %s", ev.Epoch, ev.From, ev.To, line)
		}
	}
	fb := shown[1]
	t.Logf("failback late: %d records, by at most %.1f s (late_counted %v)", fb.Late, fb.LateBySeconds, fb.LateCounted)
	if !fb.LateCounted {
		errorf(t, "etcdctl shows the failback history/%d without late_counted", fb.Epoch)
	}
	for _, pair := range [][2]string{{"A.orders", "orders"}, {"orders", "B.orders"}} {
		n := 0
		for _, ps := range fb.Partitions {
			if ps.FromTopic == pair[0] && ps.ToTopic == pair[1] {
				n++
			}
		}
		if n != ordersPartitions {
			errorf(t, "the failback in history/ moves %d partitions from %s to %s, want %d", n, pair[0], pair[1], ordersPartitions)
		}
	}

	// The tail, counted from outside: A's records of its first producer
	// that B's A.orders lacked when the fleet switched (B's copy holds A's
	// offsets: A.orders began empty with orders). The fleet, paused,
	// consumed none of them before A died.
	var tail, lagged int64
	var perPartition []string
	for p := range int32(ordersPartitions) {
		n := int64(0)
		for _, r := range content[physical{"A", "orders"}][p] {
			if producerOf(r.Value) == "a1" {
				n++
			}
		}
		tail += n - replicatedAtFault[p]
		perPartition = append(perPartition, fmt.Sprintf("%d: %d", p, n-replicatedAtFault[p]))
	}
	for _, ps := range failover.Partitions {
		lagged += ps.Lagged
	}
	// MirrorMaker 2 may still copy, once continued, what it had fetched
	// from A before it was stopped: the tail is what B lacked at the
	// switch, a few records short of what A took meanwhile.
	t.Logf("A's unmirrored tail: %d records (%s), %d of them consumed before A died; the failback counts %d late; "+
		"MirrorMaker 2 copied %d records it held when stopped after it was continued",
		tail, strings.Join(perPartition, ", "), lagged, fb.Late, sum(replicatedAtFault)-sum(mirrored))
	if tail <= 0 {
		errorf(t, "A's unmirrored tail is %d records: A took %d while MirrorMaker 2 was stopped, and B has them all", tail, tailRecords)
	}
	if fb.Late != tail-lagged {
		errorf(t, "the failback counts %d late records, want %d: A's unmirrored tail (%d) less those consumed before A died (%d)", fb.Late, tail-lagged, tail, lagged)
	}
	// The leader adds the count to its metric just after writing it.
	if err := wait.Until(5*time.Second, func() error {
		if n, err := sumMetric(agents, "kswitch_late_records_total"); err != nil || int64(n) != fb.Late {
			return fmt.Errorf("kswitch_late_records_total over the agents: %v (%v), the failback counted %d", n, err, fb.Late)
		}
		return nil
	}); err != nil {
		fail(t, err)
	}
	rep.Details = append(rep.Details, fmt.Sprintf("A's unmirrored tail %d records (MirrorMaker 2 stopped while A took them), %d consumed before A died; the failback's late count %d, by at most %.1f s",
		tail, lagged, fb.Late, fb.LateBySeconds))

	// Every record written is delivered; the committed ranges of both
	// streams account for every delivery.
	events, err := tl.history()
	if err != nil {
		fatal(t, err)
	}
	var segs []segment
	for _, origin := range []string{"A", "B"} {
		final := offsetsOf(tl.offsets("A", streamTopic(origin, "A")))
		ss, err := streamSegments(events, origin, func(cluster string) string { return streamTopic(origin, cluster) }, ordersPartitions, "A", final)
		if err != nil {
			fatal(t, err)
		}
		segs = append(segs, ss...)
	}
	handOvers := map[physical]map[int32]map[int64]bool{}
	for pt := range content {
		handOvers[pt] = tl.handOvers(pt.Cluster, pt.Topic)
	}
	redeliverable := redeliverableFrom(replicatedAtFault, failover, "A.orders")
	v, err := judgeStreams(judgeInput{
		segs: segs, content: content, written: written, delivered: delivered, handOvers: handOvers,
		// A record of A consumed there that B's A.orders lacked when A
		// failed, consumed again on B once MirrorMaker 2 copied it, or
		// one the failover declared rewound.
		unreplicated: func(ds []delivery) bool {
			return len(ds) == 2 && ds[0].Origin == "A" && ds[0].Segment == 0 && ds[0].Cluster == "A" &&
				ds[1].Segment == 1 && ds[1].Cluster == "B" && ds[1].Offset >= redeliverable[ds[1].Partition]
		},
	})
	if err != nil {
		fatal(t, err)
	}
	if dups := duplicated(delivered); len(dups) > 0 {
		t.Logf("delivered more than once: %s", strings.Join(dups, ", "))
		rep.Details = append(rep.Details, "delivered more than once: "+strings.Join(dups, ", "))
	}
	verdictHolds(t, &rep, v, tl, "duplicates not explained")
	timed("scenario", time.Since(began))
	return rep
}

// putRev writes key with the real etcdctl and returns the revision of the
// write.
func putRev(t *testing.T, etcd *etcdCluster, key, value string) int64 {
	t.Helper()
	out, err := etcd.etcdctl("put", "-w", "json", key, value)
	if err != nil {
		fatal(t, err)
	}
	var resp struct {
		Header struct {
			Revision int64 `json:"revision"`
		} `json:"header"`
	}
	if err := json.Unmarshal([]byte(out), &resp); err != nil || resp.Header.Revision == 0 {
		fatalf(t, "etcdctl put -w json printed %q: %v", out, err)
	}
	return resp.Header.Revision
}

// signalsApplied returns nil once every agent reports (/status) that all
// its partitions obey the signals of revision rev.
func signalsApplied(agents []*agentProc, rev int64) error {
	for _, a := range agents {
		var st struct {
			SignalsApplied int64 `json:"signals_applied"`
		}
		if _, err := getJSON("http://"+a.http+"/status", &st); err != nil {
			return fmt.Errorf("%s: %w", a.id, err)
		}
		if st.SignalsApplied < rev {
			return fmt.Errorf("%s obeys the signals of revision %d, the pause is %d", a.id, st.SignalsApplied, rev)
		}
	}
	return nil
}

// atLeast returns nil when every partition of topic on addr ends at or
// past want's offset for it.
func atLeast(addr, topic string, want map[int32]int64) error {
	ends, err := endOffsets(addr, topic)
	if err != nil {
		return err
	}
	for p, o := range want {
		if ends[p] < o {
			return fmt.Errorf("%s on %s ends at %v, want at least %v", topic, addr, ends, want)
		}
	}
	return nil
}

// movedPast returns nil when the fleet has committed past the failback's
// translated position in every partition of the records written on origin.
func movedPast(committed map[int32]committedOffset, ev switchEvent, origin string) error {
	for _, ps := range ev.Partitions {
		if ps.Origin == origin && committed[ps.Partition].Offset <= ps.ToOffset {
			return fmt.Errorf("%s/%d committed at %d, translated to %d", ps.ToTopic, ps.Partition, committed[ps.Partition].Offset, ps.ToOffset)
		}
	}
	return nil
}

// checkStreams checks that a switch from → to moved both streams of every
// partition, each between its own physical topics.
func checkStreams(t *testing.T, ev switchEvent, from, to string) {
	t.Helper()
	seen := map[string]int{}
	for _, ps := range ev.Partitions {
		want := [2]string{streamTopic(ps.Origin, from), streamTopic(ps.Origin, to)}
		if ps.Topic != "orders" || (ps.Origin != "A" && ps.Origin != "B") || ps.FromTopic != want[0] || ps.ToTopic != want[1] {
			errorf(t, "switch %d %s → %s moved %s/%d written on %q from %s to %s, want %s to %s",
				ev.Epoch, from, to, ps.Topic, ps.Partition, ps.Origin, ps.FromTopic, ps.ToTopic, want[0], want[1])
		}
		seen[ps.Origin]++
	}
	if seen["A"] != ordersPartitions || seen["B"] != ordersPartitions {
		errorf(t, "switch %d moved partitions by origin %v, want %d of each", ev.Epoch, seen, ordersPartitions)
	}
}

// streamMethods lists a switch's methods per physical partition, for the
// report: "A.orders→orders/0:fingerprint".
func streamMethods(ev switchEvent) []string {
	var out []string
	for _, ps := range ev.Partitions {
		out = append(out, fmt.Sprintf("%s→%s/%d:%s", ps.FromTopic, ps.ToTopic, ps.Partition, ps.Method))
	}
	sort.Strings(out)
	return out
}

func describeStreams(ev switchEvent) string {
	return fmt.Sprintf("epoch %d %s → %s (%s) in %v, phases %v, late %d; %s", ev.Epoch, ev.From, ev.To, ev.Reason,
		ev.Finished.Sub(ev.Started).Round(time.Millisecond), ev.Phases, ev.Late, strings.Join(partitionLines(ev), "; "))
}

// partitionLines says how a switch moved each physical partition.
func partitionLines(ev switchEvent) []string {
	ps := append([]partitionSwitch(nil), ev.Partitions...)
	sort.Slice(ps, func(i, j int) bool {
		if ps[i].Origin != ps[j].Origin {
			return ps[i].Origin < ps[j].Origin
		}
		return ps[i].Partition < ps[j].Partition
	})
	var out []string
	for _, p := range ps {
		out = append(out, fmt.Sprintf("%s/%d → %s/%d (written on %s): %d → %d by %s, rewound %d, lagged %d, late %d",
			p.FromTopic, p.Partition, p.ToTopic, p.Partition, p.Origin, p.FromOffset, p.ToOffset, p.Method, p.Rewound, p.Lagged, p.Late))
	}
	return out
}

// historyByEtcdctl reads the switch events with the real etcdctl, oldest
// first.
func historyByEtcdctl(t *testing.T, etcd *etcdCluster) []switchEvent {
	t.Helper()
	out, err := etcd.etcdctl("get", "--prefix", fleetPrefix+"history/")
	if err != nil {
		fatal(t, err)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	var evs []switchEvent
	for i := 0; i+1 < len(lines); i += 2 {
		var ev switchEvent
		if err := json.Unmarshal([]byte(lines[i+1]), &ev); err != nil {
			fatalf(t, "etcdctl get --prefix %shistory/: %s is not a switch event: %v", fleetPrefix, lines[i], err)
		}
		for _, ps := range ev.Partitions {
			if ps.Method == "" {
				errorf(t, "etcdctl shows %s without a translation method for %s/%d", lines[i], ps.FromTopic, ps.Partition)
			}
		}
		evs = append(evs, ev)
	}
	sort.Slice(evs, func(i, j int) bool { return evs[i].Epoch < evs[j].Epoch })
	return evs
}

// failbackChecks are the leader's failback checks (state/failback) the
// suite saw since, one sentence each.
func failbackChecks(tl *timeline, since time.Time) []string {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	var out []string
	for _, ev := range tl.events {
		if ev.Key != "state/failback" || ev.Deleted || ev.At.Before(since) {
			continue
		}
		var c struct {
			Epoch    int64  `json:"epoch"`
			CaughtUp bool   `json:"caught_up"`
			Reason   string `json:"reason"`
			Behind   int    `json:"behind"`
		}
		if json.Unmarshal(ev.Value, &c) != nil {
			out = append(out, fmt.Sprintf("+%.1f s: not JSON: %q", ev.At.Sub(since).Seconds(), ev.Value))
			continue
		}
		state := "caught up"
		if !c.CaughtUp {
			state = fmt.Sprintf("waiting, %d partitions behind: %s", c.Behind, c.Reason)
		}
		out = append(out, fmt.Sprintf("+%.1f s after A was ready (epoch %d): %s", ev.At.Sub(since).Seconds(), c.Epoch, state))
	}
	return out
}

// producerOf returns the producer name of a value r-<name>-<n>.
func producerOf(value string) string {
	f := strings.Split(value, "-")
	if len(f) != 3 || f[0] != "r" {
		return "?"
	}
	return f[1]
}

// duplicated lists the values the channel topic holds more than once,
// with their counts (at most 20).
func duplicated(delivered map[int32][]kRecord) []string {
	n := map[string]int{}
	for _, recs := range delivered {
		for _, r := range recs {
			n[r.Value]++
		}
	}
	var out []string
	for _, v := range sortedKeys(n) {
		if n[v] > 1 {
			if len(out) == 20 {
				out = append(out, "…")
				break
			}
			out = append(out, fmt.Sprintf("%s ×%d", v, n[v]))
		}
	}
	return out
}

// sumMetric adds an unlabelled metric over the agents (a counter of the
// leader's: whichever agent led when it counted).
func sumMetric(agents []*agentProc, name string) (float64, error) {
	var total float64
	for _, a := range agents {
		v, err := a.metric(name)
		if err != nil {
			return 0, err
		}
		total += v
	}
	return total, nil
}

//go:build integration

package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// A topic pin on the real stack: the fleet consumes two topics, orders and
// audit, on A; `kswitch failover --to B --topic audit` moves audit alone to
// B's copy A.audit while orders goes on being consumed on A, and `kswitch
// failover --auto --topic audit` brings it back (agent/topics_test.go is
// the in-process version).

// auditTopic is the second source topic: on A, 4 partitions, mirrored to B.
const auditTopic = "audit"

// TestTopicPinOnRealKafka runs the topic pin on real processes: Kafka A and
// B (KRaft), MirrorMaker 2 A → B copying orders and audit, etcd ×3, three
// kswitch agents consuming both topics and two kcat producers, one per
// topic. The pin moves audit to B and back through the kswitch binary;
// orders stays on A, its partitions neither revoked nor moved and its
// commits going on during both moves. Read back with kcat: every record of
// both topics on A is in the channel topic, delivered twice only if the
// switch reported it lagged.
func TestTopicPinOnRealKafka(t *testing.T) { addReport(runTopicPin(t)) }

func runTopicPin(t *testing.T) (rep scenarioReport) {
	rep = newReport("topic-pin")
	rep.Covers = "two topics; kswitch failover --to B --topic audit moves audit alone to B while orders is consumed on A, unpaused; kswitch status; --auto --topic audit brings it back"
	defer func() { rep.Passed = !t.Failed() }()
	timed := rep.timer(t)
	policy := prefixPolicy
	// The channel stamps each delivery with its arrival on B: the gaps
	// between orders' deliveries show whether the moves held it up.
	st := startStackOpts(t, timed, policy, stackOptions{mirror: true, topics: []string{auditTopic}, appendTime: true})
	etcd, a, b, tl, began := st.etcd, st.a, st.b, st.tl, st.began
	eps := strings.Join(etcd.endpoints(), ",")
	topics := st.topics // orders, audit
	// topicOn names logical's physical topic on a cluster.
	topicOn := func(logical string) func(cluster string) string {
		return func(cluster string) string {
			if cluster == "B" {
				return policy.remoteOf(logical)
			}
			return logical
		}
	}
	remoteAudit := policy.remoteOf(auditTopic)
	conf := st.agentConfig()
	agentsAt := time.Now()
	var agents []*agentProc
	for i := 1; i <= 3; i++ {
		agents = append(agents, startAgentWith(t, fmt.Sprintf("agent-%d", i), conf))
	}
	// Values r-orders-0000042 and r-audit-0000042: unique across topics.
	prods := map[string]*producer{}
	for _, topic := range topics {
		prods[topic] = startNamedProducer(t, topic, a.addr, topic, produceRate)
	}

	// 1. Steady state: both topics consumed on A, MirrorMaker 2 copying
	// both to B.
	waitFor(t, time.Minute, "the fleet commits offsets on A for every partition of orders and audit", func() error {
		for _, topic := range topics {
			got := tl.offsets("A", topic)
			if len(got) < ordersPartitions {
				return fmt.Errorf("committed %s: %v", topic, offsetsOf(got))
			}
			for p, c := range got {
				if c.Offset == 0 {
					return fmt.Errorf("nothing consumed of %s/%d yet: %v", topic, p, offsetsOf(got))
				}
			}
		}
		return nil
	})
	timed("fleet_consuming_a", time.Since(agentsAt))
	waitFor(t, 30*time.Second, "MirrorMaker 2 copies audit's records to B", func() error {
		ends, err := endOffsets(b.addr, remoteAudit)
		if err != nil {
			return err
		}
		if sum(ends) == 0 {
			return fmt.Errorf("%s on B is empty", remoteAudit)
		}
		return nil
	})
	waitFor(t, 30*time.Second, "the fleet keeps up with A on both topics", func() error {
		for _, topic := range topics {
			ends, err := endOffsets(a.addr, topic)
			if err != nil {
				return err
			}
			// Within a commit interval of records.
			if lag := sum(ends) - sum(offsetsOf(tl.offsets("A", topic))); lag > produceRate/2 {
				return fmt.Errorf("the fleet lags A's %s by %d records", topic, lag)
			}
		}
		return nil
	})
	// A baseline of orders' commits: how far apart an agent's commits of
	// a partition are when nothing moves.
	steady := time.Now()
	waitFor(t, 30*time.Second, "a baseline of 12 commits of every orders partition", func() error {
		for p, ts := range advances(tl, "A", "orders") {
			if n := len(ts) - countBefore(ts, steady); n < 12 {
				return fmt.Errorf("orders/%d committed %d times since %s", p, n, steady.Format("15:04:05.000"))
			}
		}
		return nil
	})
	baseline := time.Now()
	baseGap := maxGaps(advances(tl, "A", "orders"), steady, baseline)
	t.Logf("orders' largest gap between commits over the %v baseline: %v", baseline.Sub(steady).Round(time.Millisecond), fmtGaps(baseGap))

	// 2. The pin: audit alone to B.
	cli := time.Now()
	out := kswitchCLI(t, "failover", "--etcd", eps, "--fleet", "orders", "--to", "B", "--topic", auditTopic)
	t.Logf("kswitch failover --to B --topic audit: %s", strings.TrimSpace(out))
	toB := waitTopicMove(t, tl, auditTopic, "A", "B", 0, pinSeen(t, tl, cli, false), 45*time.Second)
	timed("topic_b_switching", toB.switching.Sub(toB.pinned))
	timed("topic_b_active", toB.active.Sub(toB.pinned))
	timed("topic_b_first_record", toB.firstRecord.Sub(toB.pinned))
	timed("topic_b_history", toB.ev.Finished.Sub(toB.ev.Started))
	rep.Methods["topic_to_b"] = streamMethods(toB.ev)
	t.Logf("audit to B: %s", describeStreams(toB.ev))
	historyShown(t, etcd, toB.ev.Epoch)
	checkTopicSwitch(t, toB.ev, auditTopic, "audit", remoteAudit)
	// audit's positions on B advance: every partition committed by an
	// agent past the translated offset (waitTopicMove waited for it); and
	// go on advancing.
	atB := offsetsOf(tl.offsets("B", remoteAudit))
	waitFor(t, 20*time.Second, "audit's committed offsets on B advance", func() error {
		now := offsetsOf(tl.offsets("B", remoteAudit))
		for p := range int32(ordersPartitions) {
			if now[p] <= atB[p] {
				return fmt.Errorf("%s/%d still at %d (all: %v)", remoteAudit, p, now[p], now)
			}
		}
		return nil
	})
	rep.Details = append(rep.Details, ordersDuring(t, tl, "audit to B", toB, baseGap)...)

	// 3. What an operator sees: kswitch status, each agent's /status.
	status := kswitchCLI(t, "status", "--etcd", eps, "--fleet", "orders")
	if !strings.Contains(status, "audit on B") {
		errorf(t, "kswitch status does not say audit on B:\n%s", status)
	}
	for _, line := range strings.Split(status, "\n") {
		if strings.HasPrefix(line, "topic:") || strings.HasPrefix(line, "active:") {
			t.Logf("kswitch status: %s", line)
		}
	}
	waitFor(t, 10*time.Second, "the agents' /status shows audit's 4 partitions owned on B", func() error {
		var on []string
		for _, ag := range agents {
			var s struct {
				OwnedOn map[string][]struct {
					Topic     string `json:"topic"`
					Partition int32  `json:"partition"`
				} `json:"owned_on"`
			}
			if _, err := getJSON("http://"+ag.http+"/status", &s); err != nil {
				return fmt.Errorf("%s: %w", ag.id, err)
			}
			for c, tps := range s.OwnedOn {
				for _, tp := range tps {
					on = append(on, fmt.Sprintf("%s:%s/%d", c, tp.Topic, tp.Partition))
				}
			}
		}
		slices.Sort(on)
		want := []string{}
		for p := range ordersPartitions {
			want = append(want, fmt.Sprintf("B:%s/%d", remoteAudit, p))
		}
		if !slices.Equal(on, want) {
			return fmt.Errorf("owned elsewhere than the fleet's cluster: %v, want %v", on, want)
		}
		return nil
	})

	// 4. The pin deleted: audit back to A.
	cli = time.Now()
	out = kswitchCLI(t, "failover", "--etcd", eps, "--fleet", "orders", "--auto", "--topic", auditTopic)
	t.Logf("kswitch failover --auto --topic audit: %s", strings.TrimSpace(out))
	if out, err := etcd.etcdctl("get", fleetPrefix+"control/pin/topic/"+auditTopic); err != nil || strings.TrimSpace(out) != "" {
		fatalf(t, "control/pin/topic/audit after kswitch failover --auto --topic audit: %q, %v", out, err)
	}
	back := waitTopicMove(t, tl, auditTopic, "B", "A", toB.ev.Epoch, pinSeen(t, tl, cli, true), 45*time.Second)
	timed("topic_a_switching", back.switching.Sub(back.pinned))
	timed("topic_a_active", back.active.Sub(back.pinned))
	timed("topic_a_first_record", back.firstRecord.Sub(back.pinned))
	timed("topic_a_history", back.ev.Finished.Sub(back.ev.Started))
	rep.Methods["topic_to_a"] = streamMethods(back.ev)
	t.Logf("audit back to A: %s", describeStreams(back.ev))
	historyShown(t, etcd, back.ev.Epoch)
	checkTopicSwitch(t, back.ev, auditTopic, remoteAudit, "audit")
	rep.Details = append(rep.Details, ordersDuring(t, tl, "audit back to A", back, baseGap)...)
	// One cluster at a time: no agent committed audit on A while it was
	// placed on B, nor on B once it was back.
	if n := agentCommitsBetween(tl, "A", auditTopic, toB.activeIdx, back.switchingIdx); n > 0 {
		errorf(t, "agents committed audit on A %d times while it was placed on B", n)
	}
	if n := agentCommitsBetween(tl, "B", remoteAudit, back.activeIdx, -1); n > 0 {
		errorf(t, "agents committed %s on B %d times after audit was back on A", remoteAudit, n)
	}
	if got := tl.offsets("B", policy.remoteOf("orders")); len(got) > 0 {
		errorf(t, "the fleet committed %s on B (%v): orders never left A", policy.remoteOf("orders"), offsetsOf(got))
	}

	// 5. Verdict: stop producing, let the fleet finish A, read everything
	// back.
	ends := map[string]map[int32]int64{}
	for _, topic := range topics {
		prods[topic].finish(t, time.Minute)
	}
	for _, topic := range topics {
		var err error
		if ends[topic], err = endOffsets(a.addr, topic); err != nil {
			fatal(t, err)
		}
		if got := sum(ends[topic]); got != int64(prods[topic].count()) {
			errorf(t, "A's %s holds %d records, its producer wrote %d", topic, got, prods[topic].count())
		}
	}
	waitFor(t, time.Minute, "the fleet consumes all of A's orders and audit", func() error {
		for _, topic := range topics {
			if err := tl.caughtUp("A", topic, ends[topic]); err != nil {
				return err
			}
		}
		return nil
	})
	content := map[physical]map[int32][]kRecord{}
	for _, pt := range []physical{{"A", "orders"}, {"A", auditTopic}, {"B", remoteAudit}} {
		on := a.addr
		if pt.Cluster == "B" {
			on = b.addr
		}
		var err error
		if content[pt], err = readTopic(on, pt.Topic); err != nil {
			fatal(t, err)
		}
	}
	written := map[string]bool{}
	byProducer := map[string]int{}
	for _, topic := range topics {
		for _, recs := range content[physical{"A", topic}] {
			for _, r := range recs {
				if written[r.Value] {
					errorf(t, "%s is twice on A: the idempotent producer wrote it once", r.Value)
				}
				if producerOf(r.Value) != topic {
					errorf(t, "A's %s holds %s", topic, r.Value)
				}
				written[r.Value] = true
				byProducer[topic]++
			}
		}
	}
	delivered := readDelivered(t, b, len(written))
	events, err := tl.history()
	if err != nil {
		fatal(t, err)
	}
	if len(events) != 2 || events[0].Epoch != toB.ev.Epoch || events[1].Epoch != back.ev.Epoch {
		errorf(t, "history/ holds %d switches (epochs %v), want the two topic switches %d and %d", len(events), epochsOf(events), toB.ev.Epoch, back.ev.Epoch)
	}
	var segs []segment
	for _, topic := range topics {
		ss, err := topicSegments(events, topic, "", topicOn(topic), ordersPartitions, "A", offsetsOf(tl.offsets("A", topic)))
		if err != nil {
			fatal(t, err)
		}
		segs = append(segs, ss...)
	}
	handOvers := map[physical]map[int32]map[int64]bool{}
	for pt := range content {
		handOvers[pt] = tl.handOvers(pt.Cluster, pt.Topic)
	}
	// B's end of each partition of A.audit when the switch translated it:
	// a record consumed on A that B lacked then was delivered again from B
	// once MirrorMaker 2 copied it (a planned switch waits for the replica,
	// so there should be none).
	toEnd := map[int32]int64{}
	var lagged int64
	for _, ev := range []switchEvent{toB.ev, back.ev} {
		for _, ps := range ev.Partitions {
			lagged += ps.Lagged
			if ev.To == "B" {
				toEnd[ps.Partition] = ps.ToEnd
			}
		}
	}
	v, err := judgeStreams(judgeInput{
		segs: segs, content: content, written: written, delivered: delivered, handOvers: handOvers,
		unreplicated: func(ds []delivery) bool {
			return len(ds) == 2 && ds[0].Logical == auditTopic && ds[0].Segment == 0 && ds[0].Cluster == "A" &&
				ds[1].Segment == 1 && ds[1].Cluster == "B" && ds[1].Offset >= toEnd[ds[1].Partition]
		},
	})
	if err != nil {
		fatal(t, err)
	}
	rep.verdict = v
	t.Logf("verdict: %s", v)
	perTopic := map[string][2]int{} // delivered, duplicates
	seen := map[string]int{}
	for _, recs := range delivered {
		for _, r := range recs {
			seen[r.Value]++
			n := perTopic[producerOf(r.Value)]
			n[0]++
			if seen[r.Value] > 1 {
				n[1]++
			}
			perTopic[producerOf(r.Value)] = n
		}
	}
	for _, topic := range topics {
		t.Logf("%s: %d records written to A, %d deliveries, %d duplicates", topic, byProducer[topic], perTopic[topic][0], perTopic[topic][1])
		if byProducer[topic] != prods[topic].count() {
			errorf(t, "A's %s holds %d records, its producer wrote %d", topic, byProducer[topic], prods[topic].count())
		}
	}
	rep.Details = append(rep.Details, fmt.Sprintf("records: orders %d, audit %d; duplicates: orders %d, audit %d; the switches reported %d lagged",
		byProducer["orders"], byProducer[auditTopic], perTopic["orders"][1], perTopic[auditTopic][1], lagged))
	if dups := duplicated(delivered); len(dups) > 0 {
		t.Logf("delivered more than once: %s", strings.Join(dups, ", "))
		rep.Details = append(rep.Details, "delivered more than once: "+strings.Join(dups, ", "))
	}
	if !v.ok() {
		errorf(t, "lost %v (%d); duplicates not explained %v; deliveries the committed ranges do not explain %v", v.Lost, v.LostCount, v.BadDuplicates, v.PositionMismatch)
	}
	if int64(v.Duplicates-v.DuplicatesHandOver) > lagged {
		errorf(t, "%d duplicates (%d after a hand-over), more than the %d records the topic switches reported lagged", v.Duplicates, v.DuplicatesHandOver, lagged)
	}
	if perTopic["orders"][1] > v.DuplicatesHandOver {
		errorf(t, "orders, which never moved, has %d duplicates", perTopic["orders"][1])
	}
	// orders was not paused by the moves: its deliveries went on at their
	// pace (the channel's append times; audit's, paused while it moved,
	// for comparison).
	times, err := deliveryTimes(b.addr)
	if err != nil {
		fatal(t, err)
	}
	rep.Details = append(rep.Details, deliveryGaps(t, times, steady, baseline, map[string]topicMove{"audit to B": toB, "audit back to A": back})...)
	if dc := tl.doubleCommits(); len(dc) > 0 {
		errorf(t, "two agents committed one partition in one generation: %v", dc)
	}
	if s, ok := tl.active(); !ok || s.Cluster != "A" || s.Phase != "active" || len(s.Topics) != 0 {
		errorf(t, "the fleet ends on %+v, want A active without placements", s)
	}
	timed("scenario", time.Since(began))
	return rep
}

// topicMove is a topic switch as the suite saw it: the pin's change in
// etcd, state/active's topic switching then active, the history entry and
// the first agent commit past a translated position.
type topicMove struct {
	ev                                      switchEvent
	pinned, switching, active, firstRecord  time.Time
	switchingIdx, activeIdx                 int // indices in the timeline's events
	ordersBefore, ordersSwitching, ordersAt map[int32]int64
}

// pinSeen returns when the suite saw control/pin/topic/audit written
// (deleted: removed) at or after since.
func pinSeen(t *testing.T, tl *timeline, since time.Time, deleted bool) time.Time {
	t.Helper()
	var at time.Time
	waitFor(t, 10*time.Second, "the topic pin in etcd", func() error {
		ev, ok := tl.first(since, func(ev event) bool { return ev.Key == "control/pin/topic/"+auditTopic && ev.Deleted == deleted })
		if !ok {
			return fmt.Errorf("no change of control/pin/topic/%s (deleted %v) seen", auditTopic, deleted)
		}
		at = ev.At
		return nil
	})
	return at
}

// waitTopicMove waits until topic is consumed on `to` by itself: state/active
// keeps the fleet on A and places topic on B (to B) or nowhere (back to A),
// history/ has a switch of topic alone from → to after epoch after, and an
// agent has committed every partition of topic on `to` past its translated
// offset.
func waitTopicMove(t *testing.T, tl *timeline, topic, from, to string, after int64, pinned time.Time, timeout time.Duration) topicMove {
	t.Helper()
	mv := topicMove{pinned: pinned}
	placed := func(a activeState) bool {
		if a.Cluster != "A" || a.Phase != "active" {
			return false
		}
		if to == "A" {
			return len(a.Topics) == 0
		}
		e, ok := a.Topics[topic]
		return ok && len(a.Topics) == 1 && e.Cluster == to && e.Phase == "active"
	}
	waitFor(t, timeout, fmt.Sprintf("state/active places %s on %s", topic, to), func() error {
		a, _ := tl.active()
		if !placed(a) {
			return fmt.Errorf("state/active: %+v", a)
		}
		return nil
	})
	mv.switchingIdx, mv.switching = tl.firstIndex(pinned, func(ev event) bool {
		a, ok := parseActive(ev)
		return ok && a.Topics[topic].Cluster == to && a.Topics[topic].Phase == "switching"
	})
	mv.activeIdx, mv.active = tl.firstIndex(pinned, func(ev event) bool { a, ok := parseActive(ev); return ok && placed(a) })
	if mv.switchingIdx < 0 || mv.activeIdx < 0 {
		fatalf(t, "the suite's watch saw no state/active with %s switching to %s (%d) and then placed there (%d)", topic, to, mv.switchingIdx, mv.activeIdx)
	}
	waitFor(t, 10*time.Second, fmt.Sprintf("history/ records the switch of %s alone %s → %s", topic, from, to), func() error {
		evs, err := tl.history()
		if err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.Epoch > after && slices.Equal(ev.Topics, []string{topic}) && ev.From == from && ev.To == to && len(ev.Partitions) == ordersPartitions {
				mv.ev = ev
				return nil
			}
		}
		return fmt.Errorf("no switch of %s %s → %s after epoch %d in history/ (epochs %v)", topic, from, to, after, epochsOf(evs))
	})
	physicalOn := topic
	if to == "B" {
		physicalOn = mv.ev.Partitions[0].ToTopic
	}
	translated := map[int32]int64{}
	for _, ps := range mv.ev.Partitions {
		translated[ps.Partition] = ps.ToOffset
	}
	waitFor(t, 30*time.Second, fmt.Sprintf("agents commit every partition of %s on %s past the translated offsets", physicalOn, to), func() error {
		var missing []int32
		for p := range int32(ordersPartitions) {
			if _, ok := tl.first(pinned, func(ev event) bool {
				q, c, ok := offsetEvent(ev, to, physicalOn)
				return ok && q == p && !strings.HasPrefix(c.Agent, "leader:") && c.Offset > translated[p]
			}); !ok {
				missing = append(missing, p)
			}
		}
		if len(missing) > 0 {
			return fmt.Errorf("partitions %v not committed past %v yet (committed: %v)", missing, translated, offsetsOf(tl.offsets(to, physicalOn)))
		}
		return nil
	})
	first, _ := tl.first(pinned, func(ev event) bool {
		p, c, ok := offsetEvent(ev, to, physicalOn)
		return ok && !strings.HasPrefix(c.Agent, "leader:") && c.Offset > translated[p]
	})
	mv.firstRecord = first.At
	mv.ordersBefore = offsetsOf(tl.offsetsAt("A", "orders", pinned))
	mv.ordersSwitching = offsetsOf(tl.offsetsAt("A", "orders", mv.switching))
	mv.ordersAt = offsetsOf(tl.offsetsAt("A", "orders", mv.active))
	return mv
}

// checkTopicSwitch checks that a topic switch moved topic's partitions
// alone, each from fromTopic to toTopic, by fingerprint (or, for records
// the target lacked, by the offset-syncs, the lag reported).
func checkTopicSwitch(t *testing.T, ev switchEvent, topic, fromTopic, toTopic string) {
	t.Helper()
	seen := map[int32]bool{}
	for _, ps := range ev.Partitions {
		seen[ps.Partition] = true
		if ps.Topic != topic || ps.FromTopic != fromTopic || ps.ToTopic != toTopic {
			errorf(t, "the switch of %s (epoch %d) moved %s/%d from %s to %s, want %s to %s", topic, ev.Epoch, ps.Topic, ps.Partition, ps.FromTopic, ps.ToTopic, fromTopic, toTopic)
		}
		lagged := ps.Lagged > 0 && ps.Method == "mm2"
		if ps.Method != "fingerprint" && !lagged {
			errorf(t, "the switch of %s (epoch %d) translated %s/%d by %s (%s), want fingerprint: MirrorMaker 2 copies records faithfully and a planned switch waits for the replica",
				topic, ev.Epoch, ps.FromTopic, ps.Partition, ps.Method, ps.Detail)
		}
		if lagged {
			t.Logf("NOTE (scenario): %s/%d: the target lacked %d records the fleet consumed; translated by the offset-syncs (%s)", ps.FromTopic, ps.Partition, ps.Lagged, ps.Detail)
		}
	}
	if len(seen) != ordersPartitions {
		errorf(t, "the switch of %s (epoch %d) moved partitions %v, want %d", topic, ev.Epoch, slices.Sorted(maps.Keys(seen)), ordersPartitions)
	}
}

// ordersDuring checks that orders went on being consumed on A while mv
// moved audit, and returns the report's sentences: the fleet stayed on A
// (no switch of the fleet in history/ or state/active); no orders
// partition was revoked or changed owner in any assignment published
// during the move; every orders partition was committed further within a
// few seconds of the pin (and within the switch itself when it lasted
// long enough to hold commits); orders' largest gap between two commits
// of a partition stayed within twice the baseline's and a second.
func ordersDuring(t *testing.T, tl *timeline, what string, mv topicMove, baseGap map[int32]time.Duration) []string {
	t.Helper()
	end := mv.active.Add(2 * commitInterval)
	// The gaps around the window's end need the commit after it.
	waitFor(t, 15*time.Second, "orders committed after the move", func() error {
		for p, ts := range advances(tl, "A", "orders") {
			if len(ts) == 0 || !ts[len(ts)-1].After(end) {
				return fmt.Errorf("orders/%d last committed at %v", p, ts)
			}
		}
		return nil
	})
	if evs, err := tl.history(); err != nil {
		fail(t, err)
	} else {
		for _, ev := range evs {
			if len(ev.Topics) == 0 {
				errorf(t, "history/%d is a switch of the fleet %s → %s (%s): only audit was to move", ev.Epoch, ev.From, ev.To, ev.Reason)
			}
		}
	}
	for _, a := range tl.activeSince(mv.pinned) {
		if a.Cluster != "A" || (a.Phase != "active" && a.Phase != "") {
			errorf(t, "%s: state/active put the fleet %s %s (%s): only audit was to move", what, a.Phase, a.Cluster, a.Reason)
		}
	}
	for _, problem := range tl.ordersDisturbed(mv.pinned, end) {
		errorf(t, "%s: %s", what, problem)
	}

	all := advances(tl, "A", "orders")
	limit := max(3*time.Second, 2*slices.Max(slices.Collect(maps.Values(baseGap))))
	var inSwitch []string
	for p := range int32(ordersPartitions) {
		ts := all[p]
		i := countBefore(ts, mv.pinned)
		if i == len(ts) || ts[i].Sub(mv.pinned) > limit {
			errorf(t, "%s: orders/%d was not committed further within %v of the pin (commits after it: %v)", what, p, limit, ts[i:])
		}
		n := countBefore(ts, mv.active) - countBefore(ts, mv.switching)
		inSwitch = append(inSwitch, fmt.Sprintf("%d: %d", p, n))
		// A switch this long holds a commit interval of every partition
		// twice over: orders consumed throughout commits in it.
		if mv.active.Sub(mv.switching) >= 3*commitInterval && n == 0 {
			errorf(t, "%s: orders/%d committed nothing during the %v audit was switching", what, p, mv.active.Sub(mv.switching).Round(time.Millisecond))
		}
	}
	gap := maxGaps(all, mv.pinned, end)
	for p, g := range gap {
		if bound := 2*baseGap[p] + time.Second; g > bound {
			errorf(t, "%s: orders/%d went %v between two commits (baseline %v, bound %v): it was held up by the move", what, p, g.Round(time.Millisecond), baseGap[p].Round(time.Millisecond), bound.Round(time.Millisecond))
		}
	}
	moved := func(from, to map[int32]int64) int64 { return sum(to) - sum(from) }
	lines := []string{
		fmt.Sprintf("%s: pin → switching %.3f s → active %.3f s (history %.3f s: %s); orders committed on A %d at the pin, %d at switching, %d at active (+%d records during the switch); orders commits during the switch by partition %s; orders' largest commit gap %s (baseline %s)",
			what, mv.switching.Sub(mv.pinned).Seconds(), mv.active.Sub(mv.pinned).Seconds(), mv.ev.Finished.Sub(mv.ev.Started).Seconds(), fmtPhases(mv.ev.Phases),
			sum(mv.ordersBefore), sum(mv.ordersSwitching), sum(mv.ordersAt), moved(mv.ordersSwitching, mv.ordersAt), strings.Join(inSwitch, ", "), fmtGaps(gap), fmtGaps(baseGap)),
	}
	t.Log(lines[0])
	return lines
}

// deliveryTimes reads the channel topic back with kcat and returns, by
// logical topic (the producer of the value), when each delivery reached B
// (the broker's append time), oldest first.
func deliveryTimes(addr string) (map[string][]time.Time, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := kcat(ctx, "-C", "-b", addr, "-t", "delivered", "-o", "beginning", "-e", "-q", "-f", `%T\t%s\n`, "-X", "fetch.wait.max.ms=50")
	if err != nil {
		return nil, err
	}
	times := map[string][]time.Time{}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		ts, value, ok := strings.Cut(line, "\t")
		ms, err := strconv.ParseInt(ts, 10, 64)
		if !ok || err != nil || ms <= 0 {
			return nil, fmt.Errorf("kcat line %q: want a timestamp and a value", line)
		}
		times[producerOf(value)] = append(times[producerOf(value)], time.UnixMilli(ms))
	}
	for _, ts := range times {
		slices.SortFunc(ts, time.Time.Compare)
	}
	return times, nil
}

// deliveryGaps checks, from the channel's append times, that orders was
// not held up while audit moved: its largest gap between two deliveries
// during a move (the pin to two commit intervals after audit was active
// on its new cluster) stays within twice its baseline's and 150 ms, or is
// shorter than the switch, which a pause for the switch could not be
// (the rule of agent.TestTopicPinMovesOneTopicAlone). It returns the
// report's sentence. audit's own gap, its partitions released for the
// switch, shows what a pause looks like.
func deliveryGaps(t *testing.T, times map[string][]time.Time, from, to time.Time, moves map[string]topicMove) []string {
	t.Helper()
	gapOf := func(topic string, from, to time.Time) time.Duration {
		return maxGaps(map[int32][]time.Time{0: times[topic]}, from, to)[0]
	}
	base := gapOf("orders", from, to)
	baseAudit := gapOf(auditTopic, from, to)
	var parts []string
	for _, what := range slices.Sorted(maps.Keys(moves)) {
		mv := moves[what]
		end := mv.active.Add(2 * commitInterval)
		during, audit := gapOf("orders", mv.pinned, end), gapOf(auditTopic, mv.pinned, end)
		took := mv.ev.Finished.Sub(mv.ev.Started)
		parts = append(parts, fmt.Sprintf("%s (a switch of %v): orders %v, audit %v", what, took.Round(time.Millisecond), during.Round(time.Millisecond), audit.Round(time.Millisecond)))
		if limit := 2*base + 150*time.Millisecond; during > limit && during >= took {
			errorf(t, "%s: orders went %v without a delivery (baseline %v, limit %v; the switch took %v): the move of audit held it up", what, during, base, limit, took)
		}
	}
	line := fmt.Sprintf("largest gap between two deliveries (the channel's append times): baseline orders %v, audit %v; %s",
		base.Round(time.Millisecond), baseAudit.Round(time.Millisecond), strings.Join(parts, "; "))
	t.Log(line)
	return []string{line}
}

// advances returns, per partition of cluster/topic, when the suite saw an
// agent commit it past its previous committed offset, oldest first.
func advances(tl *timeline, cluster, topic string) map[int32][]time.Time {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	out := map[int32][]time.Time{}
	last := map[int32]int64{}
	for _, ev := range tl.events {
		p, c, ok := offsetEvent(ev, cluster, topic)
		if !ok || strings.HasPrefix(c.Agent, "leader:") {
			continue
		}
		if prev, seen := last[p]; !seen || c.Offset > prev {
			out[p] = append(out[p], ev.At)
		}
		last[p] = max(last[p], c.Offset)
	}
	return out
}

// countBefore returns how many of ts (sorted) are before at.
func countBefore(ts []time.Time, at time.Time) int {
	n, _ := slices.BinarySearchFunc(ts, at, func(x, at time.Time) int { return x.Compare(at) })
	return n
}

// maxGaps returns, per partition, the largest time between two
// consecutive commits in [from, to], counting the last one before from
// and the first one after to.
func maxGaps(adv map[int32][]time.Time, from, to time.Time) map[int32]time.Duration {
	out := map[int32]time.Duration{}
	for p, ts := range adv {
		i := max(countBefore(ts, from)-1, 0)
		for j := i + 1; j < len(ts); j++ {
			out[p] = max(out[p], ts[j].Sub(ts[j-1]))
			if ts[j].After(to) {
				break
			}
		}
	}
	return out
}

func fmtGaps(g map[int32]time.Duration) string {
	var parts []string
	for _, p := range slices.Sorted(maps.Keys(g)) {
		parts = append(parts, fmt.Sprintf("%d: %v", p, g[p].Round(time.Millisecond)))
	}
	return strings.Join(parts, ", ")
}

// fmtPhases lists a switch's phases in the order they run.
func fmtPhases(ph map[string]float64) string {
	var parts []string
	for _, k := range []string{"prepare", "revoke", "translate", "replica_wait", "activate"} {
		if v, ok := ph[k]; ok {
			parts = append(parts, fmt.Sprintf("%s %.3f s", k, v))
		}
	}
	for _, k := range sortedKeys(ph) {
		if !slices.Contains([]string{"prepare", "revoke", "translate", "replica_wait", "activate"}, k) {
			parts = append(parts, fmt.Sprintf("%s %.3f s", k, ph[k]))
		}
	}
	return strings.Join(parts, ", ")
}

func epochsOf(evs []switchEvent) []int64 {
	var out []int64
	for _, ev := range evs {
		out = append(out, ev.Epoch)
	}
	return out
}

// firstIndex is first, with the event's index in tl.events (-1 when none).
func (tl *timeline) firstIndex(since time.Time, match func(event) bool) (int, time.Time) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	for i, ev := range tl.events {
		if !ev.At.Before(since) && match(ev) {
			return i, ev.At
		}
	}
	return -1, time.Time{}
}

// offsetsAt returns the committed offsets of cluster/topic as the suite
// had seen them at time at.
func (tl *timeline) offsetsAt(cluster, topic string, at time.Time) map[int32]committedOffset {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	out := map[int32]committedOffset{}
	for _, ev := range tl.events {
		if ev.At.After(at) {
			break
		}
		if p, c, ok := offsetEvent(ev, cluster, topic); ok {
			out[p] = c
		}
	}
	return out
}

// activeSince returns the values of state/active the suite saw since.
func (tl *timeline) activeSince(since time.Time) []activeState {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	var out []activeState
	for _, ev := range tl.events {
		if a, ok := parseActive(ev); ok && !ev.At.Before(since) {
			out = append(out, a)
		}
	}
	return out
}

// agentCommitsBetween counts the agents' commits of cluster/topic among the
// timeline's events after index from and before index to (-1: the end).
func agentCommitsBetween(tl *timeline, cluster, topic string, from, to int) int {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	if to < 0 {
		to = len(tl.events)
	}
	n := 0
	for _, ev := range tl.events[from+1 : to] {
		if _, c, ok := offsetEvent(ev, cluster, topic); ok && !strings.HasPrefix(c.Agent, "leader:") {
			n++
		}
	}
	return n
}

// assignmentView is the part of state/assignment the suite reads: each
// cluster's section, its owners and revocations.
type assignmentView struct {
	Generation int64                     `json:"generation"`
	Cluster    string                    `json:"cluster"`
	Owned      map[string][]partitionRef `json:"owned"`
	Revoking   map[string][]partitionRef `json:"revoking"`
	Placed     map[string]struct {
		Owned    map[string][]partitionRef `json:"owned"`
		Revoking map[string][]partitionRef `json:"revoking"`
	} `json:"placed"`
}

type partitionRef struct {
	Topic     string `json:"topic"`
	Partition int32  `json:"partition"`
}

// ordersOn returns the owner of each orders partition in cluster A's
// section of the assignment, and the orders partitions being revoked.
func (a assignmentView) ordersOn() (owners map[int32]string, revoking []int32) {
	owned, rev := a.Owned, a.Revoking
	if a.Cluster != "A" {
		owned, rev = a.Placed["A"].Owned, a.Placed["A"].Revoking
	}
	owners = map[int32]string{}
	for id, tps := range owned {
		for _, tp := range tps {
			if tp.Topic == "orders" {
				owners[tp.Partition] = id
			}
		}
	}
	for _, tps := range rev {
		for _, tp := range tps {
			if tp.Topic == "orders" {
				revoking = append(revoking, tp.Partition)
			}
		}
	}
	return owners, revoking
}

// ordersDisturbed returns what the assignments published in [from, to]
// did to orders on A beyond leaving it be: a partition revoked, or owned
// by another agent than in the assignment in force at from.
func (tl *timeline) ordersDisturbed(from, to time.Time) []string {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	var before map[int32]string
	var out []string
	for _, ev := range tl.events {
		if ev.Key != "state/assignment" || ev.Deleted || ev.At.After(to) {
			continue
		}
		var a assignmentView
		if err := json.Unmarshal(ev.Value, &a); err != nil {
			out = append(out, fmt.Sprintf("state/assignment is not JSON: %v", err))
			continue
		}
		owners, revoking := a.ordersOn()
		if ev.At.Before(from) {
			before = owners
			continue
		}
		if len(revoking) > 0 {
			out = append(out, fmt.Sprintf("generation %d revokes orders partitions %v on A", a.Generation, revoking))
		}
		if !maps.Equal(owners, before) {
			out = append(out, fmt.Sprintf("generation %d gives orders' partitions on A to %v, before the move %v", a.Generation, owners, before))
		}
	}
	if before == nil {
		out = append(out, "no assignment in force before the move")
	}
	return out
}

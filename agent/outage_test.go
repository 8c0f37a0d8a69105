package agent_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/devstack/mirror"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/state"
)

// A real data-centre outage: A is gone for everyone, so its producers move
// to B and write B's own orders; MirrorMaker 2 runs both ways with its
// default naming (A's orders is A.orders on B, B's orders is B.orders on
// A). The fleet consumes every physical copy of orders on the active
// cluster: 4 partitions of each of two topics.
const outagePartitions = 2 * failoverPartitions

// twoWay is A and B, each with its own orders, and the mirrors A → B and
// B → A, with offsets that differ on every copy (fillers).
type twoWay struct {
	etcd   *devstack.Etcd
	a, b   *devstack.Kafka
	ab, ba *mirror.Mirror
}

func startTwoWay(t *testing.T) *twoWay {
	t.Helper()
	topics := map[string]int32{"orders": failoverPartitions}
	d := &twoWay{
		etcd: testenv.StartEtcdT(t),
		a:    testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: topics}),
		b:    testenv.StartKafkaT(t, "B", devstack.KafkaOptions{Topics: topics}),
	}
	start := func(src, dst *devstack.Kafka, prefill int) *mirror.Mirror {
		from := src.Name()
		m, err := mirror.Start(context.Background(), mirror.Config{
			Source: src.Brokers(), Target: dst.Brokers(), SourceName: from, TargetName: dst.Name(),
			Topics: []string{"orders"}, RemoteTopic: func(t string) string { return from + "." + t },
			TargetPrefill:    prefill,
			OffsetSyncsTopic: "mm2-offset-syncs." + from + ".internal", OffsetSyncsOnTarget: true,
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(m.Stop)
		return m
	}
	d.ab, d.ba = start(d.a, d.b, 17), start(d.b, d.a, 5)
	return d
}

func (d *twoWay) config(id string) config.Config {
	cfg := (&dc{etcd: d.etcd, a: d.a, b: d.b}).config(id)
	// Both flows keep their offset-syncs on their target (readable while
	// the source is down).
	cfg.Clusters["A"] = config.Cluster{Brokers: d.a.Brokers(), Role: config.RolePrimary, OffsetSyncsOn: "target"}
	// Two outages with their failbacks are four automatic switches within
	// a minute: with the default breaker (3), one attempt that fails on a
	// loaded machine (and is tried again) trips it before the last
	// failback. The breaker has tests of its own.
	cfg.Failover.MaxFailedSwitches = 10
	return cfg
}

// skipFillers acknowledges the mirrors' filler records without handing
// them to h: they are no producer's records.
func skipFillers(h record.Handler) record.Handler {
	return record.HandlerFunc(func(ctx context.Context, r *record.Record) error {
		for _, hd := range r.Headers {
			if string(hd.Key) == mirror.FillerHeader {
				r.Ack()
				return nil
			}
		}
		return h.Handle(ctx, r)
	})
}

// waitOwning waits until the agents consume cluster and own, together,
// every partition of both physical topics.
func waitOwning(t *testing.T, timeout time.Duration, cluster string, agents ...*agent.Agent) {
	t.Helper()
	wait.For(t, timeout, fmt.Sprintf("the fleet consumes %d partitions of %s", outagePartitions, cluster), func() error {
		c, err := activeOfN(outagePartitions, agents...)
		if err == nil && c != cluster {
			err = fmt.Errorf("active %s", c)
		}
		return err
	})
}

// waitProduced waits until p has written n more records than when called.
func waitProduced(t *testing.T, p *producer, n int64, what string) {
	t.Helper()
	from := p.next.Load()
	wait.For(t, 20*time.Second, what, func() error {
		if got := p.next.Load() - from; got < n {
			return fmt.Errorf("%d of %d written", got, n)
		}
		return nil
	})
}

// written returns every producer record on the clusters' local topics.
func (d *twoWay) written(t *testing.T) map[string]bool {
	ids := idsOn(t, d.a, "orders")
	maps.Copy(ids, idsOn(t, d.b, "orders"))
	return ids
}

// TestOutageProducersMoveAndMirrorBothWays: A dies for everyone while the
// mirror A → B lags behind (its unmirrored tail: records A acknowledged
// but had not copied to B); the producers move to B; the fleet fails over
// to B and consumes A.orders and B's own orders; A returns, the producers
// move back, and the fleet fails back only once A's B.orders holds what it
// consumed from B's orders (the failback gate says why it waits). Every
// acknowledged record is handled, A's tail after the failback, and the
// failback counts the tail exactly.
func TestOutageProducersMoveAndMirrorBothWays(t *testing.T) {
	t.Parallel()
	d := startTwoWay(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l := newLedger()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		agents = append(agents, startConsumer(t, d.config(id), skipFillers(l.handler(id))))
	}
	waitOwning(t, 20*time.Second, "A", agents...)
	pa := startProducer(t, d.a.Brokers(), "orders", 0)
	waitProduced(t, pa, 300, "records written to A")

	// The mirror A → B falls behind while the fleet has consumed no
	// further than B holds (paused), so that what A takes from now on is
	// its unmirrored tail and nobody consumed it before A died.
	put := func(key, val string) int64 {
		t.Helper()
		resp, err := cli.Put(context.Background(), key, val)
		if err != nil {
			t.Fatal(err)
		}
		return resp.Header.Revision
	}
	waitAllPaused(t, put(fleetKeys.FleetSignal(), "pause"), agents...)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	if err := d.ab.CaughtUp(ctx); err != nil {
		t.Fatal(err)
	}
	cancel()
	d.ab.Hold()
	waitProduced(t, pa, 200, "the unmirrored tail written to A")

	cfg := d.config("x")
	d.a.Fail()
	pa.halt()
	onB := idsOn(t, d.b, "A.orders")
	var tail []string
	for i := range pa.next.Load() {
		if id := fmt.Sprint(i); !onB[id] {
			tail = append(tail, id)
		}
	}
	t.Logf("A failed after writing %d records, %d of them not on B (the unmirrored tail)", pa.next.Load(), len(tail))
	if len(tail) < 200 {
		t.Fatalf("the tail is %d records; the set-up wrote 200 after the mirror stopped", len(tail))
	}
	put(fleetKeys.FleetSignal(), "start")

	// The producers move to B.
	pb := startProducer(t, d.b.Brokers(), "orders", 1_000_000)
	waitOwning(t, cfg.Failover.FailureWindow+10*time.Second, "B", agents...)
	waitProduced(t, pb, 300, "records written to B")
	waitAllHandled(t, l, onB, 20*time.Second)
	wait.For(t, 20*time.Second, "B's own records handled", func() error {
		if l.timesHandled("1000200") == 0 {
			return fmt.Errorf("record 1000200 not handled")
		}
		return nil
	})

	// A pause of the logical topic holds every copy of it: B's own orders
	// too. Nothing of B's records is handled while B takes 100 more.
	waitAllPaused(t, put(fleetKeys.TopicSignal("orders"), "pause"), agents...)
	before := l.handledFrom(1_000_000)
	waitProduced(t, pb, 100, "records written to B while orders is paused")
	if after := l.handledFrom(1_000_000); after != before {
		t.Errorf("%d of B's records handled while the topic was paused", after-before)
	}
	put(fleetKeys.TopicSignal("orders"), "start")

	// A returns, but the flow back B → A is behind: the fleet stays on B
	// and the leader says why.
	d.ba.Hold()
	d.a.Recover()
	pb.halt()
	pa2 := startProducer(t, d.a.Brokers(), "orders", 2_000_000)
	leader := leaderOf(t, agents...)
	wait.For(t, cfg.Failover.FailbackStable+20*time.Second, "the leader waiting for B.orders on A", func() error {
		st := leader.Status().Coordinator
		if st == nil || !strings.Contains(st.Verdict, "not caught up") || !strings.Contains(st.Verdict, "B.orders") {
			return fmt.Errorf("verdict %+v", st)
		}
		return nil
	})
	t.Logf("leader: %s", leader.Status().Coordinator.Verdict)
	// Operators see it too: kswitch status (from etcd alone) and a metric.
	op := operator(t, d.etcd)
	wait.For(t, 10*time.Second, "the wait in kswitch status and the metric", func() error {
		out := statusText(t, op, true)
		if !strings.Contains(out, "failback: waiting:") || !strings.Contains(out, "B.orders") {
			return fmt.Errorf("kswitch status says:\n%s", out)
		}
		if n, ok := metricValue(leader, "kswitch_failback_behind_partitions", nil); !ok || n != failoverPartitions {
			return fmt.Errorf("kswitch_failback_behind_partitions %v (%v), want %d", n, ok, failoverPartitions)
		}
		return nil
	})
	if c, err := activeOfN(outagePartitions, agents...); err != nil || c != "B" {
		t.Fatalf("the fleet left B before A held B's records: %s %v", c, err)
	}
	d.ba.Release()
	waitOwning(t, 20*time.Second, "A", agents...)
	waitProduced(t, pa2, 300, "records written to A after it returned")
	pa2.halt()
	// The mirror A → B catches up again: the next outage finds B whole.
	d.ab.Release()

	all := d.written(t)
	waitAllHandled(t, l, all, 30*time.Second)
	var evs []state.SwitchEvent
	wait.For(t, 30*time.Second, "the failback's tail counted", func() error {
		evs = readHistory(t, cli)
		if len(evs) < 2 || !evs[1].LateCounted {
			return fmt.Errorf("%d switches in history/, the tail not counted", len(evs))
		}
		return nil
	})
	logEvents(t, evs)
	if len(evs) != 2 {
		t.Fatalf("history has %d switches, want the failover and the failback", len(evs))
	}
	failover, failback := evs[0], evs[1]
	for _, ev := range evs {
		for _, ps := range ev.Partitions {
			t.Logf("epoch %d %s/%d (from %s): %s %d → %s %d by %s, lagged %d, late %d", ev.Epoch, ps.Topic, ps.Partition, ps.Origin,
				ps.FromTopic, ps.FromOffset, ps.ToTopic, ps.ToOffset, ps.Method, ps.Lagged, ps.Late)
		}
	}
	// Every stream moves: A's orders to B's A.orders, and on the way
	// back B's orders to A's B.orders and B's A.orders to A's orders,
	// each by fingerprint.
	if n := len(failover.Partitions); n != outagePartitions {
		t.Errorf("the failover moved %d partitions, want %d", n, outagePartitions)
	}
	for _, ps := range failback.Partitions {
		want := map[string][2]string{"A": {"A.orders", "orders"}, "B": {"orders", "B.orders"}}[ps.Origin]
		if ps.FromTopic != want[0] || ps.ToTopic != want[1] || ps.Method != "fingerprint" {
			t.Errorf("failback of %s/%d from %s: %s → %s by %s, want %s → %s by fingerprint",
				ps.Topic, ps.Partition, ps.Origin, ps.FromTopic, ps.ToTopic, ps.Method, want[0], want[1])
		}
	}
	// Late are the tail's records nobody consumed before the failover
	// (the pause holds the fleet; on a loaded machine a record or two
	// handed on as it took hold are consumed, and so not late). The
	// failover's revocation commits what was handled until then, so the
	// boundary is its end, not its start.
	late := 0
	for _, id := range tail {
		if at, ok := l.firstHandled(id); !ok || !at.Before(failover.Finished) {
			late++
		}
	}
	if failback.Late != int64(late) {
		t.Errorf("the failback counted %d late records, want %d: the %d of A's unmirrored tail less those handled before the failover",
			failback.Late, late, len(tail))
	}
	if n, ok := metricValue(leader, "kswitch_late_records_total", nil); !ok || n != float64(late) {
		t.Errorf("kswitch_late_records_total %v (%v), want %d", n, ok, late)
	}
	t.Logf("%d records written (%d to A before it failed, %d to B, %d to A after), 0 lost, %d duplicates; late %d, by at most %.1fs",
		len(all), pa.next.Load(), pb.next.Load()-1_000_000, pa2.next.Load()-2_000_000, l.duplicates(), failback.Late, failback.LateBySeconds)
	if dups, lagged := l.duplicates(), lagged(evs); int64(dups) > lagged {
		t.Errorf("%d duplicates, more than the %d records the replicas lagged by", dups, lagged)
	}
	l.check(t)
}

// TestOutageLeaderKilledMidSwitchThenASecondOutage: the same outage, with
// the leader killed in the middle of the failover, and A failing again
// right after the failback, when the fleet's positions in B's records are
// on A's B.orders and must go back to B's orders.
func TestOutageLeaderKilledMidSwitchThenASecondOutage(t *testing.T) {
	t.Parallel()
	d := startTwoWay(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l := newLedger()
	gates := map[string]*gate{}
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		g := &gate{}
		gates[id] = g
		agents = append(agents, startConsumer(t, d.config(id), skipFillers(g.handler(l, id))))
	}
	waitOwning(t, 20*time.Second, "A", agents...)
	cfg := d.config("x")
	pa := startProducer(t, d.a.Brokers(), "orders", 0)
	waitProduced(t, pa, 300, "records written to A")

	// Outage 1, with the sinks stalled so the switch waits in its revoke,
	// and the leader killed there.
	leader := leaderOf(t, agents...)
	rest := slices.DeleteFunc(slices.Clone(agents), func(a *agent.Agent) bool { return a == leader })
	stallAll(t, gates)
	d.a.Fail()
	pa.halt()
	pb := startProducer(t, d.b.Brokers(), "orders", 1_000_000)
	switching := waitSwitching(t, cli, cfg.Failover.FailureWindow)
	t.Logf("switch under way: %+v; killing the leader %s", switching, leader.ID())
	held := abortStalledLeader(t, leader, gates)
	waitOwning(t, cfg.Etcd.SessionTTL+cfg.Failover.FailureWindow+10*time.Second, "B", rest...)
	waitProduced(t, pb, 200, "records written to B")

	// A returns, the producers move back, the fleet fails back.
	d.a.Recover()
	pb.halt()
	pa2 := startProducer(t, d.a.Brokers(), "orders", 2_000_000)
	waitOwning(t, cfg.Failover.FailbackStable+20*time.Second, "A", rest...)
	waitProduced(t, pa2, 100, "records written to A after it returned")

	// Outage 2, right after the failback: the positions of B's records
	// are on A's B.orders now, and go back to B's orders.
	d.a.Fail()
	pa2.halt()
	pb2 := startProducer(t, d.b.Brokers(), "orders", 3_000_000)
	waitOwning(t, cfg.Failover.FailureWindow+10*time.Second, "B", rest...)
	waitProduced(t, pb2, 200, "records written to B in the second outage")
	d.a.Recover()
	pb2.halt()
	pa3 := startProducer(t, d.a.Brokers(), "orders", 4_000_000)
	waitOwning(t, cfg.Failover.FailbackStable+20*time.Second, "A", rest...)
	waitProduced(t, pa3, 100, "records written to A after the second outage")
	pa3.halt()

	all := d.written(t)
	waitAllHandled(t, l, all, 30*time.Second)
	evs := readHistory(t, cli)
	logEvents(t, evs)
	if len(evs) != 4 {
		t.Fatalf("history has %d switches, want two failovers and two failbacks", len(evs))
	}
	if !strings.Contains(evs[0].Reason, "resumed by") {
		t.Errorf("the first failover (%q) was not resumed by a new leader", evs[0].Reason)
	}
	// The second failover takes B's records back from A's B.orders to
	// B's orders, against the flow B → A.
	for _, ps := range evs[2].Partitions {
		if ps.Origin == "B" && (ps.FromTopic != "B.orders" || ps.ToTopic != "orders" || ps.Method == "none") {
			t.Errorf("second failover of %s/%d from B: %s → %s by %s, want B.orders → orders translated", ps.Topic, ps.Partition, ps.FromTopic, ps.ToTopic, ps.Method)
		}
	}
	_, dups, dupFirst := l.result(0)
	t.Logf("%d records written over two outages, 0 lost, %d duplicates (first handled by %v); the killed leader held %d unacknowledged, the replicas lagged by %d",
		len(all), dups, dupFirst, held, lagged(evs))
	if int64(dups) > int64(held)+lagged(evs) {
		t.Errorf("%d duplicates, more than the %d records the killed leader held and the %d the replicas lagged by", dups, held, lagged(evs))
	}
	l.check(t)
}

// lagged sums what the switches' targets lacked of what the fleet had
// consumed: records delivered again once the replicator copies them.
func lagged(evs []state.SwitchEvent) int64 {
	var n int64
	for _, ev := range evs {
		for _, ps := range ev.Partitions {
			n += ps.Lagged
		}
	}
	return n
}

// waitAllPaused waits until every agent obeys the signals at revision rev:
// nothing paused is handed on any more.
func waitAllPaused(t *testing.T, rev int64, agents ...*agent.Agent) {
	t.Helper()
	wait.For(t, 10*time.Second, "every agent paused", func() error {
		for _, a := range agents {
			if a.SignalsApplied() < rev {
				return fmt.Errorf("%s obeys revision %d, the pause is %d", a.ID(), a.SignalsApplied(), rev)
			}
		}
		return nil
	})
}

// handledFrom counts the distinct records handled whose number is at
// least from.
func (l *ledger) handledFrom(from int) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for id := range l.seen {
		if v, err := strconv.Atoi(id); err == nil && v >= from {
			n++
		}
	}
	return n
}

// TestACopyThatAppearsMidRunIsConsumedFromItsStart: a fleet that starts
// on A with initial_offset newest skips what A's orders held before it
// started; B's records copied to A later (MirrorMaker 2's flow back
// started after the fleet) are consumed from their start, every one.
func TestACopyThatAppearsMidRunIsConsumedFromItsStart(t *testing.T) {
	t.Parallel()
	topics := map[string]int32{"orders": failoverPartitions}
	d := &twoWay{
		etcd: testenv.StartEtcdT(t),
		a:    testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: topics}),
		b:    testenv.StartKafkaT(t, "B", devstack.KafkaOptions{Topics: topics}),
	}
	produce(t, d.a, "orders", 0, 100)               // before the fleet: skipped (newest)
	produce(t, d.b, "orders", 1_000_000, 1_000_100) // B's records, not on A yet
	l := newLedger()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2"} {
		cfg := d.config(id)
		cfg.Source.InitialOffset = "newest"
		agents = append(agents, startConsumer(t, cfg, l.handler(id)))
	}
	waitConsuming(t, 20*time.Second, "A", agents...) // A's orders only: there is no B.orders yet
	produce(t, d.a, "orders", 200, 300)

	// MirrorMaker 2's flow back starts: B.orders appears on A.
	m, err := mirror.Start(context.Background(), mirror.Config{
		Source: d.b.Brokers(), Target: d.a.Brokers(), SourceName: "B", TargetName: "A",
		Topics: []string{"orders"}, RemoteTopic: func(t string) string { return "B." + t },
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Stop)
	waitOwning(t, 20*time.Second, "A", agents...)
	want := map[string]bool{}
	for i := range 100 {
		want[strconv.Itoa(200+i)] = true
		want[strconv.Itoa(1_000_000+i)] = true
	}
	waitAllHandled(t, l, want, 20*time.Second)
	for i := range 100 {
		if n := l.timesHandled(strconv.Itoa(i)); n != 0 {
			t.Fatalf("record %d, written to A before the fleet started with initial_offset newest, was handled", i)
		}
	}
	if dups := l.duplicates(); dups != 0 {
		t.Errorf("%d duplicates", dups)
	}
	l.check(t)
}

package agent_test

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/devstack/mirror"
	"github.com/kswitch/kswitch/fleet"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/state"
)

// threeDC is two cities, three data centres: dc's A and B, and the remote
// D, which a second mirror fills with offsets 29 ahead of A's (B's are 17
// ahead): from A in a star (A → B, A → D: A.orders on D), from B in a
// chain (A → B → D: B.A.orders on D).
type threeDC struct {
	*dc
	d       *devstack.Kafka
	mirrorD *mirror.Mirror
	chain   bool
	// onD is A's orders on D.
	onD string
}

// startThreeDC starts a star or a chain; topics are the source topics on
// A (orders when none), each copied to B and D.
func startThreeDC(t testing.TB, chain bool, topics ...string) *threeDC {
	t.Helper()
	if len(topics) == 0 {
		topics = []string{"orders"}
	}
	d := &threeDC{dc: startDC(t, withTopics(topics...)), d: testenv.StartKafkaT(t, "D", devstack.KafkaOptions{}), chain: chain, onD: "A.orders"}
	mc := mirror.Config{
		Source: d.a.Brokers(), Target: d.d.Brokers(), SourceName: "A", TargetName: "D",
		Topics: topics, RemoteTopic: func(t string) string { return "A." + t },
		TargetPrefill: 29, OffsetSyncsTopic: "mm2-offset-syncs.A.internal", OffsetSyncsOnTarget: true,
	}
	if chain {
		d.onD = "B.A.orders"
		var copies []string
		for _, topic := range topics {
			copies = append(copies, "A."+topic)
		}
		mc.Source, mc.SourceName, mc.Topics = d.b.Brokers(), "B", copies
		mc.RemoteTopic, mc.OffsetSyncsTopic = func(t string) string { return "B." + t }, "mm2-offset-syncs.B.internal"
	}
	m, err := mirror.Start(context.Background(), mc)
	if err != nil {
		t.Fatal(err)
	}
	d.mirrorD = m
	t.Cleanup(m.Stop)
	return d
}

// config is dc's with D as the second standby, and the flows of the star
// or the chain.
func (d *threeDC) config(id string) config.Config {
	cfg := d.dc.config(id)
	cfg.Clusters = map[string]config.Cluster{
		"A": {Brokers: d.a.Brokers(), Role: config.RolePrimary},
		"B": {Brokers: d.b.Brokers(), Role: config.RoleStandby, Priority: 1},
		"D": {Brokers: d.d.Brokers(), Role: config.RoleStandby, Priority: 2},
	}
	into := config.Flow{From: "A", To: "D", OffsetSyncsOn: "target"}
	if d.chain {
		into.From = "B"
	}
	cfg.Replication = []config.Flow{{From: "A", To: "B", OffsetSyncsOn: "target"}, into}
	return cfg
}

// TestFailoverAlongTheChainAndStraightBack: A fails and the fleet moves to
// B, the first standby; B fails while the fleet is on it and the fleet
// moves to D, the second; A returns while B is still down and the fleet
// fails back from D to A directly. In a star no flow joins B and D (the
// records' fingerprints translate the positions); in a chain D holds A's
// orders as B.A.orders, and no flow joins D and A. Every record written
// on A is handled; a record is handled twice only when a replica lagged
// behind what the fleet had consumed, as the history says.
func TestFailoverAlongTheChainAndStraightBack(t *testing.T) {
	t.Parallel()
	for _, topology := range []string{"star", "chain"} {
		t.Run(topology, func(t *testing.T) {
			t.Parallel()
			failoverAlongTheChain(t, topology == "chain")
		})
	}
}

func failoverAlongTheChain(t *testing.T, chain bool) {
	d := startThreeDC(t, chain)
	l := newLedger()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		agents = append(agents, startConsumer(t, d.config(id), l.handler(id)))
	}
	waitConsuming(t, 20*time.Second, "A", agents...)
	p := startProducer(t, d.a.Brokers(), "orders", 0)
	wait.For(t, 20*time.Second, "records handled and mirrored to B and D", func() error {
		if h, b, dd := l.count(), d.mirror.Copied(), d.mirrorD.Copied(); h < 500 || b < 500 || dd < 500 {
			return fmt.Errorf("%d handled, %d mirrored to B, %d to D", h, b, dd)
		}
		return nil
	})
	cfg := d.config("x")
	switchWithin := cfg.Failover.ProbeInterval + cfg.Failover.FailureWindow + agent.PushPullInterval + 10*time.Second

	d.a.Fail()
	waitConsuming(t, switchWithin, "B", agents...)
	p.halt()
	waitAllHandled(t, l, idsOn(t, d.b, "A.orders"), 20*time.Second)

	d.b.Fail()
	waitConsuming(t, switchWithin, "D", agents...)
	waitAllHandled(t, l, idsOn(t, d.d, d.onD), 20*time.Second)
	// kswitch status shows the order and who is down.
	op := operator(t, d.etcd)
	var text string
	wait.For(t, 10*time.Second, "kswitch status showing A and B down, D active", func() error {
		text = statusText(t, op, false)
		for _, row := range []string{`primary +A +down`, `standby 1 +B +down`, `standby 2 \* +D +up .* \(active\)`} {
			if !regexp.MustCompile(row).MatchString(text) {
				return fmt.Errorf("no line matching %q in:\n%s", row, text)
			}
		}
		return nil
	})
	t.Logf("kswitch status on D:\n%s", text)

	backOnA(t, d.dc, l, cfg, agents...)
	waitAllHandled(t, l, idsOn(t, d.a, "orders"), 20*time.Second)
	// Back on A, the leader checks how far D is behind: in the star it
	// holds every record consumed on A once the mirror copied them; in
	// the chain, with B still down, it lacks what was consumed since in
	// every partition. The check runs every failback_stable, at least
	// every 10 s.
	wantBehind, what := 0, "state/clusters: D caught up with A"
	if chain {
		wantBehind, what = failoverPartitions, "state/clusters: D behind A in every partition while B is down"
	}
	wait.For(t, 25*time.Second, what, func() error {
		v, err := op.Status(context.Background())
		if err != nil {
			return err
		}
		if v.Clusters == nil || v.Clusters.Active != "A" {
			return fmt.Errorf("state/clusters %+v", v.Clusters)
		}
		for _, c := range v.Clusters.Clusters {
			if c.Name == "D" && (!c.Up || c.Behind != wantBehind) {
				return fmt.Errorf("D: %+v", c)
			}
		}
		return nil
	})

	cli := testenv.EtcdClientT(t, d.etcd)
	h := readHistory(t, cli)
	var path []string
	for _, ev := range h {
		path = append(path, ev.From+"→"+ev.To)
	}
	if got := fmt.Sprint(path); got != "[A→B B→D D→A]" {
		t.Errorf("switches %s, want [A→B B→D D→A]: failover down the chain, then straight back", got)
	}
	if dups, lagged := l.duplicates(), logHistory(t, d.etcd); int64(dups) > lagged {
		t.Errorf("%d duplicates, more than the %d records the replicas lagged by", dups, lagged)
	}
	l.check(t)
}

// TestPinToTheSecondStandbyAndBack: a pin names any source cluster; the
// fleet moves from A to D (translated along the flow A → D) while A and B
// are healthy and stays there, and goes back to A when the pin is
// removed. A planned switch waits for the replica: nothing is handled
// twice.
func TestPinToTheSecondStandbyAndBack(t *testing.T) {
	t.Parallel()
	d := startThreeDC(t, false)
	l, ho := newLedger(), newHandovers()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		agents = append(agents, startConsumer(t, d.config(id), ho.wrap(id, l.handler(id))))
	}
	waitConsuming(t, 20*time.Second, "A", agents...)
	p := startProducer(t, d.a.Brokers(), "orders", 0)
	waitFlowing(t, d.dc, l, 300)
	op := operator(t, d.etcd)
	ctx := context.Background()
	if err := op.Pin(ctx, "D"); err != nil {
		t.Fatal(err)
	}
	cfg := d.config("x")
	waitConsuming(t, 20*time.Second, "D", agents...)
	pinned := time.Now()
	// Held past failback_stable, A healthy all along.
	wait.For(t, cfg.Failover.FailbackStable+20*time.Second, "records handled on D past failback_stable", func() error {
		if since := time.Since(pinned); since < cfg.Failover.FailbackStable+time.Second {
			return fmt.Errorf("pinned for %v", since)
		}
		if c, err := activeOf(agents...); err != nil || c != "D" {
			return fmt.Errorf("the fleet left D while pinned to it: %q, %v", c, err)
		}
		return nil
	})
	if c, err := activeOf(agents...); err != nil || c != "D" {
		t.Fatalf("the fleet left D while pinned to it: %q, %v", c, err)
	}
	if err := op.Unpin(ctx); err != nil {
		t.Fatal(err)
	}
	waitConsuming(t, cfg.Failover.FailbackStable+20*time.Second, "A", agents...)
	dups, _ := drain(t, d.dc, l, ho, false, flow{p, "orders"})
	h := readHistory(t, testenv.EtcdClientT(t, d.etcd))
	var path []string
	for _, ev := range h {
		path = append(path, ev.From+"→"+ev.To)
		for _, ps := range ev.Partitions {
			if ps.Method != "fingerprint" {
				t.Errorf("%s → %s translated %s/%d by %s (%s), want fingerprint", ev.From, ev.To, ps.Topic, ps.Partition, ps.Method, ps.Detail)
			}
		}
	}
	if got := fmt.Sprint(path); got != "[A→D D→A]" {
		t.Errorf("switches %s, want [A→D D→A]", got)
	}
	if dups != 0 {
		t.Errorf("%d duplicates after planned switches", dups)
	}
}

// twoTopics is a star of three DCs whose fleet of three agents consumes
// orders and audit on A, records of both flowing.
type twoTopics struct {
	*threeDC
	cli           *clientv3.Client
	op            *fleet.Operator
	l             *ledger
	ho            *handovers
	orders, audit *producer
}

func startTwoTopics(t *testing.T) *twoTopics {
	t.Helper()
	f := &twoTopics{threeDC: startThreeDC(t, false, "orders", "audit"), l: newLedger(), ho: newHandovers()}
	f.cli, f.op = testenv.EtcdClientT(t, f.etcd), operator(t, f.etcd)
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		cfg := f.config(id)
		cfg.Source.Topics = []string{"orders", "audit"}
		agents = append(agents, startConsumer(t, cfg, f.ho.wrap(id, f.l.handler(id))))
	}
	waitBalanced(t, 2*failoverPartitions, agents...)
	f.orders = startProducer(t, f.a.Brokers(), "orders", 0)
	f.audit = startProducer(t, f.a.Brokers(), "audit", auditFrom)
	waitCounted(t, f.l, 300, "records of both topics flowing")
	return f
}

// placed is a condition: state/active places topics on cluster, none of
// them moving, the fleet on A.
func (f *twoTopics) placed(cluster string, topics ...string) func() error {
	return func() error {
		a, err := readActive(f.cli)
		if err != nil {
			return err
		}
		for _, topic := range topics {
			if c, moving := a.TopicCluster(topic); c != cluster || moving || a.Cluster != "A" {
				return fmt.Errorf("state/active: the fleet on %s, %s on %s (moving %v)", a.Cluster, topic, c, moving)
			}
		}
		return nil
	}
}

// drain checks that every record of both topics on A was handled, and
// returns the duplicates.
func (f *twoTopics) drain(t *testing.T) int {
	t.Helper()
	dups, _ := drain(t, f.dc, f.l, f.ho, false, flow{f.orders, "orders"}, flow{f.audit, "audit"})
	return dups
}

// TestTopicPinToTheSecondStandby: a topic pin names any source cluster:
// audit moves alone from A to D (along the flow A → D) while orders stays
// on A, and comes back when unpinned; every record of both topics is
// handled once.
func TestTopicPinToTheSecondStandby(t *testing.T) {
	t.Parallel()
	f := startTwoTopics(t)
	if err := f.op.PinTopic(t.Context(), "audit", "D"); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 30*time.Second, "audit consumed on D, orders on A", f.placed("D", "audit"))
	wait.For(t, 20*time.Second, "audit's records delivered from D", func() error {
		if n := f.l.handledOn("D"); n < 100 {
			return fmt.Errorf("%d records delivered from D", n)
		}
		return nil
	})
	if err := f.op.UnpinTopic(t.Context(), "audit"); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 30*time.Second, "audit back on A", f.placed("A", "audit"))
	dups := f.drain(t)
	var path []string
	for _, ev := range readHistory(t, f.cli) {
		path = append(path, fmt.Sprintf("%v %s→%s", ev.Topics, ev.From, ev.To))
	}
	if got := fmt.Sprint(path); got != "[[audit] A→D [audit] D→A]" {
		t.Errorf("switches %s, want audit alone A→D and back", got)
	}
	if dups != 0 {
		t.Errorf("%d duplicates after planned topic switches", dups)
	}
}

// TestStagedMoveToTheSecondStandby: a staged move names any source
// cluster: audit, then orders, move from A to D (along the flow A → D),
// each stage held and checked; then the move is ended and both come back
// to A. Every record of both topics is handled once.
func TestStagedMoveToTheSecondStandby(t *testing.T) {
	t.Parallel()
	f := startTwoTopics(t)
	plan := state.StagePlan{To: "D", Check: time.Second, Stages: []state.Stage{{Topics: []string{"audit"}}, {Topics: []string{"orders"}}}}
	if err := f.op.MoveInStages(t.Context(), plan); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 60*time.Second, "both stages done: audit and orders consumed on D", func() error {
		st, err := f.op.Status(t.Context())
		if err != nil {
			return err
		}
		if st.Stages == nil || st.Stages.Stage != 1 || st.Stages.Phase != state.StageDone {
			return fmt.Errorf("state/stages %+v", st.Stages)
		}
		return f.placed("D", "audit", "orders")()
	})
	before := f.l.handledOn("D")
	wait.For(t, 20*time.Second, "records of both topics delivered from D", func() error {
		if n := f.l.handledOn("D") - before; n < 200 {
			return fmt.Errorf("%d more records delivered from D", n)
		}
		return nil
	})
	if err := f.op.EndStagedMove(t.Context()); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 30*time.Second, "both topics back on A", f.placed("A", "audit", "orders"))
	dups := f.drain(t)
	var path []string
	for _, ev := range readHistory(t, f.cli) {
		path = append(path, fmt.Sprintf("%v %s→%s", ev.Topics, ev.From, ev.To))
		for _, ps := range ev.Partitions {
			if ps.Method != "fingerprint" {
				t.Errorf("%v %s → %s translated %s/%d by %s (%s), want fingerprint", ev.Topics, ev.From, ev.To, ps.Topic, ps.Partition, ps.Method, ps.Detail)
			}
		}
	}
	if !strings.HasPrefix(fmt.Sprint(path), "[[audit] A→D [orders] A→D ") {
		t.Errorf("switches %v, want audit, then orders, A→D, then back", path)
	}
	if dups != 0 {
		t.Errorf("%d duplicates after a staged move and its end", dups)
	}
}

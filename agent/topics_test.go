package agent_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/state"
)

// topicMeter follows, per logical topic, the deliveries the handlers see:
// the cluster of the last one, the largest gap between two deliveries
// since the last reset, and the generation each partition (of each
// cluster) was started under, which changes only when the partition is
// released and started again.
type topicMeter struct {
	mu      sync.Mutex
	last    map[string]time.Time
	cluster map[string]string
	maxGap  map[string]time.Duration
	starts  map[string]map[string]int64 // logical → cluster:topic/partition → generation
	times   map[string][]time.Time      // logical → every delivery's time
}

func newTopicMeter() *topicMeter {
	return &topicMeter{last: map[string]time.Time{}, cluster: map[string]string{}, maxGap: map[string]time.Duration{},
		starts: map[string]map[string]int64{}, times: map[string][]time.Time{}}
}

func (m *topicMeter) wrap(next record.Handler) record.Handler {
	return record.HandlerFunc(func(ctx context.Context, r *record.Record) error {
		m.mu.Lock()
		now := time.Now()
		if last, ok := m.last[r.SourceTopic]; ok {
			m.maxGap[r.SourceTopic] = max(m.maxGap[r.SourceTopic], now.Sub(last))
		}
		m.last[r.SourceTopic], m.cluster[r.SourceTopic] = now, r.Cluster
		m.times[r.SourceTopic] = append(m.times[r.SourceTopic], now)
		if m.starts[r.SourceTopic] == nil {
			m.starts[r.SourceTopic] = map[string]int64{}
		}
		m.starts[r.SourceTopic][fmt.Sprintf("%s:%s/%d", r.Cluster, r.Topic, r.Partition)] = r.Generation
		m.mu.Unlock()
		return next.Handle(ctx, r)
	})
}

// reset starts a new measurement of the gaps and returns the largest gap
// of each topic since the last reset.
func (m *topicMeter) reset() map[string]time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := m.maxGap
	m.maxGap = map[string]time.Duration{}
	return out
}

// generations returns, for logical topic, the generation each partition
// was last seen delivering under.
func (m *topicMeter) generations(logical string) map[string]int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return maps.Clone(m.starts[logical])
}

// gapIn returns logical's largest time without a delivery within
// [from, to], its ends included.
func (m *topicMeter) gapIn(logical string, from, to time.Time) time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	var gap time.Duration
	last := from
	for _, at := range m.times[logical] {
		if at.Before(from) || at.After(to) {
			continue
		}
		gap, last = max(gap, at.Sub(last)), at
	}
	return max(gap, to.Sub(last))
}

func (m *topicMeter) clusterOf(logical string) string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.cluster[logical]
}

// topicsFleet is a fleet of three agents consuming orders and audit from A
// under load, each record counted by a ledger and a topic meter.
type topicsFleet struct {
	d      *dc
	cli    *clientv3.Client
	l      *ledger
	ho     *handovers
	m      *topicMeter
	agents []*agent.Agent
	orders *producer
	audit  *producer
}

// auditFrom is the first id the audit producer writes: its ids never
// collide with orders'.
const auditFrom = 10_000_000

func startTopicsFleet(t *testing.T) *topicsFleet {
	t.Helper()
	f := &topicsFleet{d: startDC(t, withTopics("orders", "audit")), l: newLedger(), ho: newHandovers(), m: newTopicMeter()}
	f.cli = testenv.EtcdClientT(t, f.d.etcd)
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		f.start(t, id)
	}
	waitBalanced(t, 2*failoverPartitions, f.agents...)
	f.orders = startProducer(t, f.d.a.Brokers(), "orders", 0)
	f.audit = startProducer(t, f.d.a.Brokers(), "audit", auditFrom)
	wait.For(t, 20*time.Second, "records of both topics flowing", func() error {
		if f.l.timesHandled("100") == 0 || f.l.timesHandled(fmt.Sprint(auditFrom+100)) == 0 {
			return fmt.Errorf("%d handled", f.l.count())
		}
		return nil
	})
	return f
}

func (f *topicsFleet) start(t *testing.T, id string) *agent.Agent {
	cfg := plannedConfig(f.d, id)
	cfg.Source.Topics = []string{"orders", "audit"}
	a := startFleetAgent(t, cfg, agent.Options{Handler: f.m.wrap(f.ho.wrap(id, f.l.handler(id)))})
	f.agents = append(f.agents, a)
	return a
}

// pin puts (cluster != "") or deletes the pin of topic.
func (f *topicsFleet) pin(t *testing.T, topic, cluster string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var err error
	if cluster == "" {
		_, err = f.cli.Delete(ctx, fleetKeys.TopicPin(topic))
	} else {
		_, err = f.cli.Put(ctx, fleetKeys.TopicPin(topic), cluster)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// waitTopicOn waits until logical topic's records come from cluster and
// state/active says so, and returns the topic switch's history entry.
func (f *topicsFleet) waitTopicOn(t *testing.T, topic, cluster string, after int64) state.SwitchEvent {
	t.Helper()
	var ev state.SwitchEvent
	wait.For(t, 30*time.Second, topic+" consumed on "+cluster, func() error {
		a, err := readActive(f.cli)
		if err != nil {
			return err
		}
		if c, moving := a.TopicCluster(topic); c != cluster || moving {
			return fmt.Errorf("state/active places %s on %s (moving %v): %+v", topic, c, moving, a.Topics)
		}
		if got := f.m.clusterOf(topic); got != cluster {
			return fmt.Errorf("%s's last record came from %s", topic, got)
		}
		for _, e := range readHistory(t, f.cli) {
			if e.Epoch > after && slices.Equal(e.Topics, []string{topic}) && e.To == cluster {
				ev = e
				return nil
			}
		}
		return fmt.Errorf("no topic switch of %s to %s in history/ after epoch %d", topic, cluster, after)
	})
	return ev
}

// drain stops both producers once records written after now are handled
// and checks that every record on A was handled, returning the
// duplicates.
func (f *topicsFleet) drain(t *testing.T) int {
	t.Helper()
	dups, _ := drain(t, f.d, f.l, f.ho, true, flow{f.orders, "orders"}, flow{f.audit, "audit"})
	return dups
}

// TestTopicPinMovesOneTopicAlone: under load on orders and audit, a pin
// moves audit to B and its deletion brings it back. Each move revokes,
// translates and assigns audit's partitions only: orders' partitions are
// never released or restarted (they deliver under the generation they
// started with throughout), and its largest delivery gap during the moves
// is no larger than before them. Nothing is lost; translated by
// fingerprint, nothing is delivered twice. The moves are in history/ with
// their topics, and state/active and /status show the placement.
func TestTopicPinMovesOneTopicAlone(t *testing.T) {
	t.Parallel()
	f := startTopicsFleet(t)
	f.m.reset()
	// The baseline is 600 records (3 s at the producers' rate; longer on
	// a loaded machine, whose producers are slower too).
	began := time.Now()
	wait.For(t, 30*time.Second, "a baseline of delivery gaps", func() error {
		if f.l.count() < 600 {
			return fmt.Errorf("%d handled", f.l.count())
		}
		return nil
	})
	baselineFor := time.Since(began)
	base := f.m.reset()
	ordersGens := f.m.generations("orders")

	// Through the operator's calls, as kswitch failover --topic makes them.
	op := operator(t, f.d.etcd)
	if err := op.PinTopic(t.Context(), "audit", "B"); err != nil {
		t.Fatal(err)
	}
	toB := f.waitTopicOn(t, "audit", "B", 0)
	recordedWithActivation(t, f.cli)
	leader := leaderOf(t, f.agents...)
	st := leader.Status().Coordinator
	if st == nil || st.TopicPins["audit"] != "B" {
		t.Errorf("the leader's status shows topic pins %v, want audit on B", st)
	}
	if n, ok := metricValue(leader, "kswitch_topic_active_cluster", map[string]string{"topic": "audit", "cluster": "B"}); !ok || n != 1 {
		t.Errorf("kswitch_topic_active_cluster{topic=audit,cluster=B} %v (%v), want 1", n, ok)
	}
	if n, ok := metricValue(leader, "kswitch_active_cluster", map[string]string{"cluster": "A"}); !ok || n != 1 {
		t.Errorf("kswitch_active_cluster{cluster=A} %v (%v), want 1: the fleet stays on A", n, ok)
	}
	status := statusText(t, op, false)
	for _, want := range []string{"topic:   audit on B (epoch 2, consumed there", "topics placed on B", "B        A.audit/0", "A        orders/0"} {
		if !strings.Contains(status, want) {
			t.Errorf("kswitch status has no %q:\n%s", want, status)
		}
	}
	placed := 0
	for _, a := range f.agents {
		placed += len(a.Status().OwnedOn["B"])
	}
	if placed != failoverPartitions {
		t.Errorf("the agents' /status shows %d partitions owned on B, want audit's %d", placed, failoverPartitions)
	}
	if err := op.UnpinTopic(t.Context(), "audit"); err != nil {
		t.Fatal(err)
	}
	back := f.waitTopicOn(t, "audit", "A", toB.Epoch)
	during := f.m.reset()

	for _, ev := range []state.SwitchEvent{toB, back} {
		t.Logf("topic switch epoch %d %s→%s of %v in %v (%s): phases %v", ev.Epoch, ev.From, ev.To, ev.Topics,
			ev.Finished.Sub(ev.Started).Round(time.Millisecond), ev.Reason, ev.Phases)
		for _, ps := range ev.Partitions {
			if ps.Topic != "audit" {
				t.Errorf("the switch of audit translated %s/%d", ps.Topic, ps.Partition)
			}
			if ps.Method != "fingerprint" {
				t.Errorf("%s %s/%d translated by %s (%s)", ev.To, ps.ToTopic, ps.Partition, ps.Method, ps.Detail)
			}
		}
	}
	if !strings.HasPrefix(toB.Reason, "manual: topic pinned to B") || !strings.HasPrefix(back.Reason, "unpinned") {
		t.Errorf("reasons %q and %q", toB.Reason, back.Reason)
	}
	// Structural: orders was never paused, released or restarted.
	if got := f.m.generations("orders"); !maps.Equal(got, ordersGens) {
		t.Errorf("orders' partitions were restarted by the moves of audit: generations %v before, %v after", ordersGens, got)
	}
	t.Logf("largest delivery gap of orders: %v over %v before, %v during both moves of audit (audit: %v, %v)",
		base["orders"], baselineFor.Round(time.Millisecond), during["orders"], base["audit"], during["audit"])
	// A pause of orders for a switch would make its gap at least the
	// switch's length; on a loaded machine the gaps of every topic grow
	// with the noise, so the gap must be within twice the baseline's
	// (and 150 ms) or shorter than the longest switch.
	if !notPaused(during["orders"], base["orders"], toB, back) {
		t.Errorf("orders' largest delivery gap grew from %v to %v while audit moved, as long as a switch: orders was paused", base["orders"], during["orders"])
	}
	if a, err := readActive(f.cli); err != nil || len(a.Topics) != 0 || a.Cluster != "A" {
		t.Errorf("state/active after the pin was deleted: %+v (%v)", a, err)
	}
	if dups := f.drain(t); dups != 0 {
		t.Errorf("%d duplicates through two topic switches translated by fingerprint", dups)
	}
}

// TestFleetFailoverKeepsAPlacedTopic: audit is pinned to B, then A dies.
// The fleet fails over to B: orders is translated from A, audit, already
// on B, keeps its positions and owners there (its partitions are not
// restarted) and is not in the failover's translation. After A returns,
// the fleet fails back and audit, still pinned, stays on B: neither
// translated nor restarted. Nothing is lost.
func TestFleetFailoverKeepsAPlacedTopic(t *testing.T) {
	t.Parallel()
	f := startTopicsFleet(t)
	f.pin(t, "audit", "B")
	toB := f.waitTopicOn(t, "audit", "B", 0)
	// Each of audit's partitions delivers on B before the generations are
	// taken: a partition not yet delivered there would show up later as
	// if restarted.
	var auditGens map[string]int64
	wait.For(t, 20*time.Second, "every partition of audit delivering on B", func() error {
		auditGens = f.m.generations("audit")
		onA, onB := 0, 0
		for k := range auditGens {
			if strings.HasPrefix(k, "A:") {
				onA++
			} else if strings.HasPrefix(k, "B:") {
				onB++
			}
		}
		if onB < onA {
			return fmt.Errorf("%d of %d partitions delivered on B: %v", onB, onA, auditGens)
		}
		return nil
	})

	// orders is paused until A is gone, so that B holds mirrored records
	// of orders nobody consumed yet: after the failover they come from B.
	put := func(key, val string) int64 {
		t.Helper()
		resp, err := f.cli.Put(context.Background(), key, val)
		if err != nil {
			t.Fatal(err)
		}
		return resp.Header.Revision
	}
	waitAllPaused(t, put(fleetKeys.TopicSignal("orders"), "pause"), f.agents...)
	waitProduced(t, f.orders, 100, "orders written while it is paused")
	mctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	if err := f.d.mirror.CaughtUp(mctx); err != nil {
		t.Fatalf("the mirror did not catch up: %v", err)
	}
	cancel()
	f.d.a.Stop()
	waitFleetOn(t, f.cli, "B", 30*time.Second)
	var fo state.SwitchEvent
	for _, ev := range readHistory(t, f.cli) {
		if ev.Epoch > toB.Epoch && len(ev.Topics) == 0 && ev.To == "B" {
			fo = ev
		}
	}
	if fo.Epoch == 0 {
		t.Fatalf("no failover in history/: %+v", readHistory(t, f.cli))
	}
	t.Logf("failover epoch %d: %s", fo.Epoch, fo.Reason)
	for _, ps := range fo.Partitions {
		if ps.Topic == "audit" {
			t.Errorf("the failover translated audit's %s/%d, which was on B already", ps.FromTopic, ps.Partition)
		}
	}
	put(fleetKeys.TopicSignal("orders"), "start")
	wait.For(t, 20*time.Second, "orders consumed on B", func() error {
		if c := f.m.clusterOf("orders"); c != "B" {
			return fmt.Errorf("orders' last record from %s", c)
		}
		return nil
	})
	if got := f.m.generations("audit"); !maps.Equal(got, auditGens) {
		t.Errorf("audit's partitions on B were restarted by the failover: generations %v before, %v after", auditGens, got)
	}
	if a, err := readActive(f.cli); err != nil || len(a.Topics) != 0 {
		t.Errorf("state/active after the failover: %+v (%v), want no placements (everything on B)", a, err)
	}
	if err := f.d.a.Restart(); err != nil {
		t.Fatal(err)
	}
	waitFleetOn(t, f.cli, "A", 60*time.Second)
	// The failback leaves audit, pinned, on B: it is not translated, and
	// its partitions are not restarted.
	var fb state.SwitchEvent
	for _, ev := range readHistory(t, f.cli) {
		if ev.Epoch > fo.Epoch {
			if len(ev.Topics) != 0 || fb.Epoch != 0 {
				t.Errorf("after the failover, history/ has %+v: want the failback alone", ev)
			}
			fb = ev
		}
	}
	t.Logf("failback epoch %d: %s", fb.Epoch, fb.Reason)
	for _, ps := range fb.Partitions {
		if ps.Topic == "audit" {
			t.Errorf("the failback translated audit's %s/%d, which stays on B", ps.FromTopic, ps.Partition)
		}
	}
	if a, err := readActive(f.cli); err != nil || a.Topics["audit"].Cluster != "B" || a.Topics["audit"].Phase != state.PhaseActive {
		t.Errorf("state/active after the failback: %+v (%v), want audit placed on B", a, err)
	}
	if got := f.m.generations("audit"); !maps.Equal(got, auditGens) {
		t.Errorf("audit's partitions on B were restarted by the failback: generations %v before, %v after", auditGens, got)
	}
	// Records of the producers that could not reach A while it was down
	// were not written; those written are all handled.
	if dups := f.drain(t); dups != 0 {
		t.Logf("%d duplicates (a failover translates what it can; see the failover tests for its bounds)", dups)
	}
}

// waitFleetOn waits until state/active puts the fleet on cluster, active,
// and history/ holds the switch of its epoch: the leader records a switch
// just after the transaction that activates it.
func waitFleetOn(t *testing.T, cli *clientv3.Client, cluster string, timeout time.Duration) {
	t.Helper()
	wait.For(t, timeout, "the fleet active on "+cluster+", its switch in history/", func() error {
		a, err := readActive(cli)
		if err != nil {
			return err
		}
		if a.Cluster != cluster || a.Phase != state.PhaseActive {
			return fmt.Errorf("state/active %s %s (%s)", a.Cluster, a.Phase, a.Reason)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		resp, err := cli.Get(ctx, fleetKeys.HistoryEvent(a.Epoch), clientv3.WithCountOnly())
		if err != nil {
			return err
		}
		if resp.Count == 0 {
			return fmt.Errorf("state/active on %s at epoch %d, not yet in history/", a.Cluster, a.Epoch)
		}
		return nil
	})
}

// notPaused reports whether gap, the largest delivery gap of a topic
// while the switches evs moved others, shows it was not paused: within
// twice its baseline gap and 500 ms, or shorter than the longest of the
// switches (a topic paused for a switch has a gap at least as long as the
// switch). The 500 ms is the noise of 2 cores running the race detector
// and other packages' tests beside this one: a CI run failed on 150 ms.
// A topic held for a stage's check (2 s and more) still fails.
func notPaused(gap, base time.Duration, evs ...state.SwitchEvent) bool {
	longest := time.Duration(0)
	for _, ev := range evs {
		longest = max(longest, ev.Finished.Sub(ev.Started))
	}
	return gap <= 2*base+500*time.Millisecond || gap < longest
}

package agent_test

// Acceptance tests of issue 4 beyond the plain failover and failback of
// failover_test.go: the timestamp fallback, one agent cut off from the
// active cluster, the circuit breaker, a leader killed in the middle of a
// switch, and the pin (etcd and CLI). They share startDC's clusters: A,
// its replica B (topic A.orders, offsets shifted by TargetPrefill) and an
// embedded etcd.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/fleet"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/state"
)

var fleetKeys = keys.New("orders")

// startFleetAgent starts an agent with opts (a test logger if none) and
// stops it when the test ends; Stop after Abort is a no-op.
func startFleetAgent(t testing.TB, cfg config.Config, opts agent.Options) *agent.Agent {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = zaptest.NewLogger(t).Named(cfg.Agent.ID)
	}
	a, err := agent.New(cfg, opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		if err := a.Stop(ctx); err != nil {
			t.Error(err)
		}
	})
	return a
}

// waitConsuming waits until every agent consumes cluster and the
// partitions are all owned.
func waitConsuming(t testing.TB, timeout time.Duration, cluster string, agents ...*agent.Agent) time.Duration {
	t.Helper()
	began := time.Now()
	wait.For(t, timeout, "the fleet consumes "+cluster, func() error {
		c, err := activeOf(agents...)
		if err == nil && c != cluster {
			err = fmt.Errorf("active %s", c)
		}
		if err != nil {
			// What the leader says explains a switch that does not come.
			for _, a := range agents {
				if st := a.Status().Coordinator; a.Leading() && st != nil {
					err = fmt.Errorf("%w; leader %s: %q", err, a.ID(), st.Verdict)
				}
			}
		}
		return err
	})
	return time.Since(began)
}

// leaderOf returns the agent that leads, waiting for one.
func leaderOf(t testing.TB, agents ...*agent.Agent) *agent.Agent {
	t.Helper()
	var l *agent.Agent
	wait.For(t, 10*time.Second, "a leader", func() error {
		for _, a := range agents {
			if a.Leading() {
				l = a
				return nil
			}
		}
		return fmt.Errorf("none of %d agents leads", len(agents))
	})
	return l
}

// readActive reads state/active.
func readActive(cli *clientv3.Client) (state.Active, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, fleetKeys.Active())
	if err != nil {
		return state.Active{}, err
	}
	if len(resp.Kvs) == 0 {
		return state.Active{}, fmt.Errorf("no state/active")
	}
	return state.ParseActive(resp.Kvs[0].Value)
}

// readHistory reads history/, oldest first.
func readHistory(t testing.TB, cli *clientv3.Client) []state.SwitchEvent {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, fleetKeys.SwitchHistory(), clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	var out []state.SwitchEvent
	for _, kv := range resp.Kvs {
		var ev state.SwitchEvent
		if err := json.Unmarshal(kv.Value, &ev); err != nil {
			t.Fatalf("history %s: %v", kv.Key, err)
		}
		if err := state.LoadPartitions(ctx, cli, fleetKeys, &ev); err != nil {
			t.Fatalf("history %s: %v", kv.Key, err)
		}
		out = append(out, ev)
	}
	slices.SortFunc(out, func(a, b state.SwitchEvent) int { return int(a.Epoch - b.Epoch) })
	return out
}

// methods summarises how a switch translated each partition.
func methods(ev state.SwitchEvent) map[string]int {
	out := map[string]int{}
	for _, p := range ev.Partitions {
		out[p.Method]++
	}
	return out
}

func logEvents(t *testing.T, evs []state.SwitchEvent) {
	t.Helper()
	for _, ev := range evs {
		t.Logf("switch epoch %d %s→%s in %v (%s): %v, phases %v", ev.Epoch, ev.From, ev.To,
			ev.Finished.Sub(ev.Started).Round(time.Millisecond), ev.Reason, methods(ev), ev.Phases)
	}
}

// holdsFor checks cond every 50 ms for d and fails the test the first time
// it does not hold: for what must stay true (no switch happens), which no
// single observation can show.
func holdsFor(t *testing.T, d time.Duration, what string, cond func() error) {
	t.Helper()
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		if err := cond(); err != nil {
			t.Fatalf("%s stopped holding: %v", what, err)
		}
		time.Sleep(50 * time.Millisecond) // sampling an invariant, not waiting for an event
	}
}

// staysOn checks for d that state/active names cluster, active, in the
// epoch it has now: no switch starts. (Which agent owns what may change
// meanwhile, as agents come and go.)
func staysOn(t *testing.T, cli *clientv3.Client, d time.Duration, cluster, what string) {
	t.Helper()
	before, err := readActive(cli)
	if err != nil {
		t.Fatal(err)
	}
	holdsFor(t, d, what, func() error {
		a, err := readActive(cli)
		if err != nil {
			return err
		}
		if a.Cluster != cluster || a.Phase != state.PhaseActive || a.Epoch != before.Epoch {
			return fmt.Errorf("state/active %+v, was %+v", a, before)
		}
		return nil
	})
}

// waitAllHandled waits until every id in ids has been handled.
func waitAllHandled(t *testing.T, l *ledger, ids map[string]bool, timeout time.Duration) {
	t.Helper()
	wait.For(t, timeout, "every record handled", func() error {
		var missing []string
		for id := range ids {
			if l.timesHandled(id) == 0 {
				missing = append(missing, id)
			}
		}
		if len(missing) > 0 {
			slices.Sort(missing)
			return fmt.Errorf("%d of %d records not handled, e.g. %v", len(missing), len(ids), missing[:min(5, len(missing))])
		}
		return nil
	})
}

// metricValue returns the value of a gauge or counter of a's registry with
// the given labels.
func metricValue(a *agent.Agent, name string, labels map[string]string) (float64, bool) {
	mfs, err := a.Metrics().Gather()
	if err != nil {
		return 0, false
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for k, v := range labels {
				found := false
				for _, lp := range m.GetLabel() {
					if lp.GetName() == k && lp.GetValue() == v {
						found = true
					}
				}
				if !found {
					continue next
				}
			}
			switch {
			case m.GetGauge() != nil:
				return m.GetGauge().GetValue(), true
			case m.GetCounter() != nil:
				return m.GetCounter().GetValue(), true
			}
		}
	}
	return 0, false
}

// traced is one record as a handler saw it.
type traced struct {
	id     string
	offset int64
	ts     time.Time
}

// trace keeps, per cluster and partition, the records handled there, to
// compare with the translations in history/.
type trace struct {
	mu   sync.Mutex
	recs map[string][]traced // "cluster/topic/partition"
}

func newTrace() *trace { return &trace{recs: map[string][]traced{}} }

func traceKey(cluster, topic string, partition int32) string {
	return fmt.Sprintf("%s/%s/%d", cluster, topic, partition)
}

// handler records r in the ledger and the trace, and acknowledges it.
func (tr *trace) handler(l *ledger, id string) record.Handler {
	return record.HandlerFunc(func(_ context.Context, r *record.Record) error {
		l.record(id, r)
		tr.mu.Lock()
		k := traceKey(r.Cluster, r.Topic, r.Partition)
		tr.recs[k] = append(tr.recs[k], traced{id: string(r.Value), offset: r.Offset, ts: r.Timestamp})
		tr.mu.Unlock()
		r.Ack()
		return nil
	})
}

// at returns the record handled at offset of a cluster's partition.
func (tr *trace) at(cluster, topic string, partition int32, offset int64) (traced, bool) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for _, r := range tr.recs[traceKey(cluster, topic, partition)] {
		if r.offset == offset {
			return r, true
		}
	}
	return traced{}, false
}

// within counts the distinct records handled on a cluster's partition
// before offset end whose timestamps are at or after from (millisecond
// precision, as Kafka stores them).
func (tr *trace) within(cluster, topic string, partition int32, end int64, from time.Time) int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	seen := map[int64]bool{}
	for _, r := range tr.recs[traceKey(cluster, topic, partition)] {
		if r.offset < end && r.ts.UnixMilli() >= from.UnixMilli() {
			seen[r.offset] = true
		}
	}
	return len(seen)
}

// stripFingerprints rewrites every committed position of cluster as it
// lands in etcd without its fingerprints, until the test ends. The rewrite
// is a transaction on the value's mod revision, so a newer commit is never
// overwritten with an older position. It returns how many it rewrote.
func stripFingerprints(t *testing.T, cli *clientv3.Client, cluster string) func() int {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var mu sync.Mutex
	n := 0
	done := make(chan struct{})
	prefix := fleetKeys.ClusterOffsets(cluster)
	wch := cli.Watch(ctx, prefix, clientv3.WithPrefix())
	go func() {
		defer close(done)
		for wr := range wch {
			for _, ev := range wr.Events {
				if ev.Type != clientv3.EventTypePut {
					continue
				}
				var v map[string]json.RawMessage
				if json.Unmarshal(ev.Kv.Value, &v) != nil {
					continue
				}
				if _, ok := v["fingerprints"]; !ok {
					continue
				}
				delete(v, "fingerprints")
				val, _ := json.Marshal(v)
				key := string(ev.Kv.Key)
				resp, err := cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(key), "=", ev.Kv.ModRevision)).
					Then(clientv3.OpPut(key, string(val))).Commit()
				if err == nil && resp.Succeeded {
					mu.Lock()
					n++
					mu.Unlock()
				}
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return func() int {
		mu.Lock()
		defer mu.Unlock()
		return n
	}
}

// TestFailoverWithoutFingerprints: the positions committed on A carry no
// fingerprints, as when they were written by a committer that does not
// keep them (an older kswitch during a rolling upgrade, an operator's
// reset). A stand-in strips them from every commit as it lands in etcd;
// the agents are untouched. The failover then falls back:
//
//   - timestamp: B is filled by a replicator that writes no offset-syncs.
//     Nothing mirrored before the failure is lost, and the records handled
//     twice are at most those within failover.timestamp_margin before
//     each partition's last consumed record;
//   - mm2: the replicator writes MirrorMaker 2 offset-syncs (on B, so they
//     stay readable while A is down). Nothing is lost, and the records
//     handled twice are at most what history/ says was rewound.
func TestFailoverWithoutFingerprints(t *testing.T) {
	t.Run("timestamp", func(t *testing.T) { failoverWithoutFingerprints(t, false) })
	t.Run("mm2", func(t *testing.T) { failoverWithoutFingerprints(t, true) })
}

func failoverWithoutFingerprints(t *testing.T, offsetSyncs bool) {
	d := startDCWith(t, offsetSyncs)
	cli := testenv.EtcdClientT(t, d.etcd)
	stripped := stripFingerprints(t, cli, "A")
	const margin = 500 * time.Millisecond
	l, tr, ho := newLedger(), newTrace(), newHandovers()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		cfg := d.config(id)
		cfg.Failover.TimestampMargin = margin
		agents = append(agents, startFleetAgent(t, cfg, agent.Options{Handler: ho.wrap(id, tr.handler(l, id))}))
	}
	waitConsuming(t, 20*time.Second, "A", agents...)
	p := startProducer(t, d.a.Brokers(), "orders", 0)
	// Records must span more than the margin for the bound to bite.
	wait.For(t, 60*time.Second, "records flowing for longer than the margin", func() error {
		if n := l.count(); n < 800 || d.mirror.Copied() < 800 {
			return fmt.Errorf("%d handled, %d mirrored", n, d.mirror.Copied())
		}
		return nil
	})

	cfg := d.config("x")
	d.a.Fail()
	took := waitConsuming(t, cfg.Failover.FailureWindow+agent.PushPullInterval+4*time.Second, "B", agents...)
	p.halt()
	t.Logf("failover: consuming B %v after A failed; %d commits on A stripped of their fingerprints", took, stripped())
	// The acceptance bound holds for the fallbacks too: the absent
	// MirrorMaker 2 topics are found absent by one metadata request each.
	// A view's lost UDP broadcast comes with the next push/pull
	// (TestFailoverToTheReplicaAndBack).
	if bound := cfg.Failover.FailureWindow + agent.PushPullInterval + time.Second; took > bound {
		t.Errorf("failover took %v, want <= failure window + push/pull interval + 1 s = %v", took, bound)
	}

	onB := idsOn(t, d.b, "A.orders")
	waitAllHandled(t, l, onB, 20*time.Second)

	evs := readHistory(t, cli)
	logEvents(t, evs)
	if len(evs) != 1 || evs[0].From != "A" || evs[0].To != "B" {
		t.Fatalf("history %+v, want one switch A→B", evs)
	}
	want := "timestamp"
	if offsetSyncs {
		want = "mm2"
	}
	bound := 0
	for _, ps := range evs[0].Partitions {
		if ps.Method != want {
			t.Errorf("%s/%d translated by %q, want %s (%s)", ps.Topic, ps.Partition, ps.Method, want, ps.Detail)
			continue
		}
		if offsetSyncs {
			// MirrorMaker 2's rule gives an upper bound of the rewind.
			t.Logf("%s/%d: A offset %d → B offset %d, rewound at most %d", ps.Topic, ps.Partition, ps.FromOffset, ps.ToOffset, ps.Rewound)
			if ps.Rewound < 0 {
				t.Errorf("%s/%d: mm2 translation with an unknown rewind: %s", ps.Topic, ps.Partition, ps.Detail)
			}
			bound += int(ps.Rewound)
			continue
		}
		last, ok := tr.at("A", ps.Topic, ps.Partition, ps.FromOffset-1)
		if !ok {
			t.Fatalf("%s/%d: the record before the committed offset %d was not handled on A", ps.Topic, ps.Partition, ps.FromOffset)
		}
		n := tr.within("A", ps.Topic, ps.Partition, ps.FromOffset, last.ts.Add(-margin))
		t.Logf("%s/%d: A offset %d → B offset %d; %d records within %v before the last consumed one",
			ps.Topic, ps.Partition, ps.FromOffset, ps.ToOffset, n, margin)
		bound += n
	}
	_, dups, _ := l.result(0)
	t.Logf("%d records mirrored before the failure, 0 lost, %d duplicates (bound %d)", len(onB), dups, bound)
	if dups > bound {
		t.Errorf("%d duplicates, more than the bound of %d", dups, bound)
	}
	if v, _ := metricValue(leaderOf(t, agents...), "kswitch_translation_total", map[string]string{"method": want}); v < failoverPartitions {
		t.Errorf("kswitch_translation_total{method=%s} = %v on the leader, want >= %d", want, v, failoverPartitions)
	}
	ho.check(t, l)
}

// handovers checks the hand-over rule for partitions that may come back
// to an agent that held them before: a partition's records arrive under
// generations that never go down, so no agent delivers a partition under
// an older generation once another has taken it over. (The ledger's own
// rule, that a former holder never delivers a partition again, does not
// allow a partition to come back.)
type handovers struct {
	mu         sync.Mutex
	last       map[string]int64  // partition → generation of its last record
	holder     map[string]string // partition → agent of its last record
	violations []string
}

func newHandovers() *handovers {
	return &handovers{last: map[string]int64{}, holder: map[string]string{}}
}

func (h *handovers) wrap(id string, next record.Handler) record.Handler {
	return record.HandlerFunc(func(ctx context.Context, r *record.Record) error {
		h.mu.Lock()
		tp := fmt.Sprintf("%s/%d", r.Topic, r.Partition)
		if g, ok := h.last[tp]; ok && r.Generation < g {
			h.violations = append(h.violations, fmt.Sprintf("%s delivered %s offset %d under generation %d after %s delivered it under %d",
				id, tp, r.Offset, r.Generation, h.holder[tp], g))
		}
		h.last[tp], h.holder[tp] = r.Generation, id
		h.mu.Unlock()
		return next.Handle(ctx, r)
	})
}

// check reports h's violations and the ledger's, but for the ledger's
// rule against a partition coming back.
func (h *handovers) check(t *testing.T, l *ledger) {
	t.Helper()
	h.mu.Lock()
	for _, v := range h.violations {
		t.Error("invariant:", v)
	}
	h.mu.Unlock()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, v := range l.violations {
		if !strings.Contains(v, " again after ") {
			t.Error("invariant:", v)
		}
	}
}

// through returns an agent's KafkaDialer that connects to cluster
// through link, and to the others directly.
func through(link *devstack.Link, cluster string) func(string) kafka.Dialer {
	return func(c string) kafka.Dialer {
		if c == cluster {
			return link
		}
		return nil // not a nil *Link: that would be a non-nil Dialer
	}
}

// readyz returns an agent's /readyz status code and reason.
func readyz(a *agent.Agent) (int, string, error) {
	var body map[string]string
	code, err := getJSON("http://"+a.HTTPAddr()+"/readyz", &body)
	return code, body["reason"], err
}

// TestAgentCutOffFromTheActiveClusterGivesItsPartitionsAway: one agent
// loses its link to A while the others reach it. No failover: that agent
// reports itself unready, its partitions move to the others, and it gets
// some back once the link heals. Nothing is lost or handled twice.
func TestAgentCutOffFromTheActiveClusterGivesItsPartitionsAway(t *testing.T) {
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, ho := newLedger(), newHandovers()
	links := map[string]*devstack.Link{}
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		link := devstack.NewLink()
		links[id] = link
		agents = append(agents, startFleetAgent(t, d.config(id), agent.WithHooks(agent.Options{
			Handler: ho.wrap(id, l.handler(id)),
		}, agent.Hooks{KafkaDialer: through(link, "A")})))
	}
	p := startFlow(t, d, l, 300, agents...)
	before, err := readActive(cli)
	if err != nil {
		t.Fatal(err)
	}

	leader := leaderOf(t, agents...)
	victim := agents[0]
	if victim == leader {
		victim = agents[1]
	}
	rest := slices.DeleteFunc(slices.Clone(agents), func(a *agent.Agent) bool { return a == victim })
	cfg := d.config("x")
	t.Logf("cutting %s (owns %v) off A; %s leads", victim.ID(), victim.Owned(), leader.ID())
	began := time.Now()
	links[victim.ID()].Cut()

	wait.For(t, cfg.Failover.ProbeInterval+cfg.Failover.ProbeTimeout+3*time.Second, victim.ID()+" unready", func() error {
		code, reason, err := readyz(victim)
		if err != nil {
			return err
		}
		if code != http.StatusServiceUnavailable || !strings.Contains(reason, "cannot reach the active cluster A") {
			return fmt.Errorf("/readyz %d %q", code, reason)
		}
		return nil
	})
	wait.For(t, cfg.Failover.FailureWindow+5*time.Second, "the others own every partition", func() error {
		o := owned(agents...)
		if o[victim.ID()] != 0 || o[rest[0].ID()]+o[rest[1].ID()] != failoverPartitions {
			return fmt.Errorf("owned %v", o)
		}
		return nil
	})
	moved := time.Since(began)
	st := leader.Status().Coordinator
	if st == nil || !slices.Contains(st.CutOff, victim.ID()) {
		t.Errorf("leader status %+v does not list %s as cut off", st, victim.ID())
	}
	// No failover, for well over the failure window.
	hold := 3*cfg.Failover.FailureWindow + time.Second
	holdsFor(t, hold, "A stays active and the victim owns nothing", func() error {
		a, err := readActive(cli)
		if err != nil {
			return err
		}
		if a.Cluster != "A" || a.Epoch != before.Epoch || a.Phase != state.PhaseActive {
			return fmt.Errorf("state/active %+v, was %+v", a, before)
		}
		if n := len(victim.Owned()); n != 0 {
			return fmt.Errorf("%s owns %d partitions", victim.ID(), n)
		}
		return nil
	})
	if evs := readHistory(t, cli); len(evs) != 0 {
		t.Fatalf("switches happened: %+v", evs)
	}
	t.Logf("%s's partitions moved %v after the cut; no switch for %v", victim.ID(), moved, hold)

	healed := time.Now()
	links[victim.ID()].Heal()
	waitBalanced(t, failoverPartitions, agents...)
	t.Logf("%s owns %v again %v after the link healed", victim.ID(), victim.Owned(), time.Since(healed))
	wait.For(t, 5*time.Second, victim.ID()+" ready", func() error {
		if code, reason, err := readyz(victim); err != nil || code != http.StatusOK {
			return fmt.Errorf("/readyz %d %q %v", code, reason, err)
		}
		return nil
	})
	// Records produced after the heal reach every agent's partitions.
	if dups, dupFirst := drain(t, d, p, l, ho, "A"); dups != 0 {
		t.Errorf("%d duplicates (first handled by %v): hand-overs through etcd commits must not repeat records", dups, dupFirst)
	}
}

// TestFlappingPrimaryTripsTheCircuitBreaker: A fails whenever the fleet is
// on it and recovers whenever the fleet has left it, so the fleet switches
// back and forth. With failover.max_failed_switches 2 the breaker trips at
// the third automatic switch in the breaker window (the first is a
// failover, each further one a flap): automatic switching stops, the fleet
// stays where it is although A is healthy again, and the leader reports
// the breaker in /status and in kswitch_circuit_breaker_open.
func TestFlappingPrimaryTripsTheCircuitBreaker(t *testing.T) {
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, ho := newLedger(), newHandovers()
	cfgOf := func(id string) config.Config {
		cfg := d.config(id)
		cfg.Failover.MaxFailedSwitches = 2
		cfg.Failover.BreakerWindow = 5 * time.Minute
		cfg.Failover.BreakerCooldown = 10 * time.Minute
		return cfg
	}
	cfg := cfgOf("x")
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		agents = append(agents, startFleetAgent(t, cfgOf(id), agent.Options{Handler: ho.wrap(id, l.handler(id))}))
	}
	waitConsuming(t, 20*time.Second, "A", agents...)
	p := startProducer(t, d.a.Brokers(), "orders", 0)
	wait.For(t, 20*time.Second, "records flowing", func() error {
		if n := l.count(); n < 300 {
			return fmt.Errorf("%d handled", n)
		}
		return nil
	})

	failover := cfg.Failover.FailureWindow + 5*time.Second
	failback := cfg.Failover.FailbackStable + 15*time.Second
	d.a.Fail()
	t.Logf("1st switch (failover) after %v", waitConsuming(t, failover, "B", agents...))
	d.a.Recover()
	t.Logf("2nd switch (failback) after %v", waitConsuming(t, failback, "A", agents...))
	d.a.Fail()
	t.Logf("3rd switch (failover) after %v", waitConsuming(t, failover, "B", agents...))
	tripped := time.Now()
	d.a.Recover()

	leader := leaderOf(t, agents...)
	wait.For(t, 5*time.Second, "the leader reports the breaker open", func() error {
		st := leader.Status().Coordinator
		if st == nil || !st.Breaker.After(time.Now().Add(cfg.Failover.BreakerCooldown/2)) {
			return fmt.Errorf("leader status %+v", st)
		}
		if v, ok := metricValue(leader, "kswitch_circuit_breaker_open", nil); !ok || v != 1 {
			return fmt.Errorf("kswitch_circuit_breaker_open = %v (found %v)", v, ok)
		}
		return nil
	})
	// A is healthy and caught up, yet no failback: the fleet settles on B.
	hold := 2*cfg.Failover.FailbackStable + 2*time.Second
	staysOn(t, cli, hold, "B", "the fleet stays on B")
	waitConsuming(t, 5*time.Second, "B", agents...)
	st := leader.Status().Coordinator
	t.Logf("settled on B for %v after the trip; leader verdict %q, breaker open until %s",
		time.Since(tripped).Round(time.Millisecond), st.Verdict, st.Breaker.Format(time.RFC3339))
	if !strings.Contains(st.Verdict, "circuit breaker open") {
		t.Errorf("leader verdict %q does not mention the breaker", st.Verdict)
	}
	var status agent.Status
	if _, err := getJSON("http://"+leader.HTTPAddr()+"/status", &status); err != nil || status.Coordinator == nil || status.Coordinator.Breaker.IsZero() {
		t.Errorf("/status of the leader: %v, coordinator %+v", err, status.Coordinator)
	}
	// The breaker outlives its leader: the next one restores it from
	// history/ and does not fail back either.
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := leader.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	rest := slices.DeleteFunc(slices.Clone(agents), func(a *agent.Agent) bool { return a == leader })
	next := leaderOf(t, rest...)
	wait.For(t, 5*time.Second, "the next leader reports the breaker open", func() error {
		if st := next.Status().Coordinator; st == nil || !st.Breaker.After(time.Now().Add(cfg.Failover.BreakerCooldown/2)) {
			return fmt.Errorf("leader status %+v", st)
		}
		if v, ok := metricValue(next, "kswitch_circuit_breaker_open", nil); !ok || v != 1 {
			return fmt.Errorf("kswitch_circuit_breaker_open = %v (found %v)", v, ok)
		}
		return nil
	})
	staysOn(t, cli, cfg.Failover.FailbackStable+2*time.Second, "B", "the fleet stays on B under the next leader")
	waitConsuming(t, 10*time.Second, "B", rest...)
	t.Logf("%s leads after %s stopped; breaker open until %s", next.ID(), leader.ID(), next.Status().Coordinator.Breaker.Format(time.RFC3339))

	evs := readHistory(t, cli)
	logEvents(t, evs)
	if len(evs) != 3 {
		t.Errorf("%d switches, want 3", len(evs))
	}
	for _, ev := range evs {
		if !ev.Automatic {
			t.Errorf("switch epoch %d (%s) not marked automatic", ev.Epoch, ev.Reason)
		}
	}

	dups, _ := drain(t, d, p, l, ho, "B")
	t.Logf("%d duplicates over 3 switches", dups)
}

// gate is a handler that acknowledges records at once while open and
// holds them unacknowledged while closed, as a sink that stalls does.
// stallAll closes every gate and waits until each agent holds records it
// cannot release.
func stallAll(t *testing.T, gates map[string]*gate) {
	t.Helper()
	for _, g := range gates {
		g.close()
	}
	wait.For(t, 10*time.Second, "every agent holding records", func() error {
		for id, g := range gates {
			if g.holding() == 0 {
				return fmt.Errorf("%s holds none", id)
			}
		}
		return nil
	})
}

// waitSwitching waits, after the active cluster failed, until state/active
// is in phase switching, and returns it.
func waitSwitching(t *testing.T, cli *clientv3.Client, window time.Duration) state.Active {
	t.Helper()
	var switching state.Active
	wait.For(t, window+5*time.Second, "state/active in phase switching", func() error {
		a, err := readActive(cli)
		if err != nil {
			return err
		}
		if a.Phase != state.PhaseSwitching {
			return fmt.Errorf("state/active %+v", a)
		}
		switching = a
		return nil
	})
	return switching
}

type gate struct {
	mu     sync.Mutex
	closed bool
	held   []*record.Record
}

func (g *gate) handler(l *ledger, id string) record.Handler {
	return record.HandlerFunc(func(_ context.Context, r *record.Record) error {
		l.record(id, r)
		g.mu.Lock()
		defer g.mu.Unlock()
		if g.closed {
			g.held = append(g.held, r)
			return nil
		}
		r.Ack()
		return nil
	})
}

func (g *gate) close() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.closed = true
}

// open acknowledges what was held and lets records through; it returns
// how many were held.
func (g *gate) open() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.closed = false
	for _, r := range g.held {
		r.Ack()
	}
	n := len(g.held)
	g.held = nil
	return n
}

func (g *gate) holding() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.held)
}

// TestLeaderKilledMidSwitchIsResumedByTheNext: the leader crashes while a
// failover is in its revoke phase (the agents' sinks stall, so they cannot
// release yet). The next leader finds state/active in phase switching,
// resumes the same switch (same epoch) and completes it. Nothing mirrored
// is lost; the only records handled twice are those the dead leader had
// taken and not acknowledged.
func TestLeaderKilledMidSwitchIsResumedByTheNext(t *testing.T) {
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, ho := newLedger(), newHandovers()
	gates, agents := gatedFleet(t, d, l, ho)
	p := startFlow(t, d, l, 300, agents...)
	leader := leaderOf(t, agents...)
	rest := slices.DeleteFunc(slices.Clone(agents), func(a *agent.Agent) bool { return a == leader })

	// The sinks stall: every agent holds records it cannot release.
	stallAll(t, gates)
	cfg := d.config("x")
	d.a.Fail()
	switching := waitSwitching(t, cli, cfg.Failover.FailureWindow)
	t.Logf("switch under way: %+v; killing the leader %s", switching, leader.ID())

	// The leader crashes. Its etcd client is closed first thing, so
	// nothing it does from then on lands; once its HTTP server is gone
	// too, the switch it began can no longer be completed by it.
	killed := time.Now()
	lost := abortStalledLeader(t, leader, gates)

	waitConsuming(t, cfg.Etcd.SessionTTL+cfg.Failover.FailureWindow+10*time.Second, "B", rest...)
	p.halt()
	t.Logf("the fleet consumes B %v after the leader was killed (session TTL %v)", time.Since(killed).Round(time.Millisecond), cfg.Etcd.SessionTTL)
	a, err := readActive(cli)
	if err != nil {
		t.Fatal(err)
	}
	if a.Cluster != "B" || a.Phase != state.PhaseActive || a.Epoch != switching.Epoch {
		t.Errorf("state/active %+v, want B active in the switch's epoch %d", a, switching.Epoch)
	}
	evs := readHistory(t, cli)
	logEvents(t, evs)
	if len(evs) != 1 {
		t.Fatalf("history %+v, want the one switch", evs)
	}
	ev := evs[0]
	if ev.Epoch != switching.Epoch || ev.Leader == leader.ID() || !strings.Contains(ev.Reason, "resumed by "+ev.Leader) {
		t.Errorf("history event epoch %d by %s (%q), want epoch %d resumed by a new leader", ev.Epoch, ev.Leader, ev.Reason, switching.Epoch)
	}
	// The event spans the whole switch, the leader's death included.
	if !ev.Started.Equal(switching.Since) {
		t.Errorf("history event from %s to %s, want it to start when the switch began (%s)", ev.Started, ev.Finished, switching.Since)
	}

	onB := idsOn(t, d.b, "A.orders")
	waitAllHandled(t, l, onB, 20*time.Second)
	_, dups, dupFirst := l.result(0)
	t.Logf("%d records mirrored before the failure, 0 lost, %d duplicates (first handled by %v); the killed leader held %d unacknowledged",
		len(onB), dups, dupFirst, lost)
	for id, n := range dupFirst {
		if id != leader.ID() {
			t.Errorf("%d duplicates of records first handled by %s, which was not killed", n, id)
		}
	}
	if dups > lost {
		t.Errorf("%d duplicates, more than the %d records the killed leader held", dups, lost)
	}
	ho.check(t, l)
}

// abortStalledLeader crashes leader while every agent's sink is stalled
// (stallAll): once its HTTP server is gone it can complete nothing more;
// then the sinks recover. It returns how many records the dead leader
// held unacknowledged: its partitions' next owners deliver them again.
func abortStalledLeader(t *testing.T, leader *agent.Agent, gates map[string]*gate) int {
	t.Helper()
	aborted := make(chan struct{})
	go func() {
		defer close(aborted)
		leader.Abort()
	}()
	wait.For(t, 5*time.Second, "the leader down", func() error {
		if _, _, err := readyz(leader); err == nil {
			return fmt.Errorf("%s still answers", leader.ID())
		}
		return nil
	})
	// What the dead leader held is never acknowledged by anyone alive;
	// acking it now only lets its drain (and so Abort) end.
	held := gates[leader.ID()].open()
	<-aborted
	// The survivors' sinks recover: they release, commit and acknowledge.
	for id, g := range gates {
		if id != leader.ID() {
			g.open()
		}
	}
	return held
}

// operator is fleet orders' operator over a client of e: what the
// kswitch commands steer and read it with.
func operator(t *testing.T, e *devstack.Etcd) *fleet.Operator {
	t.Helper()
	op, err := fleet.NewOperator(testenv.EtcdClientT(t, e), "orders")
	if err != nil {
		t.Fatal(err)
	}
	return op
}

// statusText is the fleet as 'kswitch status' prints it, read from etcd
// (ask: with each agent's own /readyz, as --ask).
func statusText(t *testing.T, op *fleet.Operator, ask bool) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	v, err := op.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if ask {
		v.AskReady(ctx, time.Second)
	}
	var b strings.Builder
	v.WriteText(&b, time.Now())
	return b.String()
}

// TestPinSwitchesAndHoldsUntilRemoved: a pin written with the etcd client
// (as etcdctl would) moves the fleet to B although A is healthy, holds it
// there past failback_stable, and deleting it returns to automatic
// failback. Then the same through `kswitch failover --to B` / `--auto`.
func TestPinSwitchesAndHoldsUntilRemoved(t *testing.T) {
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, ho := newLedger(), newHandovers()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		agents = append(agents, startFleetAgent(t, d.config(id), agent.Options{Handler: ho.wrap(id, l.handler(id))}))
	}
	cfg := d.config("x")
	waitConsuming(t, 20*time.Second, "A", agents...)
	p := startProducer(t, d.a.Brokers(), "orders", 0)
	wait.For(t, 20*time.Second, "records flowing", func() error {
		if n := l.count(); n < 300 {
			return fmt.Errorf("%d handled", n)
		}
		return nil
	})
	leader := leaderOf(t, agents...)
	ctx := context.Background()

	// etcdctl put /kswitch/orders/control/pin B
	if _, err := cli.Put(ctx, fleetKeys.Pin(), "B"); err != nil {
		t.Fatal(err)
	}
	t.Logf("pin B: consuming B after %v", waitConsuming(t, cfg.Failover.ProbeInterval+5*time.Second, "B", agents...))
	hold := 2*cfg.Failover.FailbackStable + time.Second
	staysOn(t, cli, hold, "B", "the fleet stays on B while pinned")
	waitConsuming(t, 5*time.Second, "B", agents...)
	if st := leader.Status().Coordinator; st == nil || st.Pin != "B" || st.Verdict != "pinned to B" {
		t.Errorf("leader status %+v, want pinned to B", st)
	}
	// etcdctl del /kswitch/orders/control/pin
	if _, err := cli.Delete(ctx, fleetKeys.Pin()); err != nil {
		t.Fatal(err)
	}
	t.Logf("pin deleted: failback to A after %v", waitConsuming(t, cfg.Failover.FailbackStable+10*time.Second, "A", agents...))

	// The same through the operator's calls (kswitch failover --to B,
	// then --auto).
	op := operator(t, d.etcd)
	if err := op.Pin(ctx, "B"); err != nil {
		t.Fatal(err)
	}
	t.Logf("Pin(B): consuming B after %v", waitConsuming(t, cfg.Failover.ProbeInterval+5*time.Second, "B", agents...))
	if err := op.Unpin(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("Unpin: failback to A after %v", waitConsuming(t, cfg.Failover.FailbackStable+10*time.Second, "A", agents...))

	evs := readHistory(t, cli)
	logEvents(t, evs)
	var reasons []string
	for _, ev := range evs {
		reasons = append(reasons, fmt.Sprintf("%s→%s %s", ev.From, ev.To, strings.SplitN(ev.Reason, ":", 2)[0]))
	}
	want := []string{"A→B manual", "B→A failback", "A→B manual", "B→A failback"}
	if !slices.Equal(reasons, want) {
		t.Errorf("switches %v, want %v", reasons, want)
	}
	for _, ev := range evs {
		if ev.Automatic != strings.HasPrefix(ev.Reason, "failback") {
			t.Errorf("switch epoch %d (%s) marked automatic=%v", ev.Epoch, ev.Reason, ev.Automatic)
		}
	}

	// Planned switches wait (at most the failure window) for the replica
	// to hold what the fleet consumed; a replica later than that is
	// reported as lagged and its records delivered again, so the count is
	// logged, not bounded (TestPlannedSwitchIsMadeBeforeItIsBroken bounds
	// it with the default window).
	dups, _ := drain(t, d, p, l, ho, "A")
	t.Logf("%d duplicates over 4 planned switches", dups)
}

// TestSwitchIsAbandonedWhenItsTargetDies: A fails, the fleet starts to
// switch to B and releases A, then B fails before the switch completes.
// The leader retries with a backoff (one failed switch for the breaker,
// however many attempts) and, once A is back while B is still down, gives
// the switch up: the fleet consumes A again instead of staying released.
func TestSwitchIsAbandonedWhenItsTargetDies(t *testing.T) {
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, ho := newLedger(), newHandovers()
	gates, agents := gatedFleet(t, d, l, ho)
	waitConsuming(t, 20*time.Second, "A", agents...)
	p := startProducer(t, d.a.Brokers(), "orders", 0)
	flowing := time.Now()
	wait.For(t, 20*time.Second, "records flowing", func() error {
		if n := l.count(); n < 300 {
			return fmt.Errorf("%d handled, %d produced (%d sends failed)", n, p.next.Load(), p.failed.Load())
		}
		return nil
	})
	t.Logf("300 records handled %v after the producer started (%d produced, %d sends failed)",
		time.Since(flowing).Round(time.Millisecond), p.next.Load(), p.failed.Load())
	leader := leaderOf(t, agents...)
	// Stalled sinks hold the switch in its revoke phase until B is down.
	stallAll(t, gates)
	cfg := d.config("x")
	d.a.Fail()
	waitSwitching(t, cli, cfg.Failover.FailureWindow)
	d.b.Fail()
	t.Cleanup(d.b.Recover)
	for _, g := range gates {
		g.open()
	}
	// Both clusters down: the switch fails and is retried, and counts as
	// one failed switch for the breaker (3 would trip it).
	wait.For(t, 15*time.Second, "several failed attempts", func() error {
		if v, _ := metricValue(leader, "kswitch_switch_failures_total", nil); v < 3 {
			return fmt.Errorf("%v failed attempts", v)
		}
		return nil
	})
	wait.For(t, 2*time.Second, "the leader reporting the retries", func() error {
		st := leader.Status().Coordinator
		if st == nil || !strings.Contains(st.Verdict, "switch to B failed, retrying") {
			return fmt.Errorf("leader status %+v", st)
		}
		if !st.Breaker.IsZero() {
			t.Fatalf("leader status %+v: the breaker counted the retries of one switch as several", st)
		}
		return nil
	})
	if a, err := readActive(cli); err != nil || a.Phase != state.PhaseSwitching {
		t.Fatalf("state/active %+v (%v), want the switch still in progress", a, err)
	}

	// A comes back, B stays down: back on A.
	recovered := time.Now()
	d.a.Recover()
	waitConsuming(t, cfg.Failover.FailureWindow+10*time.Second, "A", agents...)
	t.Logf("consuming A again %v after it recovered", time.Since(recovered).Round(time.Millisecond))
	a, err := readActive(cli)
	if err != nil {
		t.Fatal(err)
	}
	if a.Cluster != "A" || a.Phase != state.PhaseActive || !strings.Contains(a.Reason, "abandoned") {
		t.Errorf("state/active %+v, want A active after an abandoned switch", a)
	}
	evs := readHistory(t, cli)
	logEvents(t, evs)
	if len(evs) != 1 || evs[0].Abandoned == "" || evs[0].To != "B" {
		t.Errorf("history %+v, want the abandoned switch to B", evs)
	} else {
		t.Logf("abandoned: %s", evs[0].Abandoned)
	}

	if dups, dupFirst := drain(t, d, p, l, ho, "A"); dups != 0 {
		t.Errorf("%d duplicates (first handled by %v): every record was committed on A before the switch", dups, dupFirst)
	}
}

// gatedFleet starts three agents whose handlers record to l through a
// gate each (to stall their sinks) and ho (the hand-overs).
func gatedFleet(t *testing.T, d *dc, l *ledger, ho *handovers) (map[string]*gate, []*agent.Agent) {
	t.Helper()
	gates := map[string]*gate{}
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		g := &gate{}
		gates[id] = g
		agents = append(agents, startFleetAgent(t, d.config(id), agent.Options{Handler: ho.wrap(id, g.handler(l, id))}))
	}
	return gates, agents
}

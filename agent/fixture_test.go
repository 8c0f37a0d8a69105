package agent_test

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/devstack/mirror"
	"github.com/kswitch/kswitch/fleet"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/state"
)

// The agent tests' shared world, in one place:
//   - startDC: etcd, clusters A and B and the mirror between them (its
//     options: withTopics, withOffsetSyncs, withoutOffsetSyncs); dc.config
//     an agent's configuration for it;
//   - flowingFleet: three agents on a dc under a producer's load;
//     startFleetAgent one agent;
//   - startProducer and producer.halt: the load;
//   - the ledger (ledger_test.go) and handovers: what was handled, where,
//     and whether a hand-over delivered anything twice;
//   - drain: the end of a test that must lose nothing;
//   - waits on the fleet (waitConsuming, waitFlowing, waitSwitching,
//     leaderOf, activeOf) and readers of etcd (readActive, readHistory).

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

// recordedWithActivation checks that the switch in force (state/active)
// is in history/, written by the transaction that activated it: a switch
// never takes effect unrecorded, whatever etcd does next.
func recordedWithActivation(t *testing.T, cli *clientv3.Client) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ar, err := cli.Get(ctx, fleetKeys.Active())
	if err != nil || len(ar.Kvs) == 0 {
		t.Fatalf("state/active: %v (%d keys)", err, len(ar.Kvs))
	}
	a, err := state.ParseActive(ar.Kvs[0].Value)
	if err != nil {
		t.Fatal(err)
	}
	hr, err := cli.Get(ctx, fleetKeys.HistoryEvent(a.Epoch))
	switch {
	case err != nil:
		t.Fatal(err)
	case len(hr.Kvs) == 0:
		t.Errorf("state/active is epoch %d, and history/ has no record of it", a.Epoch)
	case hr.Kvs[0].CreateRevision != ar.Kvs[0].ModRevision:
		t.Errorf("history/%d was first written at revision %d, state/active at %d: the switch was recorded apart from its activation",
			a.Epoch, hr.Kvs[0].CreateRevision, ar.Kvs[0].ModRevision)
	}
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

// dc is two Kafka clusters, A and its replica B, kept by the in-process
// mirror, and an embedded etcd.
type dc struct {
	etcd   *devstack.Etcd
	a, b   *devstack.Kafka
	mirror *mirror.Mirror
}

const failoverPartitions = 4

// dcSpec is what startDC builds; dcOptions change it.
type dcSpec struct {
	topics        []string // source topics on A, failoverPartitions each
	syncs         string   // the mirror's offset-syncs topic; none when empty
	syncsOnTarget bool     // on B, else on A (MirrorMaker 2's default)
}

type dcOption func(*dcSpec)

// withTopics: the source topics are topics instead of orders, all
// mirrored to B.
func withTopics(topics ...string) dcOption { return func(s *dcSpec) { s.topics = topics } }

// withoutOffsetSyncs: B is filled as by a replicator that is not
// MirrorMaker 2, and translation has only fingerprints and timestamps to
// go by.
func withoutOffsetSyncs() dcOption { return func(s *dcSpec) { s.syncs = "" } }

// withOffsetSyncs: the mirror's offset-syncs topic is topic, on B
// (onTarget) or on A.
func withOffsetSyncs(topic string, onTarget bool) dcOption {
	return func(s *dcSpec) { s.syncs, s.syncsOnTarget = topic, onTarget }
}

// startDC starts etcd and clusters A and B, with a mirror copying A's
// source topics (orders, unless withTopics) to B as A.<topic>, B's offsets
// 17 ahead of A's, and offset-syncs on B as MirrorMaker 2 writes them with
// offset-syncs.topic.location=target (unless an option says otherwise).
func startDC(t testing.TB, opts ...dcOption) *dc {
	t.Helper()
	// MirrorMaker 2 names the syncs topic after the source when it lives
	// on the target: readable while A is down, for partitions whose last
	// consumed record had not reached B yet.
	spec := dcSpec{topics: []string{"orders"}, syncs: "mm2-offset-syncs.A.internal", syncsOnTarget: true}
	for _, o := range opts {
		o(&spec)
	}
	parts := map[string]int32{}
	for _, topic := range spec.topics {
		parts[topic] = failoverPartitions
	}
	d := &dc{
		etcd: testenv.StartEtcdT(t),
		a:    testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: parts}),
		b:    testenv.StartKafkaT(t, "B", devstack.KafkaOptions{}),
	}
	m, err := mirror.Start(context.Background(), mirror.Config{
		Source: d.a.Brokers(), Target: d.b.Brokers(), SourceName: "A", TargetName: "B",
		Topics: spec.topics, RemoteTopic: func(t string) string { return "A." + t },
		// Offsets on B differ from A's: translation must find them.
		TargetPrefill:    17,
		OffsetSyncsTopic: spec.syncs, OffsetSyncsOnTarget: spec.syncsOnTarget,
	})
	if err != nil {
		t.Fatal(err)
	}
	d.mirror = m
	t.Cleanup(m.Stop)
	return d
}

func (d *dc) config(id string) config.Config {
	cfg := testConfig(d.etcd, id)
	cfg.Clusters = map[string]config.Cluster{
		"A": {Brokers: d.a.Brokers(), Role: config.RolePrimary},
		"B": {Brokers: d.b.Brokers(), Role: config.RoleStandby, OffsetSyncsOn: "target"},
	}
	cfg.Source.Topics = []string{"orders"}
	cfg.Source.CommitInterval = 100 * time.Millisecond
	cfg.Source.RefreshInterval = time.Second
	// Probes every 200 ms, each given 1 s, and a cluster judged down after
	// 2 s without one: short enough for quick tests, long enough that
	// probes starved of CPU (tests run six at once under -race) do not
	// fail a healthy fleet over. A cluster refusing connections is judged
	// on the hard failure window (500 ms) all the same.
	cfg.Failover.ProbeInterval = 200 * time.Millisecond
	cfg.Failover.ProbeTimeout = time.Second
	cfg.Failover.FailureWindow = 2 * time.Second
	cfg.Failover.FailbackStable = 2 * time.Second
	return cfg
}

// flowingFleet starts agent-1..3 on d (their configuration changed by
// mods), handing records to a ledger, waits until they consume A, and
// starts a producer to A.
func flowingFleet(t *testing.T, d *dc, mods ...func(*config.Config)) (*ledger, []*agent.Agent, *producer) {
	t.Helper()
	l := newLedger()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		cfg := d.config(id)
		for _, m := range mods {
			m(&cfg)
		}
		agents = append(agents, startConsumer(t, cfg, l.handler(id)))
	}
	waitConsuming(t, 20*time.Second, "A", agents...)
	return l, agents, startProducer(t, d.a.Brokers(), "orders", 0)
}

// activeOf returns the cluster every agent consumes, or an error while they
// disagree or own nothing.
func activeOf(agents ...*agent.Agent) (string, error) {
	return activeOfN(failoverPartitions, agents...)
}

// activeOfN is activeOf for a fleet of n partitions.
func activeOfN(n int, agents ...*agent.Agent) (string, error) {
	cluster, total := "", 0
	for _, a := range agents {
		st := a.Status()
		if cluster != "" && st.Active != cluster {
			return "", fmt.Errorf("%s consumes %s, others %s", a.ID(), st.Active, cluster)
		}
		cluster = st.Active
		total += len(st.Owned)
	}
	if total != n {
		return "", fmt.Errorf("%d of %d partitions owned", total, n)
	}
	return cluster, nil
}

// producer writes numbered records to a cluster's topic until stopped.
type producer struct {
	next    atomic.Int64
	stop    chan struct{}
	done    chan struct{}
	failed  atomic.Int64
	started int64
}

func startProducer(t testing.TB, brokers []string, topic string, from int64) *producer {
	t.Helper()
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	sc.Producer.Return.Successes = true
	sc.Producer.Retry.Max = 0
	sc.Producer.Partitioner = sarama.NewRoundRobinPartitioner
	sc.Net.ReadTimeout = time.Second
	sc.Net.DialTimeout = time.Second
	p, err := sarama.NewSyncProducer(brokers, sc)
	if err != nil {
		t.Fatal(err)
	}
	pr := &producer{stop: make(chan struct{}), done: make(chan struct{}), started: from}
	pr.next.Store(from)
	go func() {
		defer close(pr.done)
		defer p.Close()
		for {
			select {
			case <-pr.stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
			id := pr.next.Load()
			_, _, err := p.SendMessage(&sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder(strconv.FormatInt(id, 10)),
				Value: sarama.StringEncoder(strconv.FormatInt(id, 10)), Timestamp: time.Now()})
			if err != nil {
				pr.failed.Add(1)
				continue
			}
			pr.next.Add(1)
		}
	}()
	t.Cleanup(pr.halt)
	return pr
}

// halt stops the producer and returns the first id it did not write.
func (p *producer) halt() {
	select {
	case <-p.stop:
	default:
		close(p.stop)
	}
	<-p.done
}

// idsOn reads every record of topic on a cluster and returns the ids
// (record values), skipping the mirror's filler.
func idsOn(t *testing.T, k *devstack.Kafka, topic string) map[string]bool {
	t.Helper()
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	c, err := sarama.NewConsumer(k.Brokers(), sc)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	cl, err := sarama.NewClient(k.Brokers(), sc)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	out := map[string]bool{}
	for p := range int32(failoverPartitions) {
		end, err := cl.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			t.Fatal(err)
		}
		if end == 0 {
			continue
		}
		pc, err := c.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			t.Fatal(err)
		}
		for msg := range pc.Messages() {
			filler := false
			for _, h := range msg.Headers {
				if string(h.Key) == mirror.FillerHeader {
					filler = true
				}
			}
			if !filler {
				out[string(msg.Value)] = true
			}
			if msg.Offset == end-1 {
				break
			}
		}
		pc.Close()
	}
	return out
}

// waitFlowing waits until n records were handled and mirrored to B.
func waitFlowing(t *testing.T, d *dc, l *ledger, n int) {
	t.Helper()
	wait.For(t, 20*time.Second, "records flowing through A and mirrored to B", func() error {
		if h, m := l.count(), d.mirror.Copied(); h < n || m < int64(n) {
			return fmt.Errorf("%d handled, %d mirrored", h, m)
		}
		return nil
	})
}

// logHistory logs the fleet's switch history, which says per partition how
// its position was translated, and returns how many records the targets
// lagged by in all.
func logHistory(t *testing.T, e *devstack.Etcd) (lagged int64) {
	cli := testenv.EtcdClientT(t, e)
	resp, err := cli.Get(context.Background(), keys.New("orders").SwitchHistory(), clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	for _, kv := range resp.Kvs {
		t.Logf("history %s", kv.Value)
		var ev state.SwitchEvent
		if err := json.Unmarshal(kv.Value, &ev); err != nil {
			t.Fatalf("history %s: %v", kv.Key, err)
		}
		for _, p := range ev.Partitions {
			lagged += p.Lagged
		}
	}
	return lagged
}

// backOnA brings A back and waits for the fleet to fail back to it
// (failback_stable in cfg) and to handle records produced to A from then
// on, numbered from 2 000 000.
func backOnA(t *testing.T, d *dc, l *ledger, cfg config.Config, agents ...*agent.Agent) {
	t.Helper()
	d.a.Recover()
	waitConsuming(t, cfg.Failover.FailbackStable+20*time.Second, "A", agents...)
	p := startProducer(t, d.a.Brokers(), "orders", 2_000_000)
	defer p.halt()
	wait.For(t, 20*time.Second, "records produced after the failback handled", func() error {
		if l.timesHandled("2000100") == 0 {
			return fmt.Errorf("record 2000100 not handled")
		}
		return nil
	})
}

// flow is a producer and the topic on A it writes.
type flow struct {
	p     *producer
	topic string
}

// drain ends a test that must lose nothing: once records the flows write
// after now are handled, it stops the producers, waits for the mirror to
// have copied A to B when the fleet may consume B (mirrored), then for
// every record on the flows' topics on A to be handled; the hand-overs
// must not have delivered anything twice. It returns the records handled
// more than once, and by whom first.
func drain(t *testing.T, d *dc, l *ledger, ho *handovers, mirrored bool, flows ...flow) (dups int, dupFirst map[string]int) {
	t.Helper()
	var marks []string
	for _, f := range flows {
		marks = append(marks, fmt.Sprint(f.p.next.Load()+50))
	}
	wait.For(t, 30*time.Second, "records produced after the last change handled", func() error {
		for _, m := range marks {
			if l.timesHandled(m) == 0 {
				return fmt.Errorf("record %s not handled", m)
			}
		}
		return nil
	})
	for _, f := range flows {
		f.p.halt()
	}
	if mirrored {
		mctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if err := d.mirror.CaughtUp(mctx); err != nil {
			t.Fatalf("the mirror did not catch up: %v", err)
		}
	}
	ids := map[string]bool{}
	for _, f := range flows {
		maps.Copy(ids, idsOn(t, d.a, f.topic))
	}
	waitAllHandled(t, l, ids, 30*time.Second)
	_, dups, dupFirst = l.result(0)
	t.Logf("%d records, 0 lost, %d duplicates", len(ids), dups)
	for _, dup := range l.dupDeliveries() {
		t.Log(dup)
	}
	ho.check(t, l)
	return dups, dupFirst
}

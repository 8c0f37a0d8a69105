package routing

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/twmb/franz-go/pkg/kgo"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/signals"
)

// fleet is the fleet of the component tests.
const fleet = "rt"

// world is a set of kfake clusters, optionally an etcd, and a router.
type world struct {
	t      *testing.T
	kafkas map[string]*devstack.Kafka
	cfg    config.Config
	etcd   *clientv3.Client
	reg    *prometheus.Registry
	acks   *acks
	router *Router
	// unackedOnClose: the test leaves produces unacknowledged on purpose,
	// so Close reports them.
	unackedOnClose bool
}

// newWorld starts a kfake cluster per name, each with the topics given
// (name → topics), and a configuration naming them (the first primary,
// the others sinks).
func newWorld(t *testing.T, clusters map[string][]string, order ...string) *world {
	t.Helper()
	w := &world{t: t, kafkas: map[string]*devstack.Kafka{}, reg: prometheus.NewRegistry(), acks: newAcks()}
	w.cfg = config.Default()
	w.cfg.Fleet = fleet
	w.cfg.Clusters = map[string]config.Cluster{}
	for i, name := range order {
		topics := map[string]int32{}
		for _, tp := range clusters[name] {
			topics[tp] = 3
		}
		k := testenv.StartKafkaT(t, name, devstack.KafkaOptions{Topics: topics})
		w.kafkas[name] = k
		role := config.RoleSink
		if i == 0 {
			role = config.RolePrimary
		}
		w.cfg.Clusters[name] = config.Cluster{Brokers: k.Brokers(), Role: role, Version: config.DefaultKafkaVersion, ClientID: "routing-test"}
	}
	return w
}

// withEtcd starts an embedded etcd for the dynamic layer.
func (w *world) withEtcd() *world {
	e := testenv.StartEtcdT(w.t)
	w.etcd = testenv.EtcdClientT(w.t, e)
	return w
}

// start builds the router on w.cfg.Routing and runs it until the test
// ends; Close is bounded by 10 s.
func (w *world) start(sig func() signals.State) *Router {
	w.t.Helper()
	r, err := New(w.cfg, sig, Options{Etcd: w.etcd, Registerer: w.reg, Logger: zaptest.NewLogger(w.t),
		OnAck: w.acks.add, RetryBackoffMax: 500 * time.Millisecond})
	if err != nil {
		w.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	w.t.Cleanup(func() {
		cancel()
		<-done
		wait := 10 * time.Second
		if w.unackedOnClose {
			wait = time.Second
		}
		cctx, ccancel := context.WithTimeout(context.Background(), wait)
		defer ccancel()
		if err := r.Close(cctx); err != nil && !(w.unackedOnClose && strings.Contains(err.Error(), "not acknowledged when closing")) {
			w.t.Errorf("Close: %v", err)
		}
	})
	select {
	case <-r.Ready():
	case <-time.After(10 * time.Second):
		w.t.Fatal("router not ready after 10s")
	}
	w.router = r
	return r
}

// put writes key=value to etcd and returns the revision.
func (w *world) put(key, value string) int64 {
	w.t.Helper()
	resp, err := w.etcd.Put(w.t.Context(), key, value)
	if err != nil {
		w.t.Fatal(err)
	}
	return resp.Header.Revision
}

// waitVersion waits until the router's version is at least rev.
func (w *world) waitVersion(rev int64) {
	w.t.Helper()
	wait.For(w.t, 10*time.Second, fmt.Sprintf("version %d in force", rev), func() error {
		if v := w.router.Version().Number; v < rev {
			return fmt.Errorf("version %d; last refusal %+v", v, w.router.Status().LastRefusal)
		}
		return nil
	})
}

// acks records the acknowledged records.
type acks struct {
	mu   sync.Mutex
	seen map[string]int // "topic/partition@offset" → times acked
}

func newAcks() *acks { return &acks{seen: map[string]int{}} }

func (a *acks) add(r *record.Record) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.seen[sourceOf(r)]++
}

func (a *acks) has(r *record.Record) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.seen[sourceOf(r)] > 0
}

func (a *acks) count(prefix string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for k := range a.seen {
		if strings.HasPrefix(k, prefix) {
			n++
		}
	}
	return n
}

// testRecord builds the record at offset of topic/partition; its value names
// it, "topic/partition@offset", which the destination tests look for.
func testRecord(topic string, partition int32, offset int64, value string) *record.Record {
	if value == "" {
		value = fmt.Sprintf("%s/%d@%d", topic, partition, offset)
	}
	return &record.Record{Cluster: "A", Topic: topic, SourceTopic: topic, Partition: partition, Offset: offset,
		Key: []byte("k" + strconv.FormatInt(offset, 10)), Value: []byte(value), Timestamp: time.Now().Truncate(time.Millisecond)}
}

// handle offers rec to the router as the agent does: again after an
// error, until it is taken or timeout passes.
func (w *world) handle(rec *record.Record, timeout time.Duration) {
	w.t.Helper()
	if err := deliver(context.Background(), w.router, rec, timeout); err != nil {
		w.t.Fatal(err)
	}
}

func deliver(ctx context.Context, r *Router, rec *record.Record, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		err := r.Handle(ctx, rec)
		if err == nil || ctx.Err() != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("record %s not taken after %v: %w", sourceOf(rec), timeout, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// read returns the records of topic on cluster, waiting until there are
// at least n of them.
func (w *world) read(cluster, topic string, n int) []*kgo.Record {
	w.t.Helper()
	cl := w.consumer(cluster, topic)
	defer cl.Close()
	var out []*kgo.Record
	ctx, cancel := context.WithTimeout(w.t.Context(), 15*time.Second)
	defer cancel()
	for len(out) < n {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			w.t.Fatalf("%s/%s: %d records after 15s, want %d", cluster, topic, len(out), n)
		}
		fs.EachRecord(func(r *kgo.Record) { out = append(out, r) })
	}
	return out
}

// consumer returns a client that reads topic on cluster from its start.
func (w *world) consumer(cluster, topic string) *kgo.Client {
	w.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(w.kafkas[cluster].Brokers()...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(100*time.Millisecond))
	if err != nil {
		w.t.Fatal(err)
	}
	return cl
}

// values returns the distinct values of recs.
func values(recs []*kgo.Record) map[string]bool {
	out := map[string]bool{}
	for _, r := range recs {
		out[string(r.Value)] = true
	}
	return out
}

func header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

func TestFanOutToTwoClusters(t *testing.T) {
	t.Parallel()
	w := newWorld(t, map[string][]string{"B": {"copy"}, "C": {"audit"}}, "A", "B", "C")
	w.cfg.Routing = Config{Mode: ModeAll,
		Rules: []Rule{{Name: "orders", Match: `topic == "orders"`, Channels: []string{"copy", "audit"}}},
		Channels: map[string]Channel{
			"copy":  {Cluster: "B", Topic: "copy"},
			"audit": {Cluster: "C", Topic: "audit", Key: `"audit-" + key`, Partitioner: PartitionerManual, Compression: "lz4", Acks: "leader"},
		}}
	w.start(nil)
	const n = 200
	var recs []*record.Record
	for i := range n {
		r := testRecord("orders", int32(i%3), int64(i/3), "")
		recs = append(recs, r)
		w.handle(r, 10*time.Second)
	}
	wait.For(t, 10*time.Second, "every record acknowledged", func() error {
		if got := w.acks.count("orders/"); got != n {
			return fmt.Errorf("%d of %d acknowledged", got, n)
		}
		return nil
	})
	copyRecs, audit := w.read("B", "copy", n), w.read("C", "audit", n)
	for _, r := range recs {
		if v := string(r.Value); !values(copyRecs)[v] || !values(audit)[v] {
			t.Errorf("%s missing: on B %v, on C %v", v, values(copyRecs)[v], values(audit)[v])
		}
	}
	for _, r := range audit {
		if !strings.HasPrefix(string(r.Key), "audit-k") || !strings.HasPrefix(string(r.Value), fmt.Sprintf("orders/%d@", r.Partition)) {
			t.Errorf("audit record key %q value %q on partition %d: want key audit-k…, same partition", r.Key, r.Value, r.Partition)
		}
	}
	if got := metricValue(w.router.m.routed.WithLabelValues("copy")); got != n {
		t.Errorf("routed{copy} = %v", got)
	}
	if got := metricValue(w.router.m.rules.WithLabelValues("orders")); got != n {
		t.Errorf("rule_matches{orders} = %v", got)
	}
	if got := countSeries(w.router.m.latency); got != 2 {
		t.Errorf("latency series = %d, want 2", got)
	}
	st := w.router.Status()
	if len(st.Producers) != 2 || st.InFlight != 0 {
		t.Errorf("status = %+v", st)
	}

	// A record no rule matches is dropped, acknowledged and counted.
	other := testRecord("payments", 0, 0, "")
	w.handle(other, time.Second)
	if !w.acks.has(other) || metricValue(w.router.m.dropped.WithLabelValues(DropNoMatch)) != 1 {
		t.Error("unmatched record not dropped and acknowledged")
	}
}

func TestRuleChangeThroughEtcd(t *testing.T) {
	t.Parallel()
	w := newWorld(t, map[string][]string{"B": {"b"}, "C": {"c"}}, "A", "B", "C").withEtcd()
	w.cfg.Routing = Config{
		Rules:    []Rule{{Name: "to-b", Match: `topic == "orders"`, Channels: []string{"b"}}},
		Channels: map[string]Channel{"b": {Cluster: "B", Topic: "b"}, "c": {Cluster: "C", Topic: "c"}},
	}
	k := keys.New(fleet)
	r := w.start(nil)
	if v := r.Version(); v.Number != 0 || v.Source != "file" || metricValue(r.m.version) != 0 {
		t.Fatalf("first version %d from %s", v.Number, v.Source)
	}
	for i := range 10 {
		w.handle(testRecord("orders", 0, int64(i), ""), 10*time.Second)
	}
	rev := w.put(k.Routes(), "rules:\n  - name: to-c\n    match: topic == \"orders\"\n    channels: [c]\n")
	w.waitVersion(rev)
	if v := r.Version(); v.Source != "file+etcd" || v.RuleNames()[0] != "to-c" || metricValue(r.m.version) != float64(rev) {
		t.Errorf("version %+v", r.Status())
	}
	for i := 10; i < 20; i++ {
		w.handle(testRecord("orders", 0, int64(i), ""), 10*time.Second)
	}
	onB, onC := values(w.read("B", "b", 10)), values(w.read("C", "c", 10))
	for i := range 20 {
		v := fmt.Sprintf("orders/0@%d", i)
		if before := i < 10; onB[v] != before || onC[v] == before {
			t.Errorf("%s: on B %v, on C %v; want it where version %s said", v, onB[v], onC[v], map[bool]string{true: "file", false: "etcd"}[before])
		}
	}
	// Deleting the routes key returns to the file's rules, as a new version.
	resp, err := w.etcd.Delete(t.Context(), k.Routes())
	if err != nil {
		t.Fatal(err)
	}
	w.waitVersion(resp.Header.Revision)
	if r.Version().RuleNames()[0] != "to-b" {
		t.Errorf("after delete: rules %v", r.Version().RuleNames())
	}
}

func TestChannelOnAThirdClusterAtRunTime(t *testing.T) {
	t.Parallel()
	w := newWorld(t, map[string][]string{"B": {"b"}, "C": {"new"}}, "A", "B", "C").withEtcd()
	w.cfg.Routing = Config{Default: []string{"b"}, Channels: map[string]Channel{"b": {Cluster: "B", Topic: "b"}}}
	k := keys.New(fleet)
	r := w.start(nil)
	// A version's producers are opened when it comes into force, before
	// any record is routed.
	wait.For(t, 10*time.Second, "B's producer open before any record", func() error {
		if p := r.Status().Producers; len(p) != 1 || p[0] != "B" {
			return fmt.Errorf("producers %v, want [B]", p)
		}
		return nil
	})
	w.handle(testRecord("orders", 0, 0, ""), 10*time.Second)
	w.put(k.Channel("fresh"), "cluster: C\ntopic: new\npartitioner: roundrobin\n")
	rev := w.put(k.Routes(), "default: [fresh]\n")
	w.waitVersion(rev)
	wait.For(t, 10*time.Second, "C's producer open before any record", func() error {
		if p := r.Status().Producers; !slices.Contains(p, "C") {
			return fmt.Errorf("producers %v, want C among them", p)
		}
		return nil
	})
	for i := 1; i <= 30; i++ {
		w.handle(testRecord("orders", 0, int64(i), ""), 10*time.Second)
	}
	got := w.read("C", "new", 30)
	parts := map[int32]bool{}
	for _, r := range got {
		parts[r.Partition] = true
	}
	if len(parts) != 3 {
		t.Errorf("round robin used partitions %v, want all 3", parts)
	}
	// B's producer is closed once no channel uses it; C's stays.
	wait.For(t, 10*time.Second, "B's producer closed", func() error {
		if p := r.Status().Producers; len(p) != 1 || p[0] != "C" {
			return fmt.Errorf("producers %v", p)
		}
		return nil
	})
	if got := metricValue(r.m.producers); got != 1 {
		t.Errorf("kswitch_routing_producers = %v", got)
	}
}

func TestInvalidVersionRefused(t *testing.T) {
	t.Parallel()
	w := newWorld(t, map[string][]string{"B": {"b"}}, "A", "B").withEtcd()
	w.cfg.Routing = Config{Channels: map[string]Channel{"b": {Cluster: "B", Topic: "b"}}}
	k := keys.New(fleet)
	r := w.start(nil)
	const goodRoutes = "rules: [{name: all, channels: [b]}]\n"
	good := w.put(k.Routes(), goodRoutes)
	w.waitVersion(good)
	for _, bad := range []struct{ key, value, reason string }{
		{k.Routes(), "rules: [{name: all, channels: [nowhere]}]\n", `rules[0].channels[0]: channel "nowhere" is not defined`},
		{k.Routes(), "rules: [{name: all, match: 'topic ==', channels: [b]}]\n", "rules[0].match: unexpected token EOF"},
		{k.Routes(), "rules: [{name: all, chanels: [b]}]\n", `routes line 1: unknown field "chanels"`},
		{k.Routes(), "rules: [{name: all, match: 'reduce(1..999999, #acc + value, \"\") != \"\"', channels: [b]}]\n", "rules[0].match: refused: on an empty record, the expression exceeded its evaluation budget"},
		{k.Channel("x"), "cluster: Z\ntopic: t\n", `channels.x.cluster: "Z" is not a configured cluster`},
	} {
		rev := w.put(bad.key, bad.value)
		wait.For(t, 10*time.Second, "refusal of "+bad.value, func() error {
			ref := r.Status().LastRefusal
			if ref == nil || ref.Version != rev || !ref.Current {
				return fmt.Errorf("last refusal %+v", ref)
			}
			return nil
		})
		if ref := r.Status().LastRefusal; !strings.Contains(ref.Reason, bad.reason) {
			t.Errorf("reason %q lacks %q", ref.Reason, bad.reason)
		}
		if v := r.Version(); v.Number != good {
			t.Errorf("version %d in force, want %d", v.Number, good)
		}
		// The old version routes on.
		routed := testRecord("orders", 0, rev, "")
		w.handle(routed, 10*time.Second)
		wait.For(t, 10*time.Second, "record routed by the old version", func() error {
			if !w.acks.has(routed) {
				return errors.New("not acknowledged")
			}
			return nil
		})
		// Back to a good version before the next bad one.
		if bad.key == k.Channel("x") {
			if _, err := w.etcd.Delete(t.Context(), bad.key); err != nil {
				t.Fatal(err)
			}
		}
		good = w.put(k.Routes(), goodRoutes+"# after refusal "+strconv.FormatInt(rev, 10)+"\n")
		w.waitVersion(good)
	}
	if got := metricValue(r.m.refused); got != 5 {
		t.Errorf("refused = %v, want 5", got)
	}
	for kind, want := range map[string]float64{refused.Routes: 4, refused.Channel: 1} {
		if got := metricValue(r.m.refusedValues.WithLabelValues(kind)); got != want {
			t.Errorf("%s{kind=%q} = %v, want %v", refused.Name, kind, got, want)
		}
	}
	fixed := w.put(k.Routes(), "rules: [{name: fixed, channels: [b]}]\n")
	w.waitVersion(fixed)
	if ref := r.Status().LastRefusal; ref == nil || ref.Current {
		t.Errorf("after a good version the refusal is still current: %+v", ref)
	}
}

func TestEvaluationErrorGoesToDeadLetter(t *testing.T) {
	t.Parallel()
	w := newWorld(t, map[string][]string{"B": {"big", "dead"}}, "A", "B")
	w.cfg.Routing = Config{
		Rules:      []Rule{{Name: "big", Match: `json.amount > 1000`, Channels: []string{"big"}}},
		DeadLetter: "dead",
		Channels:   map[string]Channel{"big": {Cluster: "B", Topic: "big"}, "dead": {Cluster: "B", Topic: "dead"}},
	}
	r := w.start(nil)
	good := testRecord("orders", 1, 4, `{"amount": 5000}`)
	bad := testRecord("orders", 1, 5, `not json`)
	bad.Headers = []record.Header{{Key: []byte("trace"), Value: []byte("t-1")}}
	w.handle(good, 10*time.Second)
	w.handle(bad, 10*time.Second)
	wait.For(t, 10*time.Second, "both acknowledged", func() error {
		if !w.acks.has(good) || !w.acks.has(bad) {
			return errors.New("not yet")
		}
		return nil
	})
	dead := w.read("B", "dead", 1)
	if len(dead) != 1 {
		t.Fatalf("%d dead letters", len(dead))
	}
	d := dead[0]
	if string(d.Value) != "not json" || string(d.Key) != "k5" || header(d, "trace") != "t-1" ||
		header(d, HeaderRule) != "big" || header(d, HeaderSource) != "orders/1@5" || header(d, HeaderSourceCluster) != "A" ||
		!strings.Contains(header(d, HeaderError), "routing: rule big:") {
		t.Errorf("dead letter key %q value %q headers %v", d.Key, d.Value, d.Headers)
	}
	if v := values(w.read("B", "big", 1)); !v[`{"amount": 5000}`] || len(v) != 1 {
		t.Errorf("big = %v", v)
	}
	if got := metricValue(r.m.dead.WithLabelValues("evaluation")); got != 1 {
		t.Errorf("dead_lettered{evaluation} = %v", got)
	}
}

// TestRuleOverBudgetIsDeadLettered: a rule cheap on the records it was
// tested on but too costly on a large one sends that record to the
// dead-letter channel with the reason, while the others route on, and a
// rule that replaces it takes effect.
func TestRuleOverBudgetIsDeadLettered(t *testing.T) {
	t.Parallel()
	w := newWorld(t, map[string][]string{"B": {"b", "dead"}}, "A", "B").withEtcd()
	w.cfg.Routing = Config{
		// reduce builds len(value)²/2 bytes: 33 MB for 8 KiB.
		Rules:      []Rule{{Name: "costly", Match: `len(value) <= 4096 || len(value) > 10000 || reduce(1..len(value), #acc + "x", "") != ""`, Channels: []string{"b"}}},
		DeadLetter: "dead",
		Channels:   map[string]Channel{"b": {Cluster: "B", Topic: "b"}, "dead": {Cluster: "B", Topic: "dead"}},
	}
	r := w.start(nil)
	var small, large []*record.Record
	for i := range 6 {
		rec := testRecord("orders", 0, int64(i), "")
		if i%2 == 1 {
			rec.Value = []byte(fmt.Sprintf("%08d", i) + strings.Repeat("x", 8<<10))
			large = append(large, rec)
		} else {
			small = append(small, rec)
		}
		w.handle(rec, 10*time.Second)
	}
	dead := w.read("B", "dead", len(large))
	for _, d := range dead {
		// Bytes built, or (on a loaded machine) the clock first.
		if !strings.HasPrefix(header(d, HeaderError), "routing: rule costly: the expression exceeded its evaluation budget: ") {
			t.Errorf("dead letter %s: error header %q", header(d, HeaderSource), header(d, HeaderError))
		}
	}
	if len(dead) != len(large) || len(values(w.read("B", "b", len(small)))) != len(small) {
		t.Fatalf("%d dead letters, want %d", len(dead), len(large))
	}
	if got := metricValue(r.m.dead.WithLabelValues("budget")); got != float64(len(large)) {
		t.Errorf("dead_lettered{budget} = %v, want %d", got, len(large))
	}
	rev := w.put(keys.New(fleet).Routes(), "rules: [{name: cheap, channels: [b]}]\n")
	w.waitVersion(rev)
	rec := testRecord("orders", 0, 6, strings.Repeat("y", 8<<10))
	w.handle(rec, 10*time.Second)
	if onB := values(w.read("B", "b", len(small)+1)); !onB[string(rec.Value)] {
		t.Errorf("a large record after the rule was replaced is not on b (%d records there)", len(onB))
	}
}

func TestEvaluationErrorWithoutDeadLetterStops(t *testing.T) {
	t.Parallel()
	w := newWorld(t, map[string][]string{"B": {"big"}}, "A", "B").withEtcd()
	w.cfg.Routing = Config{
		Rules:    []Rule{{Name: "big", Match: `json.amount > 1000`, Channels: []string{"big"}}},
		Channels: map[string]Channel{"big": {Cluster: "B", Topic: "big"}},
	}
	r := w.start(nil)
	bad := testRecord("orders", 0, 0, "not json")
	err := r.Handle(t.Context(), bad)
	var ee *EvalError
	if !errors.As(err, &ee) || !strings.Contains(err.Error(), "no dead-letter channel") {
		t.Fatalf("Handle = %v, want an evaluation error", err)
	}
	if w.acks.has(bad) {
		t.Fatal("a record that failed evaluation was acknowledged")
	}
	// A version that routes it lets the partition continue.
	rev := w.put(keys.New(fleet).Routes(), "rules: [{name: big, match: '(json?.amount ?? 0) > 1000', channels: [big]}]\ndefault: [big]\n")
	w.waitVersion(rev)
	w.handle(bad, 10*time.Second)
	w.read("B", "big", 1)
}

// TestDestinationDown cuts cluster B off: the records of its channel wait
// unacknowledged, C's flow; when B returns, nothing is lost.
func TestDestinationDown(t *testing.T) {
	t.Parallel()
	w := newWorld(t, map[string][]string{"B": {"b"}, "C": {"c"}}, "A", "B", "C")
	w.cfg.Routing = Config{
		Rules: []Rule{
			{Name: "p0", Match: `partition == 0`, Channels: []string{"b"}},
			{Name: "p1", Match: `partition == 1`, Channels: []string{"c"}},
		},
		Channels: map[string]Channel{"b": {Cluster: "B", Topic: "b"}, "c": {Cluster: "C", Topic: "c"}},
	}
	r := w.start(nil)

	// Two partitions, handled as the agent does: in order, each record
	// offered again until the router takes it.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var offered [2]struct {
		mu sync.Mutex
		n  int64
	}
	var wg sync.WaitGroup
	for p := range 2 {
		wg.Go(func() {
			for off := int64(0); ctx.Err() == nil; off++ {
				if deliver(ctx, r, testRecord("orders", int32(p), off, ""), time.Hour) != nil {
					return
				}
				offered[p].mu.Lock()
				offered[p].n = off + 1
				offered[p].mu.Unlock()
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
	taken := func(p int) int64 {
		offered[p].mu.Lock()
		defer offered[p].mu.Unlock()
		return offered[p].n
	}
	wait.For(t, 10*time.Second, "both partitions flowing", func() error {
		if w.acks.count("orders/0@") < 20 || w.acks.count("orders/1@") < 20 {
			return fmt.Errorf("acked %d, %d", w.acks.count("orders/0@"), w.acks.count("orders/1@"))
		}
		return nil
	})

	w.kafkas["B"].Fail()
	wait.For(t, 20*time.Second, "channel b failing", func() error {
		for _, c := range r.Status().Channels {
			if c.Name == "b" && c.Failing != "" {
				return nil
			}
		}
		return errors.New("not failing")
	})
	stuck := taken(0)
	acked0 := w.acks.count("orders/0@")
	c1 := w.acks.count("orders/1@")
	time.Sleep(2 * time.Second) // B stays down: nothing to wait for but time
	if got := taken(0); got > stuck+1 {
		t.Errorf("partition 0 took %d more records while its channel failed", got-stuck)
	}
	if got := w.acks.count("orders/0@"); got != acked0 {
		t.Errorf("%d records for the failing cluster acknowledged while it was down", got-acked0)
	}
	if got := w.acks.count("orders/1@"); got < c1+50 {
		t.Errorf("partition 1 (cluster C) acknowledged only %d records in 2s while B was down", got-c1)
	}
	if acked0 >= int(stuck) {
		t.Logf("note: every record taken for B before the failure was acknowledged")
	}
	t.Logf("while B was down: partition 0 held at %d taken / %d acked; partition 1 acked %d more", stuck, acked0, w.acks.count("orders/1@")-c1)
	if got, want := inFlightMetric(r, "b"), float64(stuck)-float64(acked0); got != want {
		t.Errorf("kswitch_routing_in_flight{channel=b} = %v while B was down, want %v (taken, not acknowledged)", got, want)
	}

	w.kafkas["B"].Recover()
	wait.For(t, 30*time.Second, "partition 0 flowing again", func() error {
		if got := taken(0); got < stuck+20 {
			return fmt.Errorf("taken %d", got)
		}
		return nil
	})
	cancel()
	wg.Wait()
	n0 := taken(0)
	wait.For(t, 20*time.Second, "every record taken acknowledged", func() error {
		if got := w.acks.count("orders/0@"); int64(got) < n0 {
			return fmt.Errorf("%d of %d acknowledged", got, n0)
		}
		return nil
	})
	onB := values(w.read("B", "b", int(n0)))
	for off := range n0 {
		if v := fmt.Sprintf("orders/0@%d", off); !onB[v] {
			t.Errorf("%s lost", v)
		}
	}
	// The idempotent producer retried B itself, in order: nothing failed
	// back to the router (kswitch_routing_produce_failures_total counts
	// what does).
	if f := metricValue(r.m.failures.WithLabelValues("b")); f != 0 {
		t.Errorf("%v produces failed back to the router through a 2 s outage", f)
	}
	if got := inFlightMetric(r, "b"); got != 0 {
		t.Errorf("kswitch_routing_in_flight{channel=b} = %v with every record acknowledged", got)
	}
}

// inFlightMetric returns kswitch_routing_in_flight of channel as r's
// registry exports it (-1 when absent).
func inFlightMetric(r *Router, channel string) float64 {
	ch := make(chan prometheus.Metric, 100)
	inFlightCollector{r}.Collect(ch)
	close(ch)
	for m := range ch {
		var d dto.Metric
		if err := m.Write(&d); err != nil {
			panic(err)
		}
		for _, l := range d.Label {
			if l.GetName() == "channel" && l.GetValue() == channel {
				return d.Gauge.GetValue()
			}
		}
	}
	return -1
}

func TestChannelPauseHoldsRecords(t *testing.T) {
	t.Parallel()
	w := newWorld(t, map[string][]string{"B": {"b"}}, "A", "B").withEtcd()
	w.cfg.Routing = Config{Default: []string{"b"}, Channels: map[string]Channel{"b": {Cluster: "B", Topic: "b"}}}
	k := keys.New(fleet)
	sw := signals.NewWatcher(w.etcd, k, 2*time.Second, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = sw.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	r := w.start(sw.State)
	w.handle(testRecord("orders", 0, 0, ""), 10*time.Second)

	if err := signals.Write(t.Context(), w.etcd, k, signals.Scope{Kind: signals.Channel, Name: "b"}, true, "test"); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 5*time.Second, "pause seen", func() error {
		if !sw.State().ChannelPaused("b") {
			return errors.New("not paused")
		}
		return nil
	})
	held := testRecord("orders", 0, 1, "")
	for range 3 {
		err := r.Handle(t.Context(), held)
		var we *WaitError
		if !errors.As(err, &we) || we.Reason != "paused" || err.Error() != "routing: channel b paused" {
			t.Fatalf("Handle while paused = %v", err)
		}
	}
	if st := r.Status(); !st.Channels[0].Paused {
		t.Errorf("status does not show the pause: %+v", st.Channels)
	}
	time.Sleep(200 * time.Millisecond)
	if w.acks.has(held) {
		t.Fatal("a held record was acknowledged")
	}
	if err := signals.Write(t.Context(), w.etcd, k, signals.Scope{Kind: signals.Channel, Name: "b"}, false, "test"); err != nil {
		t.Fatal(err)
	}
	w.handle(held, 10*time.Second)
	if v := values(w.read("B", "b", 2)); !v["orders/0@1"] {
		t.Errorf("held record not delivered after resume: %v", v)
	}
}

func TestNotReadyBeforeEtcdRead(t *testing.T) {
	t.Parallel()
	w := newWorld(t, map[string][]string{}, "A")
	e := testenv.StartEtcdT(t)
	c := testenv.EtcdClientT(t, e)
	e.Stop() // etcd down: the first read cannot happen
	r, err := New(w.cfg, nil, Options{Etcd: c})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	if err := r.Handle(t.Context(), testRecord("orders", 0, 0, "")); !errors.Is(err, ErrNotReady) {
		t.Errorf("Handle before the first read = %v", err)
	}
	if r.Status().Ready {
		t.Error("status ready before the first read")
	}
}

// metricValue returns the value of a collector of one counter or gauge.
func metricValue(c prometheus.Collector) float64 {
	ch := make(chan prometheus.Metric, 1)
	c.Collect(ch)
	var d dto.Metric
	if err := (<-ch).Write(&d); err != nil {
		panic(err)
	}
	if d.Counter != nil {
		return d.Counter.GetValue()
	}
	return d.Gauge.GetValue()
}

// countSeries returns how many series c has.
func countSeries(c prometheus.Collector) int {
	ch := make(chan prometheus.Metric, 100)
	c.Collect(ch)
	close(ch)
	return len(ch)
}

// blockedWorld starts a router whose rule sends every record to channel
// same (B's b, partition for partition; extra topics of B beside b, such
// as a dead-letter channel's, defined but not in force) without a
// dead-letter channel, and hands it orders/7@0, which b, of partitions
// 0-2, refuses for good: partition 7 is blocked when it returns.
func blockedWorld(t *testing.T, extra ...string) (*world, *Router, *record.Record) {
	t.Helper()
	w := newWorld(t, map[string][]string{"B": append([]string{"b"}, extra...)}, "A", "B").withEtcd()
	w.cfg.Routing = Config{
		Rules:    []Rule{{Name: "same", Channels: []string{"same"}}},
		Channels: map[string]Channel{"same": {Cluster: "B", Topic: "b", Partitioner: PartitionerManual}},
	}
	for _, topic := range extra {
		w.cfg.Routing.Channels[topic] = Channel{Cluster: "B", Topic: topic}
	}
	r := w.start(nil)
	refused := testRecord("orders", 7, 0, "")
	w.handle(refused, 10*time.Second)
	wait.For(t, 10*time.Second, "partition 7 blocked", func() error {
		if r.nblock.Load() == 0 {
			return errors.New("not blocked")
		}
		return nil
	})
	return w, r, refused
}

// TestRefusedRecord: a record its destination refuses for good (here a
// manual partition the topic does not have) holds its partition while
// there is no dead-letter channel, and goes there once there is one.
func TestRefusedRecord(t *testing.T) {
	t.Parallel()
	w, r, refused := blockedWorld(t, "dead")
	next := testRecord("orders", 7, 1, "")
	err := r.Handle(t.Context(), next)
	var we *WaitError
	if !errors.As(err, &we) || we.Reason != "blocked" || !strings.Contains(err.Error(), "configure routing.dead_letter") {
		t.Fatalf("Handle of the next record of the partition = %v", err)
	}
	// Other partitions flow.
	other := testRecord("orders", 1, 0, "")
	w.handle(other, 10*time.Second)
	wait.For(t, 10*time.Second, "partition 1 acknowledged", func() error {
		if !w.acks.has(other) {
			return errors.New("not yet")
		}
		return nil
	})
	if w.acks.has(refused) {
		t.Fatal("a refused record was acknowledged without a dead-letter channel")
	}

	rev := w.put(keys.New(fleet).Routes(), "rules: [{name: same, channels: [same]}]\ndead_letter: dead\n")
	w.waitVersion(rev)
	wait.For(t, 10*time.Second, "refused record dead-lettered and acknowledged", func() error {
		if !w.acks.has(refused) {
			return errors.New("not yet")
		}
		return nil
	})
	d := w.read("B", "dead", 1)[0]
	if string(d.Value) != "orders/7@0" || header(d, HeaderRule) != "same" || !strings.Contains(header(d, HeaderError), "invalid partition") {
		t.Errorf("dead letter %q headers %v", d.Value, d.Headers)
	}
	w.handle(next, 10*time.Second) // unblocked: and refused again, to the dead-letter channel
	wait.For(t, 10*time.Second, "next dead-lettered", func() error {
		if !w.acks.has(next) {
			return errors.New("not yet")
		}
		return nil
	})
	if got := metricValue(r.m.dead.WithLabelValues("produce")); got != 2 {
		t.Errorf("dead_lettered{produce} = %v", got)
	}
}

// TestVersionNumberedAfterADeletionSeenLate: a rebuild that read the layer
// after a key's deletion but before its event was seen numbers the
// version without the deletion's revision; when the event comes, the same
// content is put in force again under that revision (waiting for the
// deletion's revision, as kswitch routes apply does, would hang).
func TestVersionNumberedAfterADeletionSeenLate(t *testing.T) {
	t.Parallel()
	w := newWorld(t, map[string][]string{"B": {"b"}}, "A", "B").withEtcd()
	w.cfg.Routing = Config{Default: []string{"b"}, Channels: map[string]Channel{"b": {Cluster: "B", Topic: "b"}}}
	r, err := New(w.cfg, nil, Options{Etcd: w.etcd, Logger: zaptest.NewLogger(t)}) // not Run: rebuilds by hand
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close(context.Background()) })
	k := keys.New(fleet)
	put := w.put(k.Routes(), "default: [b]\nrules:\n  - name: r\n    match: topic == \"x\"\n    channels: [b]\n")
	r.rebuild(t.Context(), w.etcd)
	if n := r.Version().Number; n != put {
		t.Fatalf("version %d after the put, want %d", n, put)
	}
	del, err := w.etcd.Delete(t.Context(), k.Routes())
	if err != nil {
		t.Fatal(err)
	}
	r.rebuild(t.Context(), w.etcd) // before the delete event
	r.noteDelete(del.Header.Revision)
	r.rebuild(t.Context(), w.etcd)
	if n := r.Version().Number; n != del.Header.Revision {
		t.Errorf("version %d once the deletion was seen, want its revision %d", n, del.Header.Revision)
	}
}

package agent_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/devstack/mirror"
	"github.com/kswitch/kswitch/internal/dynconfig"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
)

// configEvent waits for the history event of dynamic configuration
// version n and returns it.
func configEvent(t *testing.T, e *devstack.Etcd, n int64) dynconfig.Event {
	t.Helper()
	cli := testenv.EtcdClientT(t, e)
	var ev dynconfig.Event
	wait.For(t, 30*time.Second, fmt.Sprintf("history event of configuration version %d", n), func() error {
		resp, err := cli.Get(context.Background(), keys.New("orders").ConfigEvent(n))
		if err != nil || len(resp.Kvs) == 0 {
			return fmt.Errorf("none yet (%v)", err)
		}
		return json.Unmarshal(resp.Kvs[0].Value, &ev)
	})
	return ev
}

// configVersion waits until every agent applies dynamic configuration
// version n.
func configVersion(t *testing.T, n int64, agents ...*agent.Agent) {
	t.Helper()
	wait.For(t, 30*time.Second, fmt.Sprintf("configuration version %d applied by every agent", n), func() error {
		for _, a := range agents {
			if v := a.Status().Config.Version; v != n {
				return fmt.Errorf("%s applies version %d", a.ID(), v)
			}
		}
		return nil
	})
}

func TestTopicSwappedWhileRecordsFlow(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 4, "orders-v2": 4, "audit": 2}})
	cli := testenv.EtcdClientT(t, e)
	fk := keys.New("orders")
	l := newLedger()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2"} {
		cfg := consumeConfig(e, k, id)
		cfg.Source.Topics = []string{"orders", "audit"}
		agents = append(agents, startConsumer(t, cfg, l.handler(id)))
	}
	waitBalanced(t, 6, agents...)
	produceTagged(t, k, "orders", "o", 0, 2000)
	produceTagged(t, k, "audit", "a", 0, 500)
	produceTagged(t, k, "orders-v2", "v", 0, 1000) // written before the switch: consumed from the oldest
	l.handledAll(t, 30*time.Second, "o", 2000)
	l.handledAll(t, 30*time.Second, "a", 500)
	if missing, _ := l.tally("v", 1); len(missing) == 0 {
		t.Fatal("orders-v2 consumed before it was configured")
	}
	before := l.generations("audit")

	// A bad version is refused by the leader and never reaches an agent.
	if _, err := cli.Put(context.Background(), fk.ConfigSource(), "topics: [orders-v2, audit]\ntopic_regex: '(['\n"); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 15*time.Second, "the refusal in every agent's status", func() error {
		for _, a := range agents {
			st := a.Status().Config
			if st.LastRefusal == nil || !strings.Contains(st.LastRefusal.Reason, "topic_regex") {
				return fmt.Errorf("%s: %+v", a.ID(), st)
			}
			if st.Version != 0 {
				return fmt.Errorf("%s applies version %d", a.ID(), st.Version)
			}
		}
		return nil
	})

	// The swap: orders is drained and released, orders-v2 starts at its
	// oldest record, audit flows on. Records keep coming to audit.
	type flow struct {
		n   int // audit records written: a0..a<n-1>
		err error
	}
	stop, flowed := make(chan struct{}), make(chan flow, 1)
	go func() {
		n := 500
		for {
			select {
			case <-stop:
				flowed <- flow{n: n}
				return
			case <-time.After(20 * time.Millisecond):
			}
			if err := produceRecords(k, "audit", "a", n, n+10); err != nil {
				flowed <- flow{n: n, err: err}
				return
			}
			n += 10
		}
	}()
	stopFlow := sync.OnceValue(func() flow { close(stop); return <-flowed })
	defer stopFlow()
	if _, err := cli.Put(context.Background(), fk.ConfigSource(), "topics: [orders-v2, audit]\n"); err != nil {
		t.Fatal(err)
	}
	configVersion(t, 1, agents...)
	ev := configEvent(t, e, 1)
	if len(ev.Missing) != 0 || len(ev.AgentsMs) != 2 || ev.Changed[0] != "source" {
		t.Errorf("history event %+v; want both agents acknowledging a source change", ev)
	}
	waitBalanced(t, 6, agents...)
	l.handledAll(t, 30*time.Second, "v", 1000)
	// Written after every agent applied the version: orders is no
	// longer consumed, orders-v2 is.
	produceTagged(t, k, "orders", "o", 2000, 2100)
	produceTagged(t, k, "orders-v2", "v", 1000, 1500)
	l.handledAll(t, 30*time.Second, "v", 1500)
	f := stopFlow()
	if f.err != nil {
		t.Fatalf("producing to audit: %v", f.err)
	}
	audits := f.n
	l.handledAll(t, 30*time.Second, "a", audits)

	for _, c := range []struct {
		tag string
		n   int
	}{{"o", 2000}, {"v", 1500}, {"a", audits}} {
		if missing, dups := l.tally(c.tag, c.n); len(missing) > 0 || dups > 0 {
			t.Errorf("%s: %d lost (first %v), %d duplicated; want every record handled once", c.tag, len(missing), missing[:min(len(missing), 5)], dups)
		}
	}
	if missing, _ := l.tally("o", 2100); len(missing) != 100 {
		t.Errorf("%d of the orders records written after orders left the configuration were handled; want none", 100-len(missing))
	}
	// The unchanged topic never paused: each audit partition delivered
	// under the one generation it was started with.
	after := l.generations("audit")
	for p, gens := range after {
		if len(gens) != 1 || len(before[p]) != 1 || !gens[firstKey(before[p])] {
			t.Errorf("audit/%d delivered under generations %v after the swap, %v before; want the same single one (never restarted)", p, gens, before[p])
		}
	}
	l.check(t)
}

func firstKey(m map[int64]bool) int64 {
	for k := range m {
		return k
	}
	return -1
}

func TestActiveClusterMovedToNewBrokers(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	old := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 4}})
	rebuilt := testenv.StartKafkaT(t, "A-rebuilt", devstack.KafkaOptions{})
	cli := testenv.EtcdClientT(t, e)
	fk := keys.New("orders")
	l := newLedger()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2"} {
		agents = append(agents, startConsumer(t, consumeConfig(e, old, id), l.handler(id)))
	}
	waitBalanced(t, 4, agents...)
	produce(t, old, "orders", 0, 2000)

	// The rebuilt cluster holds the same records at the same offsets.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m, err := mirror.Start(ctx, mirror.Config{Source: old.Brokers(), Target: rebuilt.Brokers(), SourceName: "A", TargetName: "A-rebuilt", Topics: []string{"orders"}})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Stop()
	cctx, ccancel := context.WithTimeout(ctx, 30*time.Second)
	defer ccancel()
	if err := m.CaughtUp(cctx); err != nil {
		t.Fatal(err)
	}

	if _, err := cli.Put(ctx, fk.ConfigCluster("A"), fmt.Sprintf("brokers: [%s]\n", strings.Join(rebuilt.Brokers(), ", "))); err != nil {
		t.Fatal(err)
	}
	configVersion(t, 1, agents...)
	ev := configEvent(t, e, 1)
	if len(ev.Missing) != 0 || len(ev.Changed) != 1 || ev.Changed[0] != "clusters/A" {
		t.Errorf("history event %+v; want clusters/A acknowledged by both agents", ev)
	}
	m.Stop()
	old.Stop() // the old brokers are gone: only the new addresses serve
	produce(t, rebuilt, "orders", 2000, 3000)
	l.handledAll(t, 30*time.Second, "", 3000)
	waitConsuming(t, 10*time.Second, "A", agents...)
	if missing, dups := l.tally("", 3000); len(missing) > 0 || dups > 0 {
		t.Errorf("%d lost (first %v), %d duplicated; want every record once", len(missing), missing[:min(len(missing), 5)], dups)
	}
	for _, a := range agents {
		for _, v := range a.Status().Clusters {
			if cv, ok := v["A"]; ok && !cv.Reachable {
				t.Errorf("%s: cluster A unreachable in its probes (%s): the probes must use the new brokers", a.ID(), cv.Error)
			}
		}
	}
	l.check(t)
}

// TestNewStandbyTakesTheNextFailover: a replica C introduced in etcd as the
// standby (B becomes a sink) while the fleet consumes the primary is the
// target of the next failover; nothing mirrored to C before A failed is
// lost or handled twice. Changing the standby while the fleet consumes C
// is refused with the reason.
func TestNewStandbyTakesTheNextFailover(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	c := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	mc, err := mirror.Start(ctx, mirror.Config{Source: d.a.Brokers(), Target: c.Brokers(), SourceName: "A", TargetName: "C", Topics: []string{"orders"}})
	if err != nil {
		t.Fatal(err)
	}
	defer mc.Stop()
	l := newLedger()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		agents = append(agents, startConsumer(t, d.config(id), l.handler(id)))
	}
	waitConsuming(t, 20*time.Second, "A", agents...)
	p := startProducer(t, d.a.Brokers(), "orders", 0)
	defer p.halt()
	wait.For(t, 20*time.Second, "records flowing through A and mirrored to C", func() error {
		if n := l.count(); n < 300 || mc.Copied() < 300 {
			return fmt.Errorf("%d handled, %d mirrored to C", n, mc.Copied())
		}
		return nil
	})

	cli := testenv.EtcdClientT(t, d.etcd)
	fk := keys.New("orders")
	if _, err := cli.Txn(ctx).Then(
		clientv3.OpPut(fk.ConfigCluster("B"), fmt.Sprintf("brokers: [%s]\nrole: sink\n", strings.Join(d.b.Brokers(), ", "))),
		clientv3.OpPut(fk.ConfigCluster("C"), fmt.Sprintf("brokers: [%s]\nrole: standby\nreplication_policy: identity\n", strings.Join(c.Brokers(), ", "))),
	).Commit(); err != nil {
		t.Fatal(err)
	}
	configVersion(t, 1, agents...)
	if ev := configEvent(t, d.etcd, 1); len(ev.Missing) != 0 {
		t.Errorf("history event %+v: every agent must acknowledge", ev)
	}

	cfg := d.config("x")
	began := time.Now()
	d.a.Fail()
	waitConsuming(t, cfg.Failover.FailureWindow+2*time.Second+3*time.Second, "C", agents...)
	t.Logf("failover to the new standby C %v after A failed", time.Since(began))
	p.halt()
	onC := idsOn(t, c, "orders")
	waitAllHandled(t, l, onC, 20*time.Second)
	if dups := l.duplicates(); dups != 0 {
		t.Errorf("%d duplicates after the failover to C with fingerprint alignment", dups)
	}

	// Consuming C, the standby cannot change under the fleet.
	if _, err := cli.Put(ctx, fk.ConfigCluster("C"), fmt.Sprintf("brokers: [%s]\nrole: sink\n", strings.Join(c.Brokers(), ", "))); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 15*time.Second, "the standby change refused", func() error {
		st := agents[0].Status().Config
		if st.LastRefusal == nil || !strings.Contains(st.LastRefusal.Reason, "only while the fleet consumes the primary") {
			return fmt.Errorf("%+v", st)
		}
		return nil
	})
	l.check(t)
}

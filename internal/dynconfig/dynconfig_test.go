package dynconfig_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/dynconfig"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

func TestMain(m *testing.M) {
	wait.VerifyTestMain(m, testenv.LeakOptions()...)
}

func fileConfig(endpoints []string, a, b []string) config.Config {
	cfg := config.Default()
	cfg.Fleet = "orders"
	cfg.Agent.ID = "a1"
	cfg.Etcd.Endpoints = endpoints
	cfg.Etcd.RequestTimeout = 2 * time.Second
	cfg.Clusters = map[string]config.Cluster{
		"A": {Brokers: a, Role: config.RolePrimary},
		"B": {Brokers: b, Role: config.RoleStandby},
	}
	cfg.Source.Topics = []string{"orders"}
	cfg.Source.Group = "orders"
	if err := cfg.Validate(); err != nil {
		panic(err)
	}
	return cfg
}

func TestDecodeOverridesOnlyWhatTheLayerNames(t *testing.T) {
	file := fileConfig([]string{"127.0.0.1:2379"}, []string{"a:9092"}, []string{"b:9092"})
	file.Source.TopicRegex = "^audit-"
	b := file.Clusters["B"]
	b.ReplicationPolicy, b.OffsetSyncsOn = "identity", "target"
	file.Clusters["B"] = b
	k := keys.New(file.Fleet)
	l := dynconfig.Layer{
		Source:   []byte("topics: [orders-v2]\n"),
		Clusters: map[string][]byte{"B": []byte("brokers: [b2:9092]\n")}, // role and replication: the file's
	}
	o, err := l.Decode(k, file)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := o.Apply(file)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(cfg.Source.Topics, []string{"orders-v2"}) || cfg.Source.TopicRegex != "^audit-" || cfg.Source.InitialOffset != file.Source.InitialOffset {
		t.Errorf("source = %+v; want topics replaced, regex and initial offset from the file", cfg.Source)
	}
	if b := cfg.Clusters["B"]; !slices.Equal(b.Brokers, []string{"b2:9092"}) || b.Version != config.DefaultKafkaVersion ||
		b.Role != config.RoleStandby || b.ReplicationPolicy != "identity" || b.OffsetSyncsOn != "target" {
		t.Errorf("cluster B = %+v; want the new brokers with the cluster defaults, and the file's role and replication", b)
	}
	if !slices.Equal(cfg.Clusters["A"].Brokers, []string{"a:9092"}) || !slices.Equal(file.Clusters["B"].Brokers, []string{"b:9092"}) {
		t.Errorf("cluster A changed, or the file was modified: %+v / %+v", cfg.Clusters["A"], file.Clusters["B"])
	}
}

func TestDecodeRefusesBadLayersNamingTheKey(t *testing.T) {
	file := fileConfig([]string{"127.0.0.1:2379"}, []string{"a:9092"}, []string{"b:9092"})
	k := keys.New(file.Fleet)
	for _, tc := range []struct {
		name  string
		layer dynconfig.Layer
		want  []string // in the error: the key and the problem
	}{
		{"unknown field", dynconfig.Layer{Source: []byte("topix: [x]\n")}, []string{k.ConfigSource(), "topix"}},
		{"not a list", dynconfig.Layer{Source: []byte("topics: orders\n")}, []string{k.ConfigSource(), "expected a list"}},
		{"empty source", dynconfig.Layer{Source: []byte("  \n")}, []string{k.ConfigSource(), "delete the key"}},
		{"oversized", dynconfig.Layer{Source: []byte("topics: [" + strings.Repeat("x", state.MaxConfigValueSize) + "]")}, []string{"over the limit"}},
		{"bad cluster yaml", dynconfig.Layer{Clusters: map[string][]byte{"B": []byte("brokers: [b:1\n")}}, []string{k.ConfigCluster("B")}},
		{"unknown key", dynconfig.Layer{Unknown: []string{k.Config() + "cluster/B"}}, []string{"unknown keys", "cluster/B"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tc.layer.Decode(k, file)
			if err == nil {
				t.Fatal("accepted")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
	for _, tc := range []struct {
		name  string
		layer dynconfig.Layer
		want  string
	}{
		{"bad regex", dynconfig.Layer{Source: []byte("topic_regex: '(['\n")}, "topic_regex"},
		{"unknown role", dynconfig.Layer{Clusters: map[string][]byte{"C": []byte("brokers: [c:9092]\nrole: backup\n")}}, "role"},
		{"primary changed", dynconfig.Layer{Clusters: map[string][]byte{"B": []byte("brokers: [b:9092]\nrole: primary\n")}}, "cannot change at run time"},
		{"primary added", dynconfig.Layer{Clusters: map[string][]byte{"C": []byte("brokers: [c:9092]\nrole: primary\n")}}, "the primary is the file's"},
		{"second standby", dynconfig.Layer{Clusters: map[string][]byte{"C": []byte("brokers: [c:9092]\nrole: standby\n")}}, "replication: required with more than one standby"},
		{"replication changed", dynconfig.Layer{Clusters: map[string][]byte{"B": []byte("brokers: [b:9092]\nrole: standby\nreplication_policy: identity\n")}}, "replication_policy"},
		{"no topics", dynconfig.Layer{Source: []byte("topics: []\n")}, "topic"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o, err := tc.layer.Decode(k, file)
			if err != nil {
				t.Fatalf("decode: %v", err)
			}
			if _, err := o.Apply(file); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Apply = %v; want a validation error about %s", err, tc.want)
			}
		})
	}
}

// recorder is an Applier that keeps what it is handed.
type recorder struct {
	mu      sync.Mutex
	applied []state.ConfigVersion
	cfgs    []config.Config
	refused []error
}

func (r *recorder) Apply(v state.ConfigVersion, cfg config.Config) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.applied = append(r.applied, v)
	r.cfgs = append(r.cfgs, cfg)
}

func (r *recorder) Refuse(_ state.ConfigVersion, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.refused = append(r.refused, err)
}

func (r *recorder) last() (state.ConfigVersion, config.Config, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.applied) == 0 {
		return state.ConfigVersion{Number: -1}, config.Config{}, len(r.refused)
	}
	return r.applied[len(r.applied)-1], r.cfgs[len(r.cfgs)-1], len(r.refused)
}

// lead campaigns and returns the first term; the session ends with the test.
func lead(t *testing.T, ctx context.Context, cli *clientv3.Client, fleet, id string) (election.Term, *concurrency.Session) {
	t.Helper()
	s, err := concurrency.NewSession(cli, concurrency.WithTTL(2))
	if err != nil {
		t.Fatal(err)
	}
	c, err := election.NewCandidate(election.Config{Prefix: keys.New(fleet).Election(), ID: id})
	if err != nil {
		t.Fatal(err)
	}
	terms := make(chan election.Term, 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = c.Campaign(ctx, s, func(lctx context.Context, term election.Term) {
			terms <- term
			<-lctx.Done()
		})
	}()
	t.Cleanup(func() { s.Close(); <-done })
	select {
	case term := <-terms:
		return term, s
	case <-time.After(10 * time.Second):
		t.Fatal("not elected")
	}
	panic("unreachable")
}

func TestGateAcceptsRefusesAndAgentsFollow(t *testing.T) {
	e := testenv.StartEtcdT(t)
	cli := testenv.EtcdClientT(t, e)
	a := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{})
	b := testenv.StartKafkaT(t, "B", devstack.KafkaOptions{})
	b2 := testenv.StartKafkaT(t, "B2", devstack.KafkaOptions{})
	file := fileConfig(e.Endpoints(), a.Brokers(), b.Brokers())
	k := keys.New(file.Fleet)
	log := zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	term, _ := lead(t, ctx, cli, file.Fleet, "a1")
	var refusals sync.Map
	gate := &dynconfig.Gate{File: file, Etcd: cli, Log: log, ReachTimeout: 2 * time.Second,
		OnRefused: func(r state.ConfigRefusal) { refusals.Store(r.Revision, r) }}
	rec := &recorder{}
	var wg sync.WaitGroup
	wg.Go(func() { _ = gate.Run(ctx, term) })
	wg.Go(func() { _ = dynconfig.Follow(ctx, cli, file, time.Second, log, rec) })
	defer wg.Wait()
	defer cancel()

	wait.For(t, 5*time.Second, "the file alone in force", func() error {
		if v, _, _ := rec.last(); v.Number != 0 {
			return fmt.Errorf("last version %d", v.Number)
		}
		return nil
	})

	put := func(key, val string) {
		t.Helper()
		if _, err := cli.Put(ctx, key, val); err != nil {
			t.Fatal(err)
		}
	}
	state := func() state.ConfigState {
		s, err := state.ReadConfigState(ctx, cli, k)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}

	// A source change is accepted and reaches the agent.
	put(k.ConfigSource(), "topics: [orders, orders-v2]\n")
	wait.For(t, 10*time.Second, "version 1 applied", func() error {
		v, cfg, _ := rec.last()
		if v.Number != 1 || !slices.Equal(cfg.Source.Topics, []string{"orders", "orders-v2"}) {
			return fmt.Errorf("version %d, topics %v", v.Number, cfg.Source.Topics)
		}
		return nil
	})
	if v := state().Version; !slices.Equal(v.Changed, []string{"source"}) || v.Leader != "a1" {
		t.Errorf("version 1 = %+v; want changed [source] by a1", v)
	}
	// The history event waits for the agents' acknowledgements.
	time.Sleep(300 * time.Millisecond) // the ack comes later than the acceptance, measurably
	put(k.ConfigAck("a1"), dynconfig.AckValue(1))
	wait.For(t, 10*time.Second, "history event of version 1", func() error {
		resp, err := cli.Get(ctx, k.ConfigEvent(1))
		if err != nil || len(resp.Kvs) == 0 {
			return fmt.Errorf("no event (%v)", err)
		}
		var ev dynconfig.Event
		if err := json.Unmarshal(resp.Kvs[0].Value, &ev); err != nil {
			return err
		}
		if ev.Version != 1 || ev.Kind != "config" || len(ev.Missing) != 0 || ev.AgentsMs["a1"] < 300 || ev.ApplyMs != ev.AgentsMs["a1"] {
			return fmt.Errorf("event %+v; want version 1 acknowledged by a1 after >= 300 ms", ev)
		}
		return nil
	})

	// Refused, each with its reason; version 1 stays in force.
	for _, bad := range []struct{ key, val, reason string }{
		{k.ConfigSource(), "topic_regex: '(['\n", "topic_regex"},
		{k.ConfigCluster("C"), "brokers: [c:9092]\nrole: backup\n", "role"},
		{k.ConfigCluster("B"), "brokers: [127.0.0.1:1]\nrole: standby\n", "did not answer"},
	} {
		put(bad.key, bad.val)
		wait.For(t, 10*time.Second, "refusal of "+bad.key, func() error {
			s := state()
			if s.Refusal == nil || !strings.Contains(s.Refusal.Reason, bad.reason) {
				return fmt.Errorf("state %+v", s)
			}
			if s.Refusal.InForce != 1 || s.Version.Number != 1 {
				return fmt.Errorf("in force %d, version %d; want 1", s.Refusal.InForce, s.Version.Number)
			}
			return nil
		})
		// The bad value is replaced in one write: a delete followed by a put
		// would let the gate accept the layer's absence as a version of its own.
		if bad.key == k.ConfigSource() {
			put(k.ConfigSource(), "topics: [orders, orders-v2]\n")
		} else if _, err := cli.Delete(ctx, bad.key); err != nil {
			t.Fatal(err)
		}
		wait.For(t, 10*time.Second, "refusal cleared", func() error {
			if s := state(); s.Refusal != nil || s.Version.Number != 1 {
				return fmt.Errorf("state %+v", s)
			}
			return nil
		})
	}
	if v, _, refused := rec.last(); v.Number != 1 || refused != 0 {
		t.Fatalf("agent at version %d with %d refusals; a refused layer must never reach an agent", v.Number, refused)
	}
	n := 0
	refusals.Range(func(any, any) bool { n++; return true })
	if n != 3 {
		t.Errorf("OnRefused called for %d layers, want 3", n)
	}

	// A cluster moved to new brokers that answer: accepted.
	put(k.ConfigCluster("B"), fmt.Sprintf("brokers: [%s]\nrole: standby\n", strings.Join(b2.Brokers(), ",")))
	wait.For(t, 10*time.Second, "version 2 applied", func() error {
		v, cfg, _ := rec.last()
		if v.Number != 2 || !slices.Equal(cfg.Clusters["B"].Brokers, b2.Brokers()) {
			return fmt.Errorf("version %d, B %v", v.Number, cfg.Clusters["B"].Brokers)
		}
		if !slices.Equal(v.Changed, []string{"clusters/B"}) {
			return fmt.Errorf("changed %v", v.Changed)
		}
		return nil
	})

	// A deposed leader's gate cannot publish.
	stale := dynconfig.Gate{File: file, Etcd: cli, Log: log}
	if _, err := cli.Revoke(ctx, term.Lease); err != nil {
		t.Fatal(err)
	}
	put(k.ConfigSource(), "topics: [orders-v3]\n")
	sctx, scancel := context.WithTimeout(ctx, 5*time.Second)
	defer scancel()
	if err := stale.Run(sctx, term); !errors.Is(err, election.ErrNotLeader) {
		t.Fatalf("stale gate returned %v, want ErrNotLeader", err)
	}
	if v := state().Version; v.Number != 2 {
		t.Fatalf("version %d after a deposed leader's gate ran; want 2", v.Number)
	}
}

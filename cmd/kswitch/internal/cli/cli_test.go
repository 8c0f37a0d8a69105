package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/fleetview"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/record"
)

func TestMain(m *testing.M) {
	wait.VerifyTestMain(m, testenv.LeakOptions()...)
}

func run(t *testing.T, environ []string, args ...string) (int, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := Execute(context.Background(), args, &out, &errOut, environ)
	return code, out.String(), errOut.String()
}

const goodConfig = `fleet: orders
agent: {id: agent-1, http: "127.0.0.1:0", gossip: "127.0.0.1:0"}
etcd: {endpoints: [127.0.0.1:1], session_ttl: 5s}
clusters:
  A: {brokers: [127.0.0.1:9092], role: primary}
  B: {brokers: [127.0.0.1:9093], role: standby}
source: {topics: [orders], group: orders}
`

func TestAgentRefusesInvalidConfigNamingTheField(t *testing.T) {
	cases := []struct {
		name, old, new string
		args           []string
		want           []string
	}{
		{name: "unknown field", old: "session_ttl: 5s", new: "session_ttl: 5s, sesion_ttl: 5s", want: []string{"sesion_ttl", "etcd"}},
		{name: "missing brokers", old: "{brokers: [127.0.0.1:9093], role: standby}", new: "{role: standby}", want: []string{"clusters.B.brokers"}},
		{name: "bad duration", old: "session_ttl: 5s", new: "session_ttl: 5 seconds", want: []string{"etcd.session_ttl", "5 seconds"}},
		{name: "duplicate role", old: "role: standby", new: "role: primary", want: []string{"clusters.", ".role", "primary"}},
		{name: "bad flag", args: []string{"--etcd.session_ttl", "soon"}, want: []string{"--etcd.session_ttl", "soon"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			file := filepath.Join(t.TempDir(), "kswitch.yaml")
			if err := os.WriteFile(file, []byte(strings.Replace(goodConfig, c.old, c.new, 1)), 0o600); err != nil {
				t.Fatal(err)
			}
			args := append([]string{"agent", "--config", file}, c.args...)
			code, _, stderr := run(t, nil, args...)
			if code == 0 {
				t.Fatal("agent started with an invalid configuration")
			}
			for _, w := range c.want {
				if !strings.Contains(stderr, w) {
					t.Errorf("error does not mention %q:\n%s", w, stderr)
				}
			}
		})
	}
}

func TestStatusShowsLeaderAndAgents(t *testing.T) {
	e := testenv.StartEtcdT(t)
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2"} {
		cfg, err := config.Parse([]byte(goodConfig), "test.yaml")
		if err != nil {
			t.Fatal(err)
		}
		cfg.Agent.ID = id
		cfg.Etcd.Endpoints = e.Endpoints()
		a, err := agent.New(cfg, agent.Options{})
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		agents = append(agents, a)
		t.Cleanup(func() { _ = a.Stop(context.Background()) })
	}
	leader := func() string {
		for _, a := range agents {
			if a.Leading() {
				return a.ID()
			}
		}
		return ""
	}
	wait.For(t, 10*time.Second, "a leader", func() error {
		if leader() == "" {
			return fmt.Errorf("no leader yet")
		}
		return nil
	})

	// Endpoints and fleet from the environment, as an operator's shell has them.
	env := []string{"KSWITCH_ETCD_ENDPOINTS=" + strings.Join(e.Endpoints(), ","), "KSWITCH_FLEET=orders"}
	var v fleetview.FleetView
	wait.For(t, 5*time.Second, "status -o json lists both agents", func() error {
		code, out, stderr := run(t, env, "status", "-o", "json")
		if code != 0 {
			return fmt.Errorf("exit %d: %s", code, stderr)
		}
		if err := json.Unmarshal([]byte(out), &v); err != nil {
			return err
		}
		if v.Leader != leader() || len(v.Agents) != 2 || v.Token == 0 {
			return fmt.Errorf("status: %+v", v)
		}
		return nil
	})
	if v.Agents[0].HTTP != agents[0].HTTPAddr() || v.Agents[1].Gossip != agents[1].GossipAddr() {
		t.Errorf("addresses in status do not match the agents: %+v", v.Agents)
	}

	code, out, stderr := run(t, nil, "status", "--etcd", e.Endpoints()[0], "--fleet", "orders")
	if code != 0 {
		t.Fatalf("status: exit %d: %s", code, stderr)
	}
	if len(v.Ready) != 2 || !v.Ready["agent-1"].Answered || !v.Ready["agent-2"].Answered {
		t.Errorf("status -o json: the agents' own readiness is not there: %+v", v.Ready)
	}
	for _, want := range []string{"leader:  " + leader() + " (fencing token", "agent-1", "agent-2", agents[0].HTTPAddr(), "AGE", "READY"} {
		if !strings.Contains(out, want) {
			t.Errorf("status table has no %q:\n%s", want, out)
		}
	}

	if code, _, stderr := run(t, nil, "status", "--etcd", e.Endpoints()[0]); code == 0 || !strings.Contains(stderr, "--fleet") {
		t.Errorf("status without a fleet: exit %d, %q", code, stderr)
	}
}

func TestStatusReportsUnreachableEtcd(t *testing.T) {
	code, _, stderr := run(t, nil, "status", "--etcd", "127.0.0.1:1", "--fleet", "orders", "--timeout", "500ms")
	if code == 0 || !strings.Contains(stderr, "127.0.0.1:1") {
		t.Fatalf("exit %d, stderr %q: want a failure naming the endpoint", code, stderr)
	}
}

func TestEveryCommandHelpHasAnExample(t *testing.T) {
	for _, c := range newRoot(nil).Commands() {
		if c.Name() == "help" || c.Name() == "completion" {
			continue
		}
		code, out, _ := run(t, nil, c.Name(), "--help")
		if code != 0 || !strings.Contains(out, "Examples:") || !strings.Contains(out, "Flags:") {
			t.Errorf("%s --help lacks examples or flags:\n%s", c.Name(), out)
		}
	}
}

// TestDemoFlagsReachTheDemo: the flags are the demo's options, and a
// refusal is a non-zero exit naming the flag. The story itself is tested
// by internal/demo.
func TestDemoFlagsReachTheDemo(t *testing.T) {
	code, out, stderr := run(t, nil, "demo", "--agents", "1", "--duration", "2s", "--rate", "100")
	if code == 0 || !strings.Contains(stderr, "--agents 1") {
		t.Fatalf("demo --agents 1: exit %d, want a refusal naming --agents\n%s\n%s", code, out, stderr)
	}
	if code, _, stderr := run(t, nil, "demo", "--duration", "soon"); code == 0 || !strings.Contains(stderr, "--duration") {
		t.Fatalf("demo --duration soon: exit %d, want a refusal naming --duration\n%s", code, stderr)
	}
}

func TestStatusShowsAssignmentOffsetsAndLag(t *testing.T) {
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 2}})
	cfg, err := config.Parse([]byte(goodConfig), "test.yaml")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Etcd.Endpoints = e.Endpoints()
	cfg.Clusters = map[string]config.Cluster{"A": {Brokers: k.Brokers(), Role: config.RolePrimary}}
	cfg.Source.CommitInterval = 100 * time.Millisecond
	// The handler takes records but acknowledges only the first 3 of each
	// partition, so the committed offsets stop there and lag shows.
	h := record.HandlerFunc(func(_ context.Context, r *record.Record) error {
		if r.Offset < 3 {
			r.Ack()
		}
		return nil
	})
	a, err := agent.New(cfg, agent.Options{Handler: h, DrainTimeout: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Stop(context.Background()) })
	wait.For(t, 10*time.Second, "partitions assigned", func() error {
		if n := len(a.Owned()); n != 2 {
			return fmt.Errorf("owns %d", n)
		}
		return nil
	})
	produceN(t, k, "orders", 10)

	env := []string{"KSWITCH_ETCD_ENDPOINTS=" + strings.Join(e.Endpoints(), ","), "KSWITCH_FLEET=orders",
		"KSWITCH_CLUSTERS_A_BROKERS=" + strings.Join(k.Brokers(), ",")}
	var v fleetview.FleetView
	wait.For(t, 10*time.Second, "offsets committed and lag shown", func() error {
		code, out, stderr := run(t, env, "status", "-o", "json")
		if code != 0 {
			return fmt.Errorf("exit %d: %s", code, stderr)
		}
		if err := json.Unmarshal([]byte(out), &v); err != nil {
			return err
		}
		if v.Assignment == nil || len(v.Partitions) != 2 {
			return fmt.Errorf("status: %s", out)
		}
		for _, p := range v.Partitions {
			if p.Owner != "agent-1" || p.Committed != 3 || p.End != 5 || p.Lag != 2 {
				return fmt.Errorf("partition %+v, want owner agent-1, committed 3, end 5, lag 2", p)
			}
		}
		return nil
	})
	code, out, stderr := run(t, env, "status")
	if code != 0 || !strings.Contains(out, "generation") || !strings.Contains(out, "orders/1") {
		t.Fatalf("status table: exit %d\n%s\n%s", code, out, stderr)
	}
	code, out, stderr = run(t, env, "offsets", "show")
	if code != 0 {
		t.Fatalf("offsets show: exit %d: %s", code, stderr)
	}
	for _, want := range []string{"cluster A: 2 partitions", "orders", "agent-1"} {
		if !strings.Contains(out, want) {
			t.Errorf("offsets show lacks %q:\n%s", want, out)
		}
	}
}

// produceN writes n records to topic, spread evenly over its partitions.
func produceN(t *testing.T, k *devstack.Kafka, topic string, n int) {
	t.Helper()
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	sc.Producer.Return.Successes = true
	sc.Producer.Partitioner = sarama.NewRoundRobinPartitioner
	p, err := sarama.NewSyncProducer(k.Brokers(), sc)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for i := range n {
		if _, _, err := p.SendMessage(&sarama.ProducerMessage{Topic: topic, Value: sarama.StringEncoder(fmt.Sprint(i))}); err != nil {
			t.Fatal(err)
		}
	}
}

// TestAgentMemoryLimit: agent.memory_limit_mib becomes the process's soft
// memory limit, unless GOMEMLIMIT is set (the runtime applied it) or it
// is 0.
func TestAgentMemoryLimit(t *testing.T) {
	before := debug.SetMemoryLimit(-1)
	t.Cleanup(func() { debug.SetMemoryLimit(before) })
	for _, tc := range []struct {
		name    string
		mib     int
		environ []string
		want    int64
	}{
		{"the configured limit", 96, nil, 96 << 20},
		{"GOMEMLIMIT wins", 96, []string{"GOMEMLIMIT=1GiB"}, before},
		{"0: no limit set", 0, nil, before},
	} {
		t.Run(tc.name, func(t *testing.T) {
			debug.SetMemoryLimit(before)
			applyMemoryLimit(tc.mib, tc.environ, zap.NewNop())
			if got := debug.SetMemoryLimit(-1); got != tc.want {
				t.Errorf("memory limit %d, want %d", got, tc.want)
			}
		})
	}
}

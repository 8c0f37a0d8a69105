package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/internal/config"
	"github.com/kswitch/kswitch/internal/testenv"
	"github.com/kswitch/kswitch/internal/wait"
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
	var v agent.FleetView
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
	for _, want := range []string{"leader:  " + leader() + " (fencing token", "agent-1", "agent-2", agents[0].HTTPAddr(), "AGE"} {
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

func TestDemoRunsItsStory(t *testing.T) {
	code, out, stderr := run(t, nil, "demo", "--agents", "3")
	if code != 0 {
		t.Fatalf("demo: exit %d\n%s\n%s", code, out, stderr)
	}
	for _, want := range []string{"leads (fencing token", "crash:", "new leader after a crash", "new leader after a clean stop"} {
		if !strings.Contains(out, want) {
			t.Errorf("demo output lacks %q:\n%s", want, out)
		}
	}
}

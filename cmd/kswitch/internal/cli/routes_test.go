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

	"github.com/IBM/sarama"
	"github.com/spf13/cobra"

	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
)

// runRoutes runs args like run, on the root command with routes added
// when newRoot does not register it (yet).
func runRoutes(t *testing.T, environ []string, args ...string) (int, string, string) {
	t.Helper()
	root := newRoot(environ)
	if !slicesContainsCmd(root, "routes") {
		root.AddCommand(newRoutesCmd(&globals{environ: environ}))
	}
	var out, errOut bytes.Buffer
	root.SetArgs(args)
	root.SetOut(&out)
	root.SetErr(&errOut)
	code := 0
	if err := root.ExecuteContext(context.Background()); err != nil {
		fmt.Fprintln(&errOut, "kswitch:", err)
		code = 1
	}
	return code, out.String(), errOut.String()
}

func slicesContainsCmd(root *cobra.Command, name string) bool {
	for _, c := range root.Commands() {
		if c.Name() == name {
			return true
		}
	}
	return false
}

func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestRoutesCheckExample(t *testing.T) {
	code, out, stderr := runRoutes(t, nil, "routes", "check", "-f", "../../../../examples/routes.yaml",
		"--config", "../../../../examples/kswitch.yaml", "--sample", "../../../../examples/records.jsonl")
	if code != 0 {
		t.Fatalf("exit %d: %s\n%s", code, stderr, out)
	}
	for _, want := range []string{
		"../../../../examples/routes.yaml is valid",
		"mode first; 3 rule(s): no-tests, big-orders, orders",
		"default route: everything; dead-letter: dead-letters",
		"channel audit → cluster B topic orders-audit (key json?.customer ?? key, partitioner hash, compression lz4, acks all)",
		"line 1 orders/0@1: → audit, orders-copy (rules big-orders)",
		"line 2 orders/1@2: → orders-copy (rules orders)",
		"line 3 orders/1@3: → orders-copy (rules orders)",
		"line 4 orders/2@4: dropped by rule no-tests",
		"line 5 payments/0@5: → everything (the default route)",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

func TestRoutesHelpHasExamples(t *testing.T) {
	for _, args := range [][]string{{"routes"}, {"routes", "check"}, {"routes", "apply"}, {"routes", "show"}} {
		code, out, _ := runRoutes(t, nil, append(args, "--help")...)
		if code != 0 || !strings.Contains(out, "Examples:") {
			t.Errorf("%v --help lacks examples:\n%s", args, out)
		}
	}
}

func TestRoutesCheckRefuses(t *testing.T) {
	cfg := writeFile(t, "kswitch.yaml", goodConfig)
	for _, tc := range []struct {
		name, rules string
		sample      string
		want        []string
	}{
		{"bad expression and unknown cluster", "rules: [{name: r, match: 'topic ==', channels: [c]}]\nchannels: {c: {cluster: Z, topic: t}}\n", "",
			[]string{"is invalid; agents would refuse it", "rules[0].match: unexpected token EOF", `channels.c.cluster: "Z" is not a configured cluster (configured: A, B)`}},
		{"typo", "rules: [{name: r, chanels: [c]}]\n", "", []string{`line 1: unknown field "chanels" in rules[0]`}},
		{"sample fails without dead letter", "rules: [{name: r, match: 'json.a > 1', channels: [c]}]\nchannels: {c: {cluster: B, topic: t}}\n",
			`{"topic": "orders", "value": "x"}`,
			[]string{"FAILS, and there is no dead-letter channel", "routing: rule r:", "1 sample record(s) fail to evaluate"}},
		{"sample with an unknown field", "default: [c]\nchannels: {c: {cluster: B, topic: t}}\n", `{"topik": "orders"}`,
			[]string{`line 1: json: unknown field "topik"`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := []string{"routes", "check", "-f", writeFile(t, "rules.yaml", tc.rules), "--config", cfg}
			if tc.sample != "" {
				args = append(args, "--sample", writeFile(t, "s.jsonl", tc.sample))
			}
			code, out, stderr := runRoutes(t, nil, args...)
			if code == 0 {
				t.Fatalf("exit 0:\n%s", out)
			}
			for _, w := range tc.want {
				if !strings.Contains(out+stderr, w) {
					t.Errorf("output lacks %q:\n%s\n%s", w, out, stderr)
				}
			}
		})
	}
}

func TestRoutesApplyAndShow(t *testing.T) {
	e := testenv.StartEtcdT(t)
	c := testenv.EtcdClientT(t, e)
	k := keys.New("orders")
	cfg := writeFile(t, "kswitch.yaml", strings.Replace(goodConfig, "127.0.0.1:1", e.Endpoints()[0], 1))

	code, out, stderr := runRoutes(t, nil, "routes", "show", "--config", cfg)
	if code != 0 || !strings.Contains(out, "/kswitch/orders/routes: absent") || !strings.Contains(out, "valid") {
		t.Fatalf("show on an empty etcd: exit %d\n%s\n%s", code, out, stderr)
	}

	rules := writeFile(t, "rules.yaml", `rules:
  - name: big
    match: '(json?.amount ?? 0) > 10'
    channels: [audit]
default: [copy]
channels:
  audit: {cluster: B, topic: audit, compression: lz4}
  copy: {cluster: A, topic: copy}
`)
	code, out, stderr = runRoutes(t, nil, "routes", "apply", "-f", rules, "--config", cfg)
	if code != 0 {
		t.Fatalf("apply: exit %d\n%s\n%s", code, out, stderr)
	}
	for _, want := range []string{"put /kswitch/orders/routes", "put /kswitch/orders/channels/audit", "put /kswitch/orders/channels/copy", "written"} {
		if !strings.Contains(out, want) {
			t.Errorf("apply output lacks %q:\n%s", want, out)
		}
	}
	resp, err := c.Get(t.Context(), k.Channel("audit"))
	if err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "cluster: B\ntopic: audit\ncompression: lz4\n" {
		t.Fatalf("channels/audit = %v, %v", resp.Kvs, err)
	}

	// A second file with only a channel leaves the routes alone; a file
	// that would break the version in etcd is refused, nothing written.
	code, _, stderr = runRoutes(t, nil, "routes", "apply", "-f", writeFile(t, "c.yaml", "channels: {extra: {cluster: A, topic: extra}}\n"), "--config", cfg)
	if code != 0 {
		t.Fatalf("apply channel: %s", stderr)
	}
	before, _ := c.Get(t.Context(), k.Routes())
	code, _, stderr = runRoutes(t, nil, "routes", "apply", "-f", writeFile(t, "bad.yaml", "rules: [{name: r, channels: [nowhere]}]\n"), "--config", cfg)
	if code == 0 || !strings.Contains(stderr, `rules[0].channels[0]: channel "nowhere" is not defined`) || !strings.Contains(stderr, "nothing written") {
		t.Errorf("bad apply: exit %d, %s", code, stderr)
	}
	if after, _ := c.Get(t.Context(), k.Routes()); after.Kvs[0].ModRevision != before.Kvs[0].ModRevision {
		t.Error("a refused apply wrote the routes")
	}
	if code, _, stderr := runRoutes(t, nil, "routes", "apply", "-f", rules, "--etcd", e.Endpoints()[0], "--fleet", "orders"); code == 0 || !strings.Contains(stderr, "pass --config") {
		t.Errorf("apply without clusters: exit %d, %s", code, stderr)
	}

	code, out, _ = runRoutes(t, nil, "routes", "show", "--config", cfg, "-o", "json")
	var s routesShow
	if err := json.Unmarshal([]byte(out), &s); code != 0 || err != nil {
		t.Fatalf("show -o json: exit %d, %v\n%s", code, err, out)
	}
	if !s.Valid || !s.ClustersChecked || s.Routes == nil || len(s.Channels) != 3 || strings.Join(s.Rules, ",") != "big" || s.Version == 0 {
		t.Errorf("show = %+v", s)
	}

	// What an operator writes with etcdctl is validated the same way.
	if _, err := c.Put(t.Context(), k.Routes(), "rules: [{name: r, match: 'nope(', channels: [audit]}]\n"); err != nil {
		t.Fatal(err)
	}
	code, out, _ = runRoutes(t, nil, "routes", "show", "--config", cfg)
	if code != 0 || !strings.Contains(out, "INVALID: agents refuse this version") || !strings.Contains(out, "rules[0].match:") {
		t.Errorf("show of an invalid version: exit %d\n%s", code, out)
	}
}

// TestAgentRoutes runs 'kswitch agent' with a routing section: the
// records it consumes from A arrive on B's topic.
func TestAgentRoutes(t *testing.T) {
	e := testenv.StartEtcdT(t)
	a := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 2}})
	b := testenv.StartKafkaT(t, "B", devstack.KafkaOptions{Topics: map[string]int32{"copy": 1}})
	cfg := fmt.Sprintf(`fleet: orders
agent: {id: agent-1, http: "127.0.0.1:0", gossip: "127.0.0.1:0"}
etcd: {endpoints: [%s]}
clusters:
  A: {brokers: [%s], role: primary}
  B: {brokers: [%s], role: sink}
source: {topics: [orders], group: orders, commit_interval: 100ms}
routing:
  rules: [{name: all, channels: [copy]}]
  channels: {copy: {cluster: B, topic: copy}}
`, e.Endpoints()[0], a.Brokers()[0], b.Brokers()[0])
	file := writeFile(t, "kswitch.yaml", cfg)
	produceN(t, a, "orders", 20)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	var stderr bytes.Buffer
	go func() {
		root := newRoot(nil)
		root.SetArgs([]string{"agent", "--config", file, "--stop-timeout", "10s"})
		root.SetOut(&bytes.Buffer{})
		root.SetErr(&stderr)
		if err := root.ExecuteContext(ctx); err != nil {
			fmt.Fprintln(&stderr, err)
			done <- 1
			return
		}
		done <- 0
	}()
	defer func() {
		cancel()
		select {
		case code := <-done:
			if code != 0 {
				t.Errorf("agent: exit %d: %s", code, stderr.String())
			}
		case <-time.After(30 * time.Second):
			t.Error("agent did not stop within 30s")
		}
	}()

	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	cl, err := sarama.NewClient(b.Brokers(), sc)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	wait.For(t, 30*time.Second, "20 records routed to B", func() error {
		off, err := cl.GetOffset("copy", 0, sarama.OffsetNewest)
		if err != nil {
			return err
		}
		if off < 20 {
			return fmt.Errorf("%d records on B", off)
		}
		return nil
	})
}

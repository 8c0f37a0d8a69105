package cli

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
)

func TestConfigApplyWaitsForTheLeadersVerdict(t *testing.T) {
	e := testenv.StartEtcdT(t)
	a := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 2, "orders-v2": 2}})
	moved := testenv.StartKafkaT(t, "A2", devstack.KafkaOptions{})
	dir := t.TempDir()
	cfgFile := filepath.Join(dir, "kswitch.yaml")
	body := fmt.Sprintf(`fleet: orders
agent: {id: agent-1, http: "127.0.0.1:0", gossip: "127.0.0.1:0"}
etcd: {endpoints: [%s], session_ttl: 5s}
clusters:
  A: {brokers: [%s], role: primary}
source: {topics: [orders], group: orders}
`, strings.Join(e.Endpoints(), ", "), strings.Join(a.Brokers(), ", "))
	if err := os.WriteFile(cfgFile, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Load(cfgFile)
	if err != nil {
		t.Fatal(err)
	}
	ag, err := agent.New(cfg, agent.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := ag.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ag.Stop(context.Background()) })
	wait.For(t, 10*time.Second, "a leader", func() error {
		if !ag.Leading() {
			return fmt.Errorf("not leading yet")
		}
		return nil
	})

	// Refused here, before anything is written: the merged configuration
	// is checked with --config.
	bad := writeFile(t, "bad.yaml", "source:\n  topic_regex: '(['\n")
	code, _, stderr := run(t, nil, "config", "apply", "-f", bad, "--config", cfgFile)
	if code == 0 || !strings.Contains(stderr, "topic_regex") || !strings.Contains(stderr, "nothing written") {
		t.Fatalf("bad file: exit %d, stderr %q; want a refusal naming topic_regex and saying nothing was written", code, stderr)
	}
	for _, f := range []struct{ body, want string }{
		{"routing:\n  mode: all\n", "cannot change at run time"},
		{"clusters:\n  A:\n    brokers: [127.0.0.1:1]\n", "do not answer from here"},
		{"clusters:\n  B:\n    brokers: [b:1]\n    role: primary\n", "the primary is the file's"},
	} {
		code, _, stderr := run(t, nil, "config", "apply", "-f", writeFile(t, "f.yaml", f.body), "--config", cfgFile)
		if code == 0 || !strings.Contains(stderr, f.want) {
			t.Errorf("%q: exit %d, stderr %q; want %q", f.body, code, stderr, f.want)
		}
	}
	cli := testenv.EtcdClientT(t, e)
	if resp, err := cli.Get(context.Background(), keys.New("orders").Config(), clientv3.WithPrefix()); err != nil || len(resp.Kvs) != 0 {
		t.Fatalf("config/ holds %d keys after refused applies (%v); want none", len(resp.Kvs), err)
	}

	// Accepted: the command waits for the version and says so.
	good := writeFile(t, "good.yaml", fmt.Sprintf("source:\n  topics: [orders-v2]\nclusters:\n  A:\n    brokers: [%s]\n", strings.Join(moved.Brokers(), ", ")))
	code, out, stderr := run(t, nil, "config", "apply", "-f", good, "--config", cfgFile)
	if code != 0 || !strings.Contains(out, "accepted: version 1") || !strings.Contains(out, "clusters/A") || !strings.Contains(out, "source") {
		t.Fatalf("good file: exit %d, out %q, stderr %q; want version 1 accepted with source and clusters/A", code, out, stderr)
	}
	code, out, _ = run(t, nil, "config", "show", "--config", cfgFile)
	if code != 0 || !strings.Contains(out, "version in force: 1") || !strings.Contains(out, "topics [orders-v2]") ||
		!strings.Contains(out, strings.Join(moved.Brokers(), ",")) {
		t.Fatalf("show: exit %d:\n%s", code, out)
	}

	// Written straight to etcd and refused by the leader: show and status
	// say so, and the version stays.
	if _, err := cli.Put(context.Background(), keys.New("orders").ConfigSource(), "topics: orders\n"); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 10*time.Second, "the refusal in config show and status", func() error {
		_, show, _ := run(t, nil, "config", "show", "--config", cfgFile)
		_, status, _ := run(t, nil, "status", "--config", cfgFile)
		if !strings.Contains(show, "REFUSED") || !strings.Contains(show, "expected a list") || !strings.Contains(show, "version 1 stays") {
			return fmt.Errorf("show:\n%s", show)
		}
		if !strings.Contains(status, "config:  version 1") || !strings.Contains(status, "was refused") {
			return fmt.Errorf("status:\n%s", status)
		}
		return nil
	})
	if v := ag.Status().Config.Version; v != 1 {
		t.Fatalf("agent applies version %d; want 1 kept", v)
	}
}

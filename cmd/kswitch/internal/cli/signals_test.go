package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"

	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/signals"
)

// runSignals runs args like run, on the root command with pause, resume
// and signals added when newRoot does not register them (yet).
func runSignals(t *testing.T, environ []string, args ...string) (int, string, string) {
	t.Helper()
	root := newRoot(environ)
	have := map[string]bool{}
	for _, c := range root.Commands() {
		have[c.Name()] = true
	}
	g := &globals{environ: environ}
	for name, mk := range map[string]func(*globals) *cobra.Command{"pause": newPauseCmd, "resume": newResumeCmd, "signals": newSignalsCmd} {
		if !have[name] {
			root.AddCommand(mk(g))
		}
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

func TestPauseResumeAndSignals(t *testing.T) {
	e := testenv.StartEtcdT(t)
	c := testenv.EtcdClientT(t, e)
	k := keys.New("orders")
	env := []string{"KSWITCH_ETCD_ENDPOINTS=" + strings.Join(e.Endpoints(), ","), "KSWITCH_FLEET=orders", "USER=tester"}
	get := func(key string) string {
		t.Helper()
		resp, err := c.Get(t.Context(), key)
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Kvs) == 0 {
			return ""
		}
		return string(resp.Kvs[0].Value)
	}
	before := time.Now().UTC().Add(-time.Second)

	code, out, stderr := runSignals(t, env, "pause", "--reason", "downstream upgrade")
	if code != 0 {
		t.Fatalf("pause: exit %d: %s", code, stderr)
	}
	v := get(k.FleetSignal())
	ts, rest, ok := strings.Cut(strings.TrimPrefix(v, "pause # "), " by tester@")
	if !strings.HasPrefix(v, "pause # ") || !ok || !strings.HasSuffix(rest, ": downstream upgrade") {
		t.Fatalf("value %q, want 'pause # <time> by tester@<host>: downstream upgrade'", v)
	}
	if when, err := time.Parse(time.RFC3339, ts); err != nil || when.Before(before.Truncate(time.Second)) || when.Location() != time.UTC {
		t.Errorf("time in note %q: %v", ts, err)
	}
	for _, want := range []string{k.FleetSignal(), v, "fleet paused"} {
		if !strings.Contains(out, want) {
			t.Errorf("pause output lacks %q:\n%s", want, out)
		}
	}

	if code, _, stderr := runSignals(t, env, "pause", "--topic", "payments"); code != 0 {
		t.Fatalf("pause --topic: %s", stderr)
	}
	if v := get(k.TopicSignal("payments")); !strings.HasPrefix(v, "pause # ") || !strings.Contains(v, " by tester@") || strings.Contains(v, ": ") {
		t.Errorf("topic value %q", v)
	}
	if code, _, stderr := runSignals(t, nil, "pause", "--etcd", e.Endpoints()[0], "--fleet", "orders", "--agent", "agent-2"); code != 0 {
		t.Fatalf("pause --agent: %s", stderr)
	}
	if code, _, stderr := runSignals(t, env, "pause", "--channel", "audit", "--reason", "audit cluster down"); code != 0 {
		t.Fatalf("pause --channel: %s", stderr)
	}
	s, err := signals.Read(t.Context(), c, k)
	if err != nil {
		t.Fatal(err)
	}
	if p, by := s.Paused("payments", "agent-2"); !p || by.Kind != signals.Fleet {
		t.Errorf("Paused = %v, %v", p, by)
	}
	if !s.ChannelPaused("audit") || len(s.Signals()) != 4 {
		t.Errorf("signals: %+v", s.Signals())
	}

	// Resume writes start (not a delete) and names what is still paused.
	code, out, stderr = runSignals(t, env, "resume", "--reason", "upgrade done")
	if code != 0 {
		t.Fatalf("resume: %s", stderr)
	}
	if v := get(k.FleetSignal()); !strings.HasPrefix(v, "start # ") || !strings.HasSuffix(v, ": upgrade done") {
		t.Errorf("after resume: %q", v)
	}
	for _, want := range []string{"fleet started", "still paused: topic/payments, agent/agent-2, channel/audit"} {
		if !strings.Contains(out, want) {
			t.Errorf("resume output lacks %q:\n%s", want, out)
		}
	}
	if code, _, stderr := runSignals(t, env, "resume", "--topic", "payments"); code != 0 {
		t.Fatalf("resume --topic: %s", stderr)
	}

	// An operator's etcdctl mistake shows in the list with its reason.
	if _, err := c.Put(t.Context(), k.AgentSignal("agent-2"), "stop"); err != nil {
		t.Fatal(err)
	}
	code, out, stderr = runSignals(t, env, "signals")
	if code != 0 {
		t.Fatalf("signals: %s", stderr)
	}
	for _, want := range []string{
		"fleet orders, signals at etcd revision",
		"SCOPE", "fleet", "started", "upgrade done",
		"topic/payments", "agent/agent-2", "paused", "channel/audit", "audit cluster down",
		"refused values", k.AgentSignal("agent-2"), `"stop"`, "neither pause nor start", `"pause" or "start"`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("signals table lacks %q:\n%s", want, out)
		}
	}
	code, out, stderr = runSignals(t, env, "signals", "-o", "json")
	if code != 0 {
		t.Fatalf("signals -o json: %s", stderr)
	}
	var view struct {
		Fleet    string            `json:"fleet"`
		Revision int64             `json:"revision"`
		Signals  []signals.Signal  `json:"signals"`
		Refusals []signals.Refusal `json:"refusals"`
	}
	if err := json.Unmarshal([]byte(out), &view); err != nil {
		t.Fatalf("%v:\n%s", err, out)
	}
	if view.Fleet != "orders" || view.Revision == 0 || len(view.Signals) != 4 || len(view.Refusals) != 1 || view.Refusals[0].Value != "stop" {
		t.Errorf("json: %s", out)
	}
	paused := map[string]bool{}
	for _, s := range view.Signals {
		paused[s.Scope.String()] = s.Paused
	}
	if want := map[string]bool{"fleet": false, "topic/payments": false, "agent/agent-2": true, "channel/audit": true}; fmt.Sprint(paused) != fmt.Sprint(want) {
		t.Errorf("json states %v, want %v", paused, want)
	}

	// An empty fleet lists nothing.
	code, out, _ = runSignals(t, nil, "signals", "--etcd", e.Endpoints()[0], "--fleet", "empty")
	if code != 0 || !strings.Contains(out, "nothing is paused") {
		t.Errorf("empty fleet: exit %d\n%s", code, out)
	}
}

func TestPauseRefusesBadFlags(t *testing.T) {
	env := []string{"KSWITCH_ETCD_ENDPOINTS=127.0.0.1:1", "KSWITCH_FLEET=orders"}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"pause", "--topic", "a", "--agent", "b"}, "topic"},
		{[]string{"resume", "--agent", "b", "--channel", "c"}, "channel"},
		{[]string{"pause", "--topic", "a/b"}, `--topic "a/b"`},
		{[]string{"pause", "--agent", ""}, `--agent "": must not be empty`},
		{[]string{"resume", "--channel", "a b"}, "--channel"},
		{[]string{"pause", "--reason", "two\nlines"}, "--reason"},
		{[]string{"pause", "extra"}, "unknown command"},
		{[]string{"signals", "-o", "yaml"}, "--output"},
		{[]string{"pause", "--fleet", ""}, "--fleet"},
	} {
		e := env
		if c.want == "--fleet" {
			e = nil
		}
		code, _, stderr := runSignals(t, e, c.args...)
		if code == 0 || !strings.Contains(stderr, c.want) {
			t.Errorf("%q: exit %d, stderr %q; want an error naming %q", c.args, code, stderr, c.want)
		}
	}
	code, _, stderr := runSignals(t, nil, "pause", "--etcd", "127.0.0.1:1", "--fleet", "orders", "--timeout", "300ms")
	if code == 0 || !strings.Contains(stderr, "127.0.0.1:1") {
		t.Errorf("unreachable etcd: exit %d, %q", code, stderr)
	}
}

func TestSignalCommandsHelp(t *testing.T) {
	for _, c := range []struct {
		name string
		want []string
	}{
		{"pause", []string{"Examples:", "etcdctl put /kswitch/orders/signals/fleet pause", "--topic", "--agent", "--channel", "--reason"}},
		{"resume", []string{"Examples:", "etcdctl put /kswitch/orders/signals/fleet start", "--reason"}},
		{"signals", []string{"Examples:", "-o json", "--output"}},
	} {
		code, out, _ := runSignals(t, nil, c.name, "--help")
		if code != 0 {
			t.Fatalf("%s --help: exit %d", c.name, code)
		}
		for _, w := range c.want {
			if !strings.Contains(out, w) {
				t.Errorf("%s --help lacks %q:\n%s", c.name, w, out)
			}
		}
	}
}

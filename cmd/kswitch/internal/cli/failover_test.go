package cli

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// TestFailoverWritesTopicPinsAndStages: kswitch failover --topic and
// --stages write the keys the leader follows, values it accepts, and
// --auto deletes them; a malformed --stages is refused before etcd is
// touched, saying how to write it.
func TestFailoverWritesTopicPinsAndStages(t *testing.T) {
	e := testenv.StartEtcdT(t)
	cli := testenv.EtcdClientT(t, e)
	k := keys.New("orders")
	get := func(key string) (string, bool) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		resp, err := cli.Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Kvs) == 0 {
			return "", false
		}
		return string(resp.Kvs[0].Value), true
	}
	flags := []string{"--etcd", e.Endpoints()[0], "--fleet", "orders"}
	failover := func(args ...string) (int, string, string) {
		return run(t, nil, append(append([]string{"failover"}, flags...), args...)...)
	}

	if code, out, stderr := failover("--to", "B", "--topic", "audit"); code != 0 || !strings.Contains(out, "moves audit alone to B") {
		t.Fatalf("failover --topic: exit %d: %s %s", code, out, stderr)
	}
	if v, ok := get(k.TopicPin("audit")); !ok || v != "B" {
		t.Errorf("%s = %q (%v), want B", k.TopicPin("audit"), v, ok)
	}
	if _, ok := get(k.Pin()); ok {
		t.Errorf("failover --topic wrote the fleet's pin")
	}
	if code, _, stderr := failover("--auto", "--topic", "audit"); code != 0 {
		t.Fatalf("failover --auto --topic: exit %d: %s", code, stderr)
	}
	if _, ok := get(k.TopicPin("audit")); ok {
		t.Errorf("failover --auto --topic left the pin")
	}

	if code, out, stderr := failover("--to", "B", "--stages", "audit, clicks;orders,payments", "--check", "5s"); code != 0 || !strings.Contains(out, "2 stages to B") {
		t.Fatalf("failover --stages: exit %d: %s %s", code, out, stderr)
	}
	v, ok := get(k.Stages())
	if !ok {
		t.Fatalf("no %s", k.Stages())
	}
	plan, err := state.ParseStagePlan([]byte(v), func(c string) bool { return c == "A" || c == "B" })
	if err != nil || plan.To != "B" || plan.Check != 5*time.Second || len(plan.Stages) != 2 || strings.Join(plan.Stages[0].Topics, ",") != "audit,clicks" {
		t.Errorf("%s = %q: %+v %v", k.Stages(), v, plan, err)
	}
	for _, bad := range []struct{ stages, want string }{
		{"audit;;orders", "stage 2 has no topics"},
		{"audit;audit", "topic audit is in stage 1 already"},
	} {
		code, _, stderr := failover("--to", "A", "--stages", bad.stages)
		if code == 0 || !strings.Contains(stderr, bad.want) {
			t.Errorf("--stages %q: exit %d, %q; want a refusal saying %q", bad.stages, code, stderr, bad.want)
		}
	}
	if code, _, stderr := failover("--to", "B", "--topic", "audit", "--stages", "audit"); code == 0 || !strings.Contains(stderr, "not both") {
		t.Errorf("--topic with --stages: exit %d, %q", code, stderr)
	}
	if v2, _ := get(k.Stages()); v2 != v {
		t.Errorf("a refused --stages changed %s to %q", k.Stages(), v2)
	}
	if code, _, stderr := failover("--auto", "--stages="); code != 0 {
		t.Fatalf("failover --auto --stages: exit %d: %s", code, stderr)
	}
	if _, ok := get(k.Stages()); ok {
		t.Errorf("failover --auto --stages left the plan")
	}
}

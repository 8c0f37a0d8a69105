package coordinator

import (
	"strings"
	"testing"
	"time"
)

// TestParseStagePlan: the plan operators write to control/stages, as
// kswitch failover --stages writes it, and what is refused (with where).
func TestParseStagePlan(t *testing.T) {
	valid := func(c string) bool { return c == "A" || c == "B" }
	p := StagePlan{To: "B", Check: 2 * time.Second, Stages: []Stage{{Topics: []string{"audit", "clicks"}}, {Topics: []string{"orders"}}}}
	got, err := ParseStagePlan([]byte(FormatStagePlan(p)), valid)
	if err != nil {
		t.Fatal(err)
	}
	if got.To != "B" || got.Check != 2*time.Second || len(got.Stages) != 2 || got.Stages[0].Topics[1] != "clicks" || got.LagSlack != defaultLagSlack {
		t.Errorf("parsed %+v", got)
	}
	if got, err := ParseStagePlan([]byte("to: B\nstages:\n  - topics: [audit]\n"), valid); err != nil || got.Check != defaultCheck {
		t.Errorf("defaults: %+v %v", got, err)
	}
	for _, tc := range []struct{ value, want string }{
		{"to: C\nstages: [{topics: [a]}]\n", `"C" is not a primary or standby`},
		{"stages: [{topics: [a]}]\n", "to: the cluster"},
		{"to: B\n", "stages: none given"},
		{"to: B\nstages: [{topics: []}]\n", "stages[0]: no topics"},
		{"to: B\nstages: [{topics: [a]}, {topics: [b, a]}]\n", "stages[1]: topic a is in stage 1 already"},
		{"to: B\ncheck: 10ms\nstages: [{topics: [a]}]\n", "check: 10ms is outside"},
		{"to: B\nstages: [{topics: [a]}]\nrollback: yes\n", "rollback"},
		{"to: B\nstages: [{topics: [a/b]}]\n", `topic "a/b"`},
		{strings.Repeat("x", maxStagesSize+1), "over the"},
	} {
		if _, err := ParseStagePlan([]byte(tc.value), valid); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want one saying %q", tc.value, err, tc.want)
		}
	}
}

// TestStageWants: where a staged move wants its topics in each phase: the
// stages up to the current on the target; a rolled-back stage back on the
// fleet's cluster (the earlier stages stay); nothing once overridden.
func TestStageWants(t *testing.T) {
	plan := StagePlan{To: "B", Stages: []Stage{{Topics: []string{"audit"}}, {Topics: []string{"orders", "payments"}}}}
	for _, tc := range []struct {
		stage int
		phase string
		want  map[string]string // topic → cluster ("" the fleet's)
	}{
		{0, StageMoving, map[string]string{"audit": "B"}},
		{0, StageChecking, map[string]string{"audit": "B"}},
		{1, StageMoving, map[string]string{"audit": "B", "orders": "B", "payments": "B"}},
		{1, StageDone, map[string]string{"audit": "B", "orders": "B", "payments": "B"}},
		{1, StageRolledBack, map[string]string{"audit": "B", "orders": "", "payments": ""}},
		{1, StageOverridden, map[string]string{}},
	} {
		got := StageState{Plan: plan, Stage: tc.stage, Phase: tc.phase, Reason: "lag grew"}.wants()
		if len(got) != len(tc.want) {
			t.Errorf("stage %d %s: wants %v, want %v", tc.stage, tc.phase, got, tc.want)
			continue
		}
		for topic, c := range tc.want {
			if w, ok := got[topic]; !ok || w.cluster != c || w.reason == "" {
				t.Errorf("stage %d %s: %s wanted %+v, want on %q with a reason", tc.stage, tc.phase, topic, w, c)
			}
		}
	}
	back := StageState{Plan: plan, Stage: 1, Phase: StageRolledBack, Reason: "lag grew"}.wants()["orders"].reason
	if !strings.Contains(back, "rolled back: stage 2 of 2") || !strings.Contains(back, "lag grew") {
		t.Errorf("the reason of a rolled-back topic: %q", back)
	}
}

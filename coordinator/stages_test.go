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

// TestJudgeStage: a stage's check fails on each of its rules alone
// (a partition without an owner, one with records that did not move, the
// lag grown past the slack, dead letters) and passes when none holds,
// including a partition that had nothing to consume.
func TestJudgeStage(t *testing.T) {
	p0, p1 := "B:A.orders/0", "B:A.orders/1"
	before := map[string]PartitionMark{p0: {Committed: 100, End: 150}, p1: {Committed: 40, End: 40}}
	moving := map[string]PartitionMark{p0: {Committed: 160, End: 190}, p1: {Committed: 40, End: 40}}
	both := map[string]bool{p0: true, p1: true}
	for _, c := range []struct {
		what  string
		now   map[string]PartitionMark
		owned map[string]bool
		slack int64
		dead  int64
		want  string // "" healthy, else a part of the reason
	}{
		{"healthy", moving, both, 0, 0, ""},
		{"no consumer", moving, map[string]bool{p0: true}, 0, 0, p1 + " has no consumer"},
		{"not consuming", map[string]PartitionMark{p0: {Committed: 100, End: 190}, p1: {Committed: 40, End: 40}}, both, 1000, 0, p0 + " not consuming: committed 100"},
		{"lag grew", map[string]PartitionMark{p0: {Committed: 120, End: 300}, p1: {Committed: 40, End: 40}}, both, 100, 0, "lag grew from 50 to 180 records (slack 100)"},
		{"lag within the slack", map[string]PartitionMark{p0: {Committed: 120, End: 300}, p1: {Committed: 40, End: 40}}, both, 130, 0, ""},
		{"dead letters", moving, both, 0, 3, "3 records dead-lettered"},
	} {
		healthy, why := judgeStage(before, c.now, c.owned, c.slack, c.dead)
		if healthy != (c.want == "") || (c.want != "" && !strings.Contains(why, c.want)) {
			t.Errorf("%s: healthy %v, %q; want %q", c.what, healthy, why, c.want)
		}
	}
}

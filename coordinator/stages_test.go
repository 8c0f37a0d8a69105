package coordinator

import (
	"strings"
	"testing"

	"github.com/kswitch/kswitch/state"
)

// TestStageWants: where a staged move wants its topics in each phase: the
// stages up to the current on the target; a rolled-back stage back on the
// fleet's cluster (the earlier stages stay); nothing once overridden.
func TestStageWants(t *testing.T) {
	plan := state.StagePlan{To: "B", Stages: []state.Stage{{Topics: []string{"audit"}}, {Topics: []string{"orders", "payments"}}}}
	for _, tc := range []struct {
		stage int
		phase string
		want  map[string]string // topic → cluster ("" the fleet's)
	}{
		{0, state.StageMoving, map[string]string{"audit": "B"}},
		{0, state.StageChecking, map[string]string{"audit": "B"}},
		{1, state.StageMoving, map[string]string{"audit": "B", "orders": "B", "payments": "B"}},
		{1, state.StageDone, map[string]string{"audit": "B", "orders": "B", "payments": "B"}},
		{1, state.StageRolledBack, map[string]string{"audit": "B", "orders": "", "payments": ""}},
		{1, state.StageOverridden, map[string]string{}},
	} {
		got := stageWants(state.StageState{Plan: plan, Stage: tc.stage, Phase: tc.phase, Reason: "lag grew"})
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
	back := stageWants(state.StageState{Plan: plan, Stage: 1, Phase: state.StageRolledBack, Reason: "lag grew"})["orders"].reason
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
	before := map[string]state.PartitionMark{p0: {Committed: 100, End: 150}, p1: {Committed: 40, End: 40}}
	moving := map[string]state.PartitionMark{p0: {Committed: 160, End: 190}, p1: {Committed: 40, End: 40}}
	both := map[string]bool{p0: true, p1: true}
	for _, c := range []struct {
		what  string
		now   map[string]state.PartitionMark
		owned map[string]bool
		slack int64
		dead  int64
		want  string // "" healthy, else a part of the reason
	}{
		{"healthy", moving, both, 0, 0, ""},
		{"no consumer", moving, map[string]bool{p0: true}, 0, 0, p1 + " has no consumer"},
		{"not consuming", map[string]state.PartitionMark{p0: {Committed: 100, End: 190}, p1: {Committed: 40, End: 40}}, both, 1000, 0, p0 + " not consuming: committed 100"},
		{"lag grew", map[string]state.PartitionMark{p0: {Committed: 120, End: 300}, p1: {Committed: 40, End: 40}}, both, 100, 0, "lag grew from 50 to 180 records (slack 100)"},
		{"lag within the slack", map[string]state.PartitionMark{p0: {Committed: 120, End: 300}, p1: {Committed: 40, End: 40}}, both, 130, 0, ""},
		{"dead letters", moving, both, 0, 3, "3 records dead-lettered"},
	} {
		healthy, why := judgeStage(before, c.now, c.owned, c.slack, c.dead)
		if healthy != (c.want == "") || (c.want != "" && !strings.Contains(why, c.want)) {
			t.Errorf("%s: healthy %v, %q; want %q", c.what, healthy, why, c.want)
		}
	}
}

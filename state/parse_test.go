package state

import (
	"strings"
	"testing"
	"time"

	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

func TestMain(m *testing.M) { wait.VerifyTestMain(m, testenv.LeakOptions()...) }

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

func TestParseAssignmentRefusesDuplicates(t *testing.T) {
	tests := []struct {
		name    string
		val     string
		wantErr string
	}{
		{"owned by two agents", `{"generation":3,"owned":{"a":[{"topic":"t","partition":0}],"b":[{"topic":"t","partition":0}]}}`, "gives t/0 to both"},
		{"owned by one, revoked from another", `{"generation":3,"owned":{"a":[{"topic":"t","partition":0}]},"revoking":{"b":[{"topic":"t","partition":0}]}}`, "gives t/0 to both"},
		{"owned and revoked by the same agent", `{"generation":3,"owned":{"a":[{"topic":"t","partition":0}]},"revoking":{"a":[{"topic":"t","partition":0}]}}`, "gives t/0 to both a and a"},
		{"listed twice for one agent", `{"generation":3,"owned":{"a":[{"topic":"t","partition":1},{"topic":"t","partition":1}]}}`, "gives t/1 to both a and a"},
		{"valid", `{"generation":3,"owned":{"a":[{"topic":"t","partition":0}]},"revoking":{"b":[{"topic":"t","partition":1}]}}`, ""},
		{"placed twice on B", `{"generation":3,"cluster":"A","placed":{"B":{"owned":{"a":[{"topic":"t","partition":0}],"b":[{"topic":"t","partition":0}]}}}}`, "gives B:t/0 to both"},
		{"same partition on A and on B", `{"generation":3,"cluster":"A","owned":{"a":[{"topic":"t","partition":0}]},"placed":{"B":{"owned":{"b":[{"topic":"t","partition":0}]}}}}`, ""},
		{"placed on its own cluster", `{"generation":3,"cluster":"A","placed":{"A":{"owned":{}}}}`, "places partitions on its own cluster A"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseAssignment([]byte(tt.val))
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("refused a valid assignment: %v", err)
			case tt.wantErr != "" && err == nil:
				t.Fatal("accepted an assignment that gives a partition twice")
			case tt.wantErr != "" && !strings.Contains(err.Error(), tt.wantErr):
				t.Fatalf("error %q does not say %q", err, tt.wantErr)
			}
		})
	}
}

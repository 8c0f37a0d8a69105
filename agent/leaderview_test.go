package agent

import (
	"testing"

	"github.com/kswitch/kswitch/election"
)

// TestLeaderViewOfAnEndedTerm: an agent whose leader work still runs while
// etcd's election already names its successor (its lease expired while it
// was stopped; a chaos run saw agent-2, continued after a SIGSTOP, answer
// /leader with self true and agent-3's fencing token for 1.7 s) does not
// claim to lead: /leader names the successor and its term.
func TestLeaderViewOfAnEndedTerm(t *testing.T) {
	t.Parallel()
	agent3 := election.Leader{ID: "agent-3", Token: 10}
	agent2 := election.Leader{ID: "agent-2", Token: 6}
	for _, c := range []struct {
		name     string
		leading  bool
		l        election.Leader
		observed bool
		want     LeaderView
	}{
		{"leading, etcd names it", true, agent2, true, LeaderView{Agent: "agent-2", Self: true, Leader: "agent-2", FencingToken: 6}},
		{"leading, etcd names a successor", true, agent3, true, LeaderView{Agent: "agent-2", Self: false, Leader: "agent-3", FencingToken: 10}},
		{"leading, nothing observed yet", true, election.Leader{}, false, LeaderView{Agent: "agent-2", Self: true}},
		{"not leading, etcd names it (its work not started yet)", false, agent2, true, LeaderView{Agent: "agent-2", Self: false, Leader: "agent-2", FencingToken: 6}},
		{"not leading, etcd names another", false, agent3, true, LeaderView{Agent: "agent-2", Leader: "agent-3", FencingToken: 10}},
	} {
		if got := leaderView("agent-2", c.leading, c.l, c.observed); got != c.want {
			t.Errorf("%s: %+v, want %+v", c.name, got, c.want)
		}
	}
}

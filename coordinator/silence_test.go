package coordinator

import (
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/state"
)

// shown vouches for every agent.
func shown(string) (Proof, string) { return ProofShown, "" }

// TestSilence: a member that does not acknowledge the current generation
// is planned on until silentAfter has passed since the first turn that
// saw it owe, then left out and named; it is planned on again once it
// acknowledges the generation it owed; an agent that leaves is forgotten.
func TestSilence(t *testing.T) {
	t0 := time.Date(2026, 12, 5, 6, 0, 0, 0, time.UTC)
	after := 30 * time.Second
	s := newSilence(after, zap.NewNop())
	cur := state.Assignment{Generation: 5, Cluster: "A"}
	reg := []string{"a", "b", "c"}
	acks := map[string]int64{"a": 5, "b": 4, "c": 4}
	if got := s.live(t0, reg, cur, acks, shown); !slices.Equal(got, reg) {
		t.Fatalf("at first: live %v, want every member", got)
	}
	acks["b"] = 5 // b applied generation 5 a moment later
	if got := s.live(t0.Add(after-time.Millisecond), reg, cur, acks, shown); !slices.Equal(got, reg) {
		t.Fatalf("just before the bound: live %v", got)
	}
	if got := s.live(t0.Add(after), reg, cur, acks, shown); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("at the bound: live %v, want c left out", got)
	}
	if why := s.reasons()["c"]; !strings.Contains(why, "has not acknowledged generation 5 for 30s") {
		t.Errorf("c's reason: %q", why)
	}
	// A new generation does not restart the count: c owed 5.
	cur.Generation = 6
	acks["a"], acks["b"] = 6, 6
	if got := s.live(t0.Add(after+time.Second), reg, cur, acks, shown); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("after generation 6: live %v", got)
	}
	// It acknowledges at last (a real agent that was slow): back.
	acks["c"] = 6
	if got := s.live(t0.Add(after+2*time.Second), reg, cur, acks, shown); !slices.Equal(got, reg) || s.reasons() != nil {
		t.Fatalf("after its ack: live %v, silent %v", got, s.reasons())
	}
	// b falls silent, then leaves: forgotten, and counted afresh if it
	// registers again.
	cur.Generation = 7
	acks["a"], acks["c"] = 7, 7
	s.live(t0.Add(time.Minute), reg, cur, acks, shown)
	if got := s.live(t0.Add(time.Minute+after), reg, cur, acks, shown); slices.Contains(got, "b") {
		t.Fatalf("b owes 7 for 30 s: live %v", got)
	}
	s.live(t0.Add(2*time.Minute), []string{"a", "c"}, cur, acks, shown)
	if got := s.live(t0.Add(2*time.Minute+time.Second), reg, cur, acks, shown); !slices.Contains(got, "b") || s.reasons() != nil {
		t.Fatalf("b registered again: live %v silent %v, want it planned on until the bound", got, s.reasons())
	}
}

// TestMembershipIsEarned: a registration is planned on only once its
// agent has shown who it is and acknowledged a generation on its lease;
// one the assignment places keeps its place while its proof is checked;
// one whose endpoint answers as someone else is left out at once; one
// that never earns membership is named silent after the bound.
func TestMembershipIsEarned(t *testing.T) {
	t0 := time.Date(2026, 12, 5, 6, 0, 0, 0, time.UTC)
	after := 30 * time.Second
	tp := state.TopicPartition{Topic: "orders", Partition: 0}
	proofs := map[string]Proof{"leader": ProofShown, "new": ProofShown, "placed": ProofUnknown, "ghost": ProofUnknown, "liar": ProofRefuted}
	proof := func(id string) (Proof, string) {
		if proofs[id] == ProofRefuted {
			return ProofRefuted, "its endpoint at 127.0.0.1:1 says it is agent-1"
		}
		return proofs[id], "its endpoint at 127.0.0.1:1 does not answer"
	}
	reg := []string{"ghost", "leader", "liar", "new", "placed"}

	// The fleet's first assignment is planned on every registration not
	// refuted (a fleet starting together is not all asked yet).
	s := newSilence(after, zap.NewNop())
	if got := s.live(t0, reg, state.Assignment{}, map[string]int64{}, proof); !slices.Equal(got, []string{"ghost", "leader", "new", "placed"}) {
		t.Fatalf("before the first assignment: live %v", got)
	}
	// The first generation placed them; they have not acknowledged it
	// yet: still members (else the next turn would take their
	// partitions away without a revoke).
	first := state.Assignment{Generation: 1, Cluster: "A", Owned: map[string][]state.TopicPartition{"new": {tp}}}
	if got := s.live(t0.Add(time.Millisecond), reg, first, map[string]int64{}, proof); !slices.Equal(got, []string{"ghost", "leader", "new", "placed"}) {
		t.Fatalf("before their first acknowledgement: live %v", got)
	}

	s = newSilence(after, zap.NewNop())
	cur := state.Assignment{Generation: 5, Cluster: "A", Owned: map[string][]state.TopicPartition{"placed": {tp}}}
	acks := map[string]int64{"leader": 5, "placed": 5, "ghost": 5, "liar": 5}
	if got := s.live(t0, reg, cur, acks, proof); !slices.Equal(got, []string{"leader", "placed"}) {
		t.Fatalf("live %v: want the leader and the placed agent (checked meanwhile); not the ghost (no proof), the liar, nor new (no ack)", got)
	}
	if why := s.reasons()["liar"]; !strings.Contains(why, "says it is agent-1") {
		t.Errorf("the liar is named at once: %q", why)
	}
	acks["new"] = 5 // new applied generation 5 and acknowledged it
	if got := s.live(t0.Add(time.Second), reg, cur, acks, proof); !slices.Equal(got, []string{"leader", "new", "placed"}) {
		t.Fatalf("after new's ack: live %v", got)
	}
	if got := s.live(t0.Add(after), reg, cur, acks, proof); !slices.Equal(got, []string{"leader", "new", "placed"}) {
		t.Fatalf("at the bound: live %v", got)
	}
	if why := s.reasons()["ghost"]; !strings.Contains(why, "not a member: its endpoint at 127.0.0.1:1 does not answer") {
		t.Errorf("the ghost's reason at the bound: %q", why)
	}
	// The ghost's endpoint answers at last, as itself: a member.
	proofs["ghost"] = ProofShown
	if got := s.live(t0.Add(after+time.Second), reg, cur, acks, proof); !slices.Contains(got, "ghost") || s.reasons()["ghost"] != "" {
		t.Fatalf("the ghost shown: live %v silent %v", got, s.reasons())
	}
}

package coordinator

import (
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
)

// TestSilence: a registered agent that does not acknowledge the current
// generation is planned on until silentAfter has passed since the first
// turn that saw it owe, then left out and named; it is planned on again
// once it acknowledges the generation it owed; an agent that leaves is
// forgotten.
func TestSilence(t *testing.T) {
	t0 := time.Date(2026, 12, 5, 6, 0, 0, 0, time.UTC)
	after := 30 * time.Second
	s := newSilence(after, zap.NewNop())
	cur := Assignment{Generation: 5, Cluster: "A"}
	reg := []string{"a", "b", "ghost"}
	acks := map[string]int64{"a": 5, "b": 4}
	if got := s.live(t0, reg, cur, acks); !slices.Equal(got, reg) {
		t.Fatalf("at first: live %v, want every registered agent", got)
	}
	acks["b"] = 5 // b applied generation 5 a moment later
	if got := s.live(t0.Add(after-time.Millisecond), reg, cur, acks); !slices.Equal(got, reg) {
		t.Fatalf("just before the bound: live %v", got)
	}
	if got := s.live(t0.Add(after), reg, cur, acks); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("at the bound: live %v, want the ghost left out", got)
	}
	if why := s.reasons()["ghost"]; !strings.Contains(why, "has not acknowledged generation 5 for 30s") {
		t.Errorf("the ghost's reason: %q", why)
	}
	// A new generation does not restart the count: the ghost owed 5.
	cur.Generation = 6
	acks["a"], acks["b"] = 6, 6
	if got := s.live(t0.Add(after+time.Second), reg, cur, acks); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("after generation 6: live %v", got)
	}
	// It acknowledges at last (a real agent that was slow): back.
	acks["ghost"] = 6
	if got := s.live(t0.Add(after+2*time.Second), reg, cur, acks); !slices.Equal(got, reg) || s.reasons() != nil {
		t.Fatalf("after its ack: live %v, silent %v", got, s.reasons())
	}
	// b falls silent, then leaves: forgotten, and counted afresh if it
	// registers again.
	cur.Generation = 7
	acks["a"] = 7
	s.live(t0.Add(time.Minute), reg, cur, acks)
	if got := s.live(t0.Add(time.Minute+after), reg, cur, acks); slices.Contains(got, "b") {
		t.Fatalf("b owes 7 for 30 s: live %v", got)
	}
	s.live(t0.Add(2*time.Minute), []string{"a", "ghost"}, cur, acks)
	if got := s.live(t0.Add(2*time.Minute+time.Second), reg, cur, acks); !slices.Contains(got, "b") {
		t.Fatalf("b registered again: live %v, want it planned on until the bound", got)
	}
}

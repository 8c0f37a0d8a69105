package coordinator

import (
	"slices"
	"testing"
	"time"
)

// TestStalledPartitions: the leader's verdict lists the discovered
// partitions that nobody consumes or releases (or whose owner cannot reach
// the cluster), with how long, and forgets them once they have a consumer;
// over StalledAfter they are the value of state/stalled.
func TestStalledPartitions(t *testing.T) {
	s := &stalled{since: map[TopicPartition]time.Time{}}
	tp := func(p int32) TopicPartition { return TopicPartition{Topic: "orders", Partition: p} }
	found := []TopicPartition{tp(0), tp(1), tp(2)}
	a := Assignment{Owned: map[string][]TopicPartition{"agent-1": {tp(0)}}, Revoking: map[string][]TopicPartition{"agent-2": {tp(1)}}}
	t0 := time.Unix(1000, 0)
	if got := s.note(t0, found, a, nil); !slices.Equal(got, []string{"orders/2 for 0s"}) || len(s.over(t0)) != 0 {
		t.Fatalf("at first: %v, over the bound %v", got, s.over(t0))
	}
	t1 := t0.Add(12 * time.Second)
	if got := s.note(t1, found, a, map[string]bool{"agent-2": true}); !slices.Equal(got, []string{"orders/1 for 0s", "orders/2 for 12s"}) {
		t.Fatalf("12 s later, agent-2 cut off: %v", got)
	}
	if over := s.over(t1); len(over) != 1 || over[0].TopicPartition != tp(2) || !over[0].Since.Equal(t0) {
		t.Fatalf("12 s later, over the bound: %+v", over)
	}
	a.Owned["agent-1"] = append(a.Owned["agent-1"], tp(2))
	if got := s.note(t0.Add(13*time.Second), found, a, nil); len(got) != 0 || len(s.since) != 0 {
		t.Fatalf("once consumed: %v (%v)", got, s.since)
	}
}

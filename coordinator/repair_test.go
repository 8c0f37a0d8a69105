package coordinator

import (
	"slices"
	"testing"
	"time"
)

// TestStalledPartitions: the leader's verdict lists the discovered
// partitions that nobody consumes or releases, with how long, and forgets
// them once they have a consumer.
func TestStalledPartitions(t *testing.T) {
	s := &stalled{since: map[TopicPartition]time.Time{}}
	tp := func(p int32) TopicPartition { return TopicPartition{Topic: "orders", Partition: p} }
	found := []TopicPartition{tp(0), tp(1), tp(2)}
	a := Assignment{Owned: map[string][]TopicPartition{"agent-1": {tp(0)}}, Revoking: map[string][]TopicPartition{"agent-2": {tp(1)}}}
	t0 := time.Unix(1000, 0)
	if got := s.note(t0, found, a); !slices.Equal(got, []string{"orders/2 for 0s"}) {
		t.Fatalf("at first: %v", got)
	}
	if got := s.note(t0.Add(12*time.Second), found, a); !slices.Equal(got, []string{"orders/2 for 12s"}) {
		t.Fatalf("12 s later: %v", got)
	}
	a.Owned["agent-1"] = append(a.Owned["agent-1"], tp(2))
	if got := s.note(t0.Add(13*time.Second), found, a); len(got) != 0 || len(s.since) != 0 {
		t.Fatalf("once consumed: %v (%v)", got, s.since)
	}
}

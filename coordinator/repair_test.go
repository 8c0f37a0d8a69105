package coordinator

import (
	"slices"
	"testing"
	"time"

	"github.com/kswitch/kswitch/state"
)

// TestStalledPartitions: the leader's verdict lists the discovered
// partitions that nobody consumes or releases (or whose owner cannot reach
// the cluster), with how long, and forgets them once they have a consumer;
// over StalledAfter they are the value of state/stalled.
func TestStalledPartitions(t *testing.T) {
	s := &stalled{since: map[state.ClusterPartition]time.Time{}}
	tp := func(p int32) state.TopicPartition { return state.TopicPartition{Topic: "orders", Partition: p} }
	found := map[string][]state.TopicPartition{"A": {tp(0), tp(1), tp(2)}}
	a := state.Assignment{Cluster: "A", Owned: map[string][]state.TopicPartition{"agent-1": {tp(0)}}, Revoking: map[string][]state.TopicPartition{"agent-2": {tp(1)}}}
	t0 := time.Unix(1000, 0)
	if got := s.note(t0, found, a, nil); !slices.Equal(got, []string{"orders/2 for 0s"}) || len(s.over(t0, "A")) != 0 {
		t.Fatalf("at first: %v, over the bound %v", got, s.over(t0, "A"))
	}
	t1 := t0.Add(12 * time.Second)
	if got := s.note(t1, found, a, map[string]map[string]bool{"A": {"agent-2": true}}); !slices.Equal(got, []string{"orders/1 for 0s", "orders/2 for 12s"}) {
		t.Fatalf("12 s later, agent-2 cut off: %v", got)
	}
	if over := s.over(t1, "A"); len(over) != 1 || over[0].TopicPartition != tp(2) || over[0].Cluster != "" || !over[0].Since.Equal(t0) {
		t.Fatalf("12 s later, over the bound: %+v", over)
	}
	a.Owned["agent-1"] = append(a.Owned["agent-1"], tp(2))
	if got := s.note(t0.Add(13*time.Second), found, a, nil); len(got) != 0 || len(s.since) != 0 {
		t.Fatalf("once consumed: %v (%v)", got, s.since)
	}
	// A topic placed on B: B's partitions are named with their cluster,
	// and A's orders/0 owned does not hold B's.
	found["B"] = []state.TopicPartition{tp(0)}
	if got := s.note(t0.Add(14*time.Second), found, a, nil); !slices.Equal(got, []string{"B:orders/0 for 0s"}) {
		t.Fatalf("B's orders/0 without an owner: %v", got)
	}
	a.Placed = map[string]state.Placement{"B": {Owned: map[string][]state.TopicPartition{"agent-2": {tp(0)}}}}
	if got := s.note(t0.Add(15*time.Second), found, a, map[string]map[string]bool{"B": {"agent-1": true}}); len(got) != 0 {
		t.Fatalf("B's orders/0 owned by agent-2, agent-1 cut off from B: %v", got)
	}
}

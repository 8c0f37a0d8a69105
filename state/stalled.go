package state

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"
)

// StalledAfter is how long a discovered partition may have no consumer
// before the leader lists it in state/stalled: longer than a rebalance
// takes, so that the key changes only when something is wrong.
const StalledAfter = 5 * time.Second

// Stalled is the value of state/stalled: the leader's fleet-level verdict
// of the partitions nobody consumes, for kswitch status and for agents
// that own nothing (their /readyz says so). The key is advisory: the
// leader writes it when the set changes and deletes it when empty.
type Stalled struct {
	Leader     string             `json:"leader"`
	Noted      time.Time          `json:"noted"`
	Partitions []StalledPartition `json:"partitions"`
	// Silent are the registered agents the leader plans without because
	// they do not acknowledge, with why (coordinator's silence).
	Silent map[string]string `json:"silent,omitempty"`
}

// StalledPartition is a partition without a consumer since Since. Cluster
// is set for a partition of a cluster a topic is placed on, not the
// fleet's.
type StalledPartition struct {
	TopicPartition
	Cluster string    `json:"cluster,omitempty"`
	Since   time.Time `json:"since"`
}

// name is the partition's name, prefixed by its cluster when it has one.
// Name is the partition as the leader and the status page name it.
func (p StalledPartition) Name() string {
	return ClusterPartition{p.Cluster, p.TopicPartition}.On("")
}

// ParseStalled decodes a state/stalled value.
func ParseStalled(val []byte) (Stalled, error) {
	var s Stalled
	if len(val) > 1<<20 {
		return s, fmt.Errorf("state: state/stalled is %d bytes, over the 1 MiB limit", len(val))
	}
	if err := json.Unmarshal(val, &s); err != nil {
		return s, fmt.Errorf("state: state/stalled: %w", err)
	}
	return s, nil
}

// String lists the partitions with how long they have had no consumer at
// now, the longest first.
func (s Stalled) String(now time.Time) string {
	parts := slices.SortedFunc(slices.Values(s.Partitions), func(a, b StalledPartition) int { return a.Since.Compare(b.Since) })
	out := make([]string, len(parts))
	for i, p := range parts {
		out[i] = fmt.Sprintf("%s for %s", p.Name(), now.Sub(p.Since).Round(time.Second))
	}
	return strings.Join(out, ", ")
}

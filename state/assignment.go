package state

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/kswitch/kswitch/offsets"
)

// TopicPartition names one partition of a source topic.
type TopicPartition = offsets.TopicPartition

// ClusterPartition names a partition of one cluster: A's orders/0 and B's
// orders/0 are different streams.
type ClusterPartition struct {
	Cluster string
	TopicPartition
}

// String is cluster:topic/partition.
func (c ClusterPartition) String() string { return c.Cluster + ":" + c.TopicPartition.String() }

// On names the partition as seen from cluster home: without the cluster
// when it is home's.
func (c ClusterPartition) On(home string) string {
	if c.Cluster == "" || c.Cluster == home {
		return c.TopicPartition.String()
	}
	return c.String()
}

// Compare orders by cluster, then topic and partition.
func (c ClusterPartition) Compare(o ClusterPartition) int {
	if n := strings.Compare(c.Cluster, o.Cluster); n != 0 {
		return n
	}
	return c.TopicPartition.Compare(o.TopicPartition)
}

// Assignment is the value of state/assignment: which agent consumes which
// partition of which cluster, in one generation.
//
// A partition appears at most once across Owned and Revoking of all agents.
// An agent consumes the partitions it Owns. A partition in Revoking[a] is
// being taken from agent a: a stops consuming it, commits its final offset
// (a may still commit it in this generation, nobody else may) and then
// acknowledges the generation; only after that does the leader give the
// partition to its next owner. So no partition has two consumers at once.
type Assignment struct {
	// Generation grows by one with every published assignment.
	Generation int64 `json:"generation"`
	// Cluster is the Kafka cluster the partitions are consumed from.
	Cluster string `json:"cluster"`
	// Leader and Token identify the leader term that published it.
	Leader string `json:"leader"`
	Token  int64  `json:"fencing_token"`
	// Owned maps agent id → the partitions it consumes, sorted.
	Owned map[string][]TopicPartition `json:"owned"`
	// Revoking maps agent id → the partitions it must stop and commit.
	Revoking map[string][]TopicPartition `json:"revoking,omitempty"`
	// Published is when the leader wrote it.
	Published time.Time `json:"published"`
	// Warm, when set, names the cluster a planned switch is about to move
	// the fleet to: agents open their clients to it now, while they go on
	// consuming Cluster, and acknowledge the generation once warm. A hint
	// only: an agent that has not warmed connects when it is assigned
	// partitions there.
	Warm string `json:"warm,omitempty"`
	// Placed holds, by cluster other than Cluster, the partitions of the
	// topics consumed there (Active.Topics): the same invariants hold in
	// each cluster's section. A's orders/0 and B's orders/0 are different
	// streams, so a partition is named by its cluster and its physical
	// topic.
	Placed map[string]Placement `json:"placed,omitempty"`
}

// Placement is one cluster's section of an assignment beside its own
// cluster's: who owns and who revokes which partition there.
type Placement struct {
	Owned    map[string][]TopicPartition `json:"owned"`
	Revoking map[string][]TopicPartition `json:"revoking,omitempty"`
}

// Section returns cluster's section of a: who owns and who revokes which of
// its partitions.
func (a Assignment) Section(cluster string) Placement {
	if cluster == a.Cluster {
		return Placement{Owned: a.Owned, Revoking: a.Revoking}
	}
	return a.Placed[cluster]
}

// Sections returns the clusters a has a section for, its own first, then
// the placed ones sorted.
func (a Assignment) Sections() []string {
	out := []string{a.Cluster}
	for _, c := range slices.Sorted(maps.Keys(a.Placed)) {
		if c != a.Cluster {
			out = append(out, c)
		}
	}
	return out
}

// OwnedBy returns, by cluster, the partitions agent owns in a (only the
// clusters where it owns any).
func (a Assignment) OwnedBy(agent string) map[string][]TopicPartition {
	out := map[string][]TopicPartition{}
	for _, c := range a.Sections() {
		if tps := a.Section(c).Owned[agent]; len(tps) > 0 {
			out[c] = tps
		}
	}
	return out
}

// Revokes reports whether agent is revoking anything in a, on any cluster.
func (a Assignment) Revokes(agent string) bool {
	for _, c := range a.Sections() {
		if len(a.Section(c).Revoking[agent]) > 0 {
			return true
		}
	}
	return false
}

// MaxGeneration bounds the generations a value may carry: a stranger's
// number near the int64 limit must not leave the leader no generation
// above it.
const MaxGeneration = 1 << 53

// maxAssignmentSize bounds what an agent parses from state/assignment.
const maxAssignmentSize = 4 << 20

// ParseAssignment decodes and checks a state/assignment value. A value that
// breaks the invariants (a partition given twice) is refused: an agent must
// never act on it.
func ParseAssignment(val []byte) (Assignment, error) {
	var a Assignment
	if len(val) > maxAssignmentSize {
		return a, fmt.Errorf("state: assignment is %d bytes, over the %d-byte limit", len(val), maxAssignmentSize)
	}
	if err := json.Unmarshal(val, &a); err != nil {
		return a, fmt.Errorf("state: assignment is not valid JSON: %w", err)
	}
	if a.Generation <= 0 || a.Generation > MaxGeneration {
		return a, fmt.Errorf("state: assignment generation %d is out of range (1 to 2^53)", a.Generation)
	}
	if _, dup := a.Placed[a.Cluster]; dup {
		return a, fmt.Errorf("state: assignment generation %d places partitions on its own cluster %s", a.Generation, a.Cluster)
	}
	for _, c := range a.Sections() {
		sec := a.Section(c)
		seen := map[TopicPartition]string{}
		for _, m := range []map[string][]TopicPartition{sec.Owned, sec.Revoking} {
			for agent, tps := range m {
				for _, tp := range tps {
					if prev, dup := seen[tp]; dup {
						return a, fmt.Errorf("state: assignment generation %d gives %s to both %s and %s", a.Generation, ClusterPartition{c, tp}.On(a.Cluster), prev, agent)
					}
					seen[tp] = agent
				}
			}
		}
	}
	return a, nil
}

// OwnerOf returns the agent that owns tp of cluster, or "".
func (a Assignment) OwnerOf(cluster string, tp TopicPartition) string {
	for agent, tps := range a.Section(cluster).Owned {
		if slices.Contains(tps, tp) {
			return agent
		}
	}
	return ""
}

// MayCommit reports whether agent may commit tp of cluster in this
// generation: it owns it or is releasing it.
func (a Assignment) MayCommit(agent, cluster string, tp TopicPartition) bool {
	sec := a.Section(cluster)
	return slices.Contains(sec.Owned[agent], tp) || slices.Contains(sec.Revoking[agent], tp)
}

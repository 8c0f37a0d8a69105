package coordinator

import (
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"github.com/kswitch/kswitch/offsets"
)

// TopicPartition names one partition of a source topic.
type TopicPartition = offsets.TopicPartition

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
}

// maxGeneration bounds the generations a value may carry: a stranger's
// number near the int64 limit must not leave the leader no generation
// above it.
const maxGeneration = 1 << 53

// maxAssignmentSize bounds what an agent parses from state/assignment.
const maxAssignmentSize = 4 << 20

// ParseAssignment decodes and checks a state/assignment value. A value that
// breaks the invariants (a partition given twice) is refused: an agent must
// never act on it.
func ParseAssignment(val []byte) (Assignment, error) {
	var a Assignment
	if len(val) > maxAssignmentSize {
		return a, fmt.Errorf("coordinator: assignment is %d bytes, over the %d-byte limit", len(val), maxAssignmentSize)
	}
	if err := json.Unmarshal(val, &a); err != nil {
		return a, fmt.Errorf("coordinator: assignment is not valid JSON: %w", err)
	}
	if a.Generation <= 0 || a.Generation > maxGeneration {
		return a, fmt.Errorf("coordinator: assignment generation %d is out of range (1 to 2^53)", a.Generation)
	}
	seen := map[TopicPartition]string{}
	for _, m := range []map[string][]TopicPartition{a.Owned, a.Revoking} {
		for agent, tps := range m {
			for _, tp := range tps {
				if prev, dup := seen[tp]; dup {
					return a, fmt.Errorf("coordinator: assignment generation %d gives %s to both %s and %s", a.Generation, tp, prev, agent)
				}
				seen[tp] = agent
			}
		}
	}
	return a, nil
}

// OwnerOf returns the agent that owns tp, or "".
func (a Assignment) OwnerOf(tp TopicPartition) string {
	for agent, tps := range a.Owned {
		if slices.Contains(tps, tp) {
			return agent
		}
	}
	return ""
}

// MayCommit reports whether agent may commit tp in this generation: it owns
// it or is releasing it.
func (a Assignment) MayCommit(agent string, tp TopicPartition) bool {
	return slices.Contains(a.Owned[agent], tp) || slices.Contains(a.Revoking[agent], tp)
}

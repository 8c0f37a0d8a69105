package state

import (
	"encoding/json"
	"fmt"
	"time"
)

// ClusterState is the value of state/clusters: the leader's view of every
// source cluster, in the order of preference, written when it changes
// (at most once a second).
type ClusterState struct {
	// Active is the fleet's active cluster when written.
	Active   string          `json:"active"`
	Clusters []ClusterHealth `json:"clusters"`
	Leader   string          `json:"leader"`
	Updated  time.Time       `json:"updated"`
}

// ClusterHealth is one source cluster in a ClusterState.
type ClusterHealth struct {
	Name string `json:"name"`
	// Place is its place in the order of preference: 0 for the primary,
	// then the standbys by priority.
	Place int `json:"place"`
	// Reached counts the live agents whose last probe reached it, of
	// Agents; Up is whether they are a quorum, since Since (the start of
	// the quorum's reach, or of its loss; zero when not known).
	Reached int       `json:"reached"`
	Agents  int       `json:"agents"`
	Up      bool      `json:"up"`
	Since   time.Time `json:"since,omitzero"`
	// Behind and Lacking say how far it is behind the active cluster,
	// by the fingerprint translation of the fleet's positions there:
	// the partitions whose last consumed record it lacks, and how many
	// consumed records it lacks in all (where the translation could
	// tell). -1 when not checked: the active cluster itself, a cluster a
	// quorum does not reach, or before the first check. Checked is when.
	Behind  int       `json:"behind"`
	Lacking int64     `json:"lacking"`
	Checked time.Time `json:"checked,omitzero"`
}

// ParseClusterState decodes a state/clusters value.
func ParseClusterState(val []byte) (ClusterState, error) {
	var c ClusterState
	if len(val) > 64<<10 {
		return c, fmt.Errorf("state: state/clusters is %d bytes, over the 64 KiB limit", len(val))
	}
	if err := json.Unmarshal(val, &c); err != nil {
		return c, fmt.Errorf("state: state/clusters is not valid JSON: %w", err)
	}
	return c, nil
}

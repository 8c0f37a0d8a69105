package coordinator

// ClusterView is one agent's view of one Kafka cluster, from its probes,
// as gossiped to the fleet.
type ClusterView struct {
	// Reachable is the result of the last probe.
	Reachable bool `json:"ok"`
	// LatencyMs is the last successful probe's round trip.
	LatencyMs int64 `json:"ms,omitempty"`
	// Error is the last failed probe's error, shortened.
	Error string `json:"err,omitempty"`
}

// AgentViews maps agent id → cluster name → that agent's view.
type AgentViews map[string]map[string]ClusterView

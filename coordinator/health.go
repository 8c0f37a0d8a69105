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
	// FailingMs is, when not Reachable, how long before this view was
	// made the agent last reached the cluster (or began probing it): a
	// duration on the agent's clock, which the leader subtracts from the
	// time it sees the view, so that the failure window counts from the
	// last contact rather than from the first failed probe, without
	// comparing two machines' clocks.
	FailingMs int64 `json:"fail_ms,omitempty"`
	// Refused is, when not Reachable, whether the last probe found every
	// broker refusing connections and none timing out: a hard failure,
	// judged over failover.hard_failure_window when every agent sees it.
	Refused bool `json:"refused,omitempty"`
}

// AgentViews maps agent id → cluster name → that agent's view.
type AgentViews map[string]map[string]ClusterView

package state

import (
	"encoding/json"
	"fmt"
	"slices"
	"time"
)

// Phases of state/active.
const (
	// PhaseActive: the fleet consumes Cluster.
	PhaseActive = "active"
	// PhaseSwitching: the fleet is moving from From to Cluster; partitions
	// are being released on From and their positions translated. Nobody
	// consumes Cluster until the phase is active.
	PhaseSwitching = "switching"
)

// Active is the value of state/active: which cluster the fleet consumes.
type Active struct {
	Cluster string `json:"cluster"`
	// Epoch grows by one with every switch.
	Epoch int64 `json:"epoch"`
	// Phase is PhaseActive or PhaseSwitching.
	Phase string `json:"phase"`
	// From is the cluster a switch in progress (or the last one) left.
	From   string    `json:"from,omitempty"`
	Reason string    `json:"reason"`
	Since  time.Time `json:"since"`
	Leader string    `json:"leader"`
	Token  int64     `json:"fencing_token"`
	// Automatic is set when the health verdict (not a pin) decided the
	// switch, so that a leader resuming it counts it for the breaker.
	Automatic bool `json:"automatic,omitempty"`
	// Topics lists the logical topics that are not where the fleet is:
	// placed on another cluster (a topic pin), or in a switch of their
	// own. A topic absent here follows the fleet.
	Topics map[string]TopicActive `json:"topics,omitempty"`
}

// TopicActive is where one logical topic is consumed when it is not where
// the fleet is (Active.Topics), and the topic switch that put it there.
type TopicActive struct {
	Cluster string `json:"cluster"`
	// Phase is PhaseActive, or PhaseSwitching while the topic moves from
	// From to Cluster (its partitions released on From, its positions
	// being translated).
	Phase string `json:"phase"`
	From  string `json:"from,omitempty"`
	// Epoch is the epoch of the switch that moved the topic here
	// (history/<epoch>).
	Epoch     int64     `json:"epoch"`
	Reason    string    `json:"reason"`
	Since     time.Time `json:"since"`
	Automatic bool      `json:"automatic,omitempty"`
}

// TopicCluster returns the cluster logical topic is consumed on, or moving
// to, and whether it is moving (nobody consumes it then).
func (a Active) TopicCluster(logical string) (cluster string, switching bool) {
	if e, ok := a.Topics[logical]; ok {
		return e.Cluster, e.Phase == PhaseSwitching
	}
	return a.Cluster, a.Phase == PhaseSwitching
}

// PositionsOf returns the cluster that holds logical's committed positions:
// where it is consumed, or the cluster its switch in progress left.
func (a Active) PositionsOf(logical string) string {
	if e, ok := a.Topics[logical]; ok {
		if e.Phase == PhaseSwitching {
			return e.From
		}
		return e.Cluster
	}
	if a.Phase == PhaseSwitching {
		return a.From
	}
	return a.Cluster
}

// Placed returns the clusters other than a.Cluster that topics are consumed
// on or moving to, sorted.
func (a Active) Placed() []string {
	var out []string
	for _, e := range a.Topics {
		if e.Cluster != a.Cluster && !slices.Contains(out, e.Cluster) {
			out = append(out, e.Cluster)
		}
	}
	slices.Sort(out)
	return out
}

// TopicSwitching returns the topics in a switch of their own, sorted.
func (a Active) TopicSwitching() []string {
	var out []string
	for t, e := range a.Topics {
		if e.Phase == PhaseSwitching {
			out = append(out, t)
		}
	}
	slices.Sort(out)
	return out
}

// maxTopicEntries bounds state/active's topics.
const maxTopicEntries = 10000

// ParseActive decodes and checks a state/active value.
func ParseActive(val []byte) (Active, error) {
	var a Active
	if len(val) > 64<<10 {
		return a, fmt.Errorf("state: state/active is %d bytes, over the 64 KiB limit", len(val))
	}
	if err := json.Unmarshal(val, &a); err != nil {
		return a, fmt.Errorf("state: state/active is not valid JSON: %w", err)
	}
	if a.Cluster == "" || a.Epoch <= 0 || (a.Phase != PhaseActive && a.Phase != PhaseSwitching) {
		return a, fmt.Errorf("state: state/active %q: needs a cluster, a positive epoch and phase active or switching", val)
	}
	if len(a.Topics) > maxTopicEntries {
		return a, fmt.Errorf("state: state/active places %d topics, over the limit of %d", len(a.Topics), maxTopicEntries)
	}
	for t, e := range a.Topics {
		switch {
		case t == "" || e.Cluster == "" || e.Epoch <= 0:
			return a, fmt.Errorf("state: state/active, topic %q: needs a name, a cluster and a positive epoch", t)
		case e.Phase != PhaseActive && e.Phase != PhaseSwitching:
			return a, fmt.Errorf("state: state/active, topic %q: phase %q is neither active nor switching", t, e.Phase)
		case e.Phase == PhaseSwitching && e.From == "":
			return a, fmt.Errorf("state: state/active, topic %q: a switch in progress needs the cluster it leaves (from)", t)
		case e.Phase == PhaseActive && e.Cluster == a.Cluster && a.Phase == PhaseActive:
			// (During a fleet switch, the topics already on its target
			// are listed so: their positions are there, not on From.)
			return a, fmt.Errorf("state: state/active, topic %q: placed on %s, where the fleet is; such a topic is not listed", t, e.Cluster)
		}
	}
	return a, nil
}

// FailbackCheck is the value of state/failback: the leader's last check
// of whether the primary holds everything the fleet consumed on the
// standby (the failback gate), written when its outcome changes.
type FailbackCheck struct {
	// Standby and Epoch are the active cluster and epoch checked: the
	// value is stale once the fleet is elsewhere.
	Standby string `json:"standby"`
	Epoch   int64  `json:"epoch"`
	// To is the cluster checked for the failback: the primary, or a
	// standby preferred to the active one. Empty in values written
	// before there could be several standbys: the primary.
	To string `json:"to,omitempty"`
	// CaughtUp is the outcome; Reason says why not, Behind counts the
	// partitions behind.
	CaughtUp bool      `json:"caught_up"`
	Reason   string    `json:"reason,omitempty"`
	Behind   int       `json:"behind"`
	Checked  time.Time `json:"checked"`
	Leader   string    `json:"leader"`
}

// ParseFailbackCheck decodes a state/failback value.
func ParseFailbackCheck(val []byte) (FailbackCheck, error) {
	var c FailbackCheck
	if len(val) > 64<<10 {
		return c, fmt.Errorf("state: state/failback is %d bytes, over the 64 KiB limit", len(val))
	}
	if err := json.Unmarshal(val, &c); err != nil {
		return c, fmt.Errorf("state: state/failback is not valid JSON: %w", err)
	}
	return c, nil
}

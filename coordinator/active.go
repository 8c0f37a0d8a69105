package coordinator

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

	// unwritten marks a value the leader recovered (state/active absent
	// or unusable): it writes it at once.
	unwritten bool
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
		return a, fmt.Errorf("coordinator: state/active is %d bytes, over the 64 KiB limit", len(val))
	}
	if err := json.Unmarshal(val, &a); err != nil {
		return a, fmt.Errorf("coordinator: state/active is not valid JSON: %w", err)
	}
	if a.Cluster == "" || a.Epoch <= 0 || (a.Phase != PhaseActive && a.Phase != PhaseSwitching) {
		return a, fmt.Errorf("coordinator: state/active %q: needs a cluster, a positive epoch and phase active or switching", val)
	}
	if len(a.Topics) > maxTopicEntries {
		return a, fmt.Errorf("coordinator: state/active places %d topics, over the limit of %d", len(a.Topics), maxTopicEntries)
	}
	for t, e := range a.Topics {
		switch {
		case t == "" || e.Cluster == "" || e.Epoch <= 0:
			return a, fmt.Errorf("coordinator: state/active, topic %q: needs a name, a cluster and a positive epoch", t)
		case e.Phase != PhaseActive && e.Phase != PhaseSwitching:
			return a, fmt.Errorf("coordinator: state/active, topic %q: phase %q is neither active nor switching", t, e.Phase)
		case e.Phase == PhaseSwitching && e.From == "":
			return a, fmt.Errorf("coordinator: state/active, topic %q: a switch in progress needs the cluster it leaves (from)", t)
		case e.Phase == PhaseActive && e.Cluster == a.Cluster && a.Phase == PhaseActive:
			// (During a fleet switch, the topics already on its target
			// are listed so: their positions are there, not on From.)
			return a, fmt.Errorf("coordinator: state/active, topic %q: placed on %s, where the fleet is; such a topic is not listed", t, e.Cluster)
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
		return c, fmt.Errorf("coordinator: state/failback is %d bytes, over the 64 KiB limit", len(val))
	}
	if err := json.Unmarshal(val, &c); err != nil {
		return c, fmt.Errorf("coordinator: state/failback is not valid JSON: %w", err)
	}
	return c, nil
}

// SwitchEvent is one entry of history/: a cluster switch as it happened.
type SwitchEvent struct {
	Epoch    int64     `json:"epoch"`
	From     string    `json:"from"`
	To       string    `json:"to"`
	Reason   string    `json:"reason"`
	Started  time.Time `json:"started"`
	Finished time.Time `json:"finished"`
	// Phases are the durations of prepare (planned switches: warm-up and
	// pre-translation, while the fleet still consumed From), revoke
	// (release on From), translate (of which replica_wait: a planned
	// switch waiting for the replica to hold what the fleet consumed) and
	// activate, in seconds.
	Phases     map[string]float64 `json:"phases_seconds"`
	Partitions []PartitionSwitch  `json:"partitions"`
	// PartitionChunks, when set, says that Partitions did not fit in one
	// etcd value (etcd refuses a request over --max-request-bytes, 1.5 MiB
	// by default: about 5 000 partitions): they are under
	// history/partitions/<epoch>/ in PartitionChunks keys, PartitionCount
	// of them, and Methods counts them by translation method.
	// LoadPartitions reads them back into Partitions.
	PartitionChunks int            `json:"partition_chunks,omitempty"`
	PartitionCount  int            `json:"partition_count,omitempty"`
	Methods         map[string]int `json:"methods,omitempty"`
	// Topics, when set, are the logical topics a topic switch moved; the
	// other topics stayed where they were, consumed throughout. Unset: the
	// fleet switched.
	Topics []string `json:"topics,omitempty"`
	Leader string   `json:"leader"`
	Token  int64    `json:"fencing_token"`
	// Automatic: decided by the health verdict (failover, failback), not
	// by a pin. The circuit breaker counts these.
	Automatic bool `json:"automatic,omitempty"`
	// Abandoned, when set, says why the switch was given up: the fleet
	// went back to From and Partitions is empty.
	Abandoned string `json:"abandoned,omitempty"`
	// Late is the unmirrored tail of a failback, over every partition
	// (PartitionSwitch.Late), and LateBySeconds how late its oldest record
	// is at the latest: from its timestamp to the end of this switch.
	Late          int64   `json:"late,omitempty"`
	LateBySeconds float64 `json:"late_by_seconds,omitempty"`
	// LateCounted says the tail was counted: the leader writes a
	// failback's entry first without it, and again once it has read the
	// tail (a term that ends first leaves it unset).
	LateCounted bool `json:"late_counted,omitempty"`
}

// PartitionSwitch is how one partition's position moved in a switch.
type PartitionSwitch struct {
	// Topic is the logical topic.
	Topic string `json:"topic"`
	// Origin is the cluster whose producers write this physical topic
	// (its local topic there); FromTopic and ToTopic are its names on the
	// two clusters (orders and A.orders for the primary's records, B.orders
	// and orders for the standby's under the prefix policy).
	Origin     string `json:"origin,omitempty"`
	FromTopic  string `json:"from_topic,omitempty"`
	ToTopic    string `json:"to_topic,omitempty"`
	Partition  int32  `json:"partition"`
	FromOffset int64  `json:"from_offset"`
	ToOffset   int64  `json:"to_offset"`
	Method     string `json:"method"`
	// Rewound is how many records are delivered again, -1 when unknown.
	Rewound int64 `json:"rewound"`
	// Lagged is how many consumed records the target lacked at the
	// switch; they are delivered again if the replicator copies them.
	Lagged int64  `json:"lagged,omitempty"`
	Detail string `json:"detail,omitempty"`
	// Late (failbacks) counts the records of the unmirrored tail: written
	// to the primary before the failover this failback ends, not copied
	// to the standby by then, so consumed only after the primary returned
	// (from the standby once the replicator copied them, or from the
	// primary after this switch). LateOldest is the oldest one's
	// timestamp.
	Late       int64     `json:"late,omitempty"`
	LateOldest time.Time `json:"late_oldest,omitzero"`
	// ToEnd is the target partition's end at the translation: at a
	// failover, how far the replica held the primary's records (the
	// failback that follows counts the unmirrored tail from it).
	ToEnd int64 `json:"to_end,omitempty"`
}

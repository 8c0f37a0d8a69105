package state

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/keys"
)

// A value under history/ may claim at most maxHistoryChunks chunks of
// partitions (4 million partitions): a stranger's count must not make a
// reader allocate without bound.
const maxHistoryChunks = 4096

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

// maxSwitchEventSize bounds what is parsed from history/: an event lists a
// translation per partition, so it grows with the topics, but a value
// written there by a stranger must not make a leader allocate without
// bound.
const maxSwitchEventSize = 4 << 20

// ParseSwitchEvent decodes and checks a history/<epoch> value.
func ParseSwitchEvent(val []byte) (SwitchEvent, error) {
	var ev SwitchEvent
	if len(val) > maxSwitchEventSize {
		return ev, fmt.Errorf("state: switch event is %d bytes, over the %d-byte limit", len(val), maxSwitchEventSize)
	}
	if err := json.Unmarshal(val, &ev); err != nil {
		return ev, fmt.Errorf("state: switch event is not valid JSON: %w", err)
	}
	if ev.Epoch <= 0 || ev.To == "" {
		return ev, fmt.Errorf("state: switch event needs a positive epoch and a cluster switched to (epoch %d, to %q)", ev.Epoch, ev.To)
	}
	if ev.PartitionChunks < 0 || ev.PartitionCount < 0 || ev.PartitionChunks > ev.PartitionCount || ev.PartitionChunks > maxHistoryChunks {
		return ev, fmt.Errorf("state: switch event of epoch %d has %d chunks of %d partitions", ev.Epoch, ev.PartitionChunks, ev.PartitionCount)
	}
	return ev, nil
}

// LoadPartitions reads back into ev.Partitions the partitions of a switch
// that kept them in chunks (ev.PartitionChunks); an event that holds them
// itself is left as it is.
func LoadPartitions(ctx context.Context, kv clientv3.KV, k keys.Fleet, ev *SwitchEvent) error {
	if ev.PartitionChunks == 0 {
		return nil
	}
	prefix := k.HistoryPartitions(ev.Epoch)
	resp, err := kv.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return fmt.Errorf("state: read the partitions of switch %d: %w", ev.Epoch, err)
	}
	chunks := make([][]PartitionSwitch, ev.PartitionChunks)
	for _, kv := range resp.Kvs {
		n, err := strconv.Atoi(strings.TrimPrefix(string(kv.Key), prefix))
		if err != nil || n < 0 || n >= len(chunks) {
			continue // a chunk of an earlier write with more of them
		}
		if len(kv.Value) > maxSwitchEventSize {
			return fmt.Errorf("state: %s is %d bytes, over the %d-byte limit", kv.Key, len(kv.Value), maxSwitchEventSize)
		}
		if err := json.Unmarshal(kv.Value, &chunks[n]); err != nil {
			return fmt.Errorf("state: %s is not a list of partitions: %w", kv.Key, err)
		}
	}
	parts := slices.Concat(chunks...)
	if len(parts) != ev.PartitionCount {
		return fmt.Errorf("state: switch %d lists %d partitions, %s holds %d of them", ev.Epoch, ev.PartitionCount, prefix, len(parts))
	}
	ev.Partitions = parts
	return nil
}

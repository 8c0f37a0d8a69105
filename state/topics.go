package state

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/keys"
)

// Kinds of TopicEvent.
const (
	// TopicRecreated: the topic's id changed; the topic was deleted and
	// created again under the same name. Its partitions are consumed
	// from their start.
	TopicRecreated = "recreated"
	// TopicPartitionsAdded: the topic has more partitions than before.
	TopicPartitionsAdded = "partitions_added"
	// TopicPartitionsRemoved: the topic has fewer partitions than before
	// (only a re-creation does that in Kafka).
	TopicPartitionsRemoved = "partitions_removed"
)

// TopicEvent is a history/topics/<n> value: a change of a source topic's
// lifecycle that the leader's discovery found.
type TopicEvent struct {
	At      time.Time `json:"at"`
	Kind    string    `json:"kind"`
	Cluster string    `json:"cluster"`
	Topic   string    `json:"topic"`
	// OldID and NewID are the topic ids before and after ("" unknown).
	OldID string `json:"old_id,omitempty"`
	NewID string `json:"new_id,omitempty"`
	// OldPartitions and NewPartitions are the partition counts.
	OldPartitions int    `json:"old_partitions"`
	NewPartitions int    `json:"new_partitions"`
	Leader        string `json:"leader"`
}

func (e TopicEvent) String() string {
	return fmt.Sprintf("%s %s on %s: %s", e.At.UTC().Format(time.RFC3339), e.Topic, e.Cluster, e.Change())
}

// Change says what happened to the topic, without when or which.
func (e TopicEvent) Change() string {
	switch e.Kind {
	case TopicRecreated:
		return fmt.Sprintf("deleted and created again (id %s -> %s, %d -> %d partitions), consumed from its start",
			e.OldID, e.NewID, e.OldPartitions, e.NewPartitions)
	case TopicPartitionsAdded:
		return fmt.Sprintf("partitions added: %d -> %d", e.OldPartitions, e.NewPartitions)
	default:
		return fmt.Sprintf("partitions removed: %d -> %d", e.OldPartitions, e.NewPartitions)
	}
}

// maxTopicEventSize bounds what is parsed from history/topics/.
const maxTopicEventSize = 4 << 10

// ParseTopicEvent decodes and checks a history/topics/<n> value.
func ParseTopicEvent(val []byte) (TopicEvent, error) {
	var ev TopicEvent
	if len(val) > maxTopicEventSize {
		return ev, fmt.Errorf("state: topic event is %d bytes, over the %d-byte limit", len(val), maxTopicEventSize)
	}
	if err := json.Unmarshal(val, &ev); err != nil {
		return ev, fmt.Errorf("state: topic event is not valid JSON: %w", err)
	}
	switch {
	case ev.Kind != TopicRecreated && ev.Kind != TopicPartitionsAdded && ev.Kind != TopicPartitionsRemoved:
		return ev, fmt.Errorf("state: topic event of kind %q, want %s, %s or %s", ev.Kind, TopicRecreated, TopicPartitionsAdded, TopicPartitionsRemoved)
	case keys.ValidName(ev.Cluster) != nil || keys.ValidName(ev.Topic) != nil:
		return ev, fmt.Errorf("state: topic event names cluster %q, topic %q", ev.Cluster, ev.Topic)
	case ev.OldPartitions < 0 || ev.NewPartitions < 0:
		return ev, fmt.Errorf("state: topic event of %s has %d -> %d partitions", ev.Topic, ev.OldPartitions, ev.NewPartitions)
	}
	return ev, nil
}

// ReadTopicEvents returns the last n lifecycle events of the fleet's
// source topics, oldest first, and the values it refused.
func ReadTopicEvents(ctx context.Context, kv clientv3.KV, k keys.Fleet, n int64) ([]TopicEvent, []error, error) {
	resp, err := kv.Get(ctx, k.TopicHistory(), clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortDescend), clientv3.WithLimit(n))
	if err != nil {
		return nil, nil, fmt.Errorf("state: read %s: %w", k.TopicHistory(), err)
	}
	var evs []TopicEvent
	var bad []error
	for i := len(resp.Kvs) - 1; i >= 0; i-- {
		ev, err := ParseTopicEvent(resp.Kvs[i].Value)
		if err != nil {
			bad = append(bad, fmt.Errorf("%s: %w", resp.Kvs[i].Key, err))
			continue
		}
		evs = append(evs, ev)
	}
	return evs, bad, nil
}

package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/IBM/sarama"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/keys"
)

// TopicMeta is what a Metadata request says of one topic.
type TopicMeta struct {
	// ID is the topic's identity, "<cluster id>/<topic id>" (see
	// record.SameTopic; "" when the cluster speaks a Metadata version
	// without ids, before Kafka 2.8): a topic deleted and created again
	// under the same name has a new one.
	ID string
	// Partitions are the partition ids, in the broker's order.
	Partitions []int32
}

// DescribeTopics asks one broker of client for the metadata of topics (of
// every topic when topics is empty) and returns those that exist, by
// name. The request is the one sarama's own refresh sends, at the version
// the client's Kafka version allows (11 from Kafka 2.8: topic ids), so it
// costs the cluster what a refresh does; sarama's client keeps the ids to
// itself. A broker that fails is given up once for the client's own
// refresh, which rotates brokers, and asked again.
func DescribeTopics(client sarama.Client, topics []string) (map[string]TopicMeta, error) {
	resp, err := describe(client, topics)
	if err != nil {
		if rerr := client.RefreshMetadata(topics...); rerr != nil && !errors.Is(rerr, sarama.ErrUnknownTopicOrPartition) {
			return nil, fmt.Errorf("coordinator: metadata: %w", errors.Join(err, rerr))
		}
		if resp, err = describe(client, topics); err != nil {
			return nil, fmt.Errorf("coordinator: metadata: %w", err)
		}
	}
	out := make(map[string]TopicMeta, len(resp.Topics))
	for _, t := range resp.Topics {
		if t == nil || !errors.Is(t.Err, sarama.ErrNoError) {
			continue // missing (ErrUnknownTopicOrPartition), being created or deleted
		}
		m := TopicMeta{Partitions: make([]int32, 0, len(t.Partitions))}
		if t.Uuid != (sarama.Uuid{}) {
			m.ID = t.Uuid.String()
			if resp.ClusterID != nil && *resp.ClusterID != "" {
				m.ID = *resp.ClusterID + "/" + m.ID
			}
		}
		for _, p := range t.Partitions {
			m.Partitions = append(m.Partitions, p.ID)
		}
		out[t.Name] = m
	}
	return out, nil
}

func describe(client sarama.Client, topics []string) (*sarama.MetadataResponse, error) {
	b := client.LeastLoadedBroker()
	if b == nil {
		return nil, sarama.ErrOutOfBrokers
	}
	req := sarama.NewMetadataRequest(client.Config().Version, topics)
	req.AllowAutoTopicCreation = false
	return b.GetMetadata(req)
}

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
		return ev, fmt.Errorf("coordinator: topic event is %d bytes, over the %d-byte limit", len(val), maxTopicEventSize)
	}
	if err := json.Unmarshal(val, &ev); err != nil {
		return ev, fmt.Errorf("coordinator: topic event is not valid JSON: %w", err)
	}
	switch {
	case ev.Kind != TopicRecreated && ev.Kind != TopicPartitionsAdded && ev.Kind != TopicPartitionsRemoved:
		return ev, fmt.Errorf("coordinator: topic event of kind %q, want %s, %s or %s", ev.Kind, TopicRecreated, TopicPartitionsAdded, TopicPartitionsRemoved)
	case keys.ValidName(ev.Cluster) != nil || keys.ValidName(ev.Topic) != nil:
		return ev, fmt.Errorf("coordinator: topic event names cluster %q, topic %q", ev.Cluster, ev.Topic)
	case ev.OldPartitions < 0 || ev.NewPartitions < 0:
		return ev, fmt.Errorf("coordinator: topic event of %s has %d -> %d partitions", ev.Topic, ev.OldPartitions, ev.NewPartitions)
	}
	return ev, nil
}

// writeTopicEvent records ev under history/topics/, fenced by term.
func writeTopicEvent(ctx context.Context, term election.Term, k keys.Fleet, ev TopicEvent) error {
	val, err := json.Marshal(ev)
	if err != nil {
		return err
	}
	_, err = term.Txn(ctx, nil, clientv3.OpPut(k.TopicEvent(ev.At.UnixNano()), string(val)))
	return err
}

// ReadTopicEvents returns the last n lifecycle events of the fleet's
// source topics, oldest first, and the values it refused.
func ReadTopicEvents(ctx context.Context, kv clientv3.KV, k keys.Fleet, n int64) ([]TopicEvent, []error, error) {
	resp, err := kv.Get(ctx, k.TopicHistory(), clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortDescend), clientv3.WithLimit(n))
	if err != nil {
		return nil, nil, fmt.Errorf("coordinator: read %s: %w", k.TopicHistory(), err)
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

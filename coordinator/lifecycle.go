package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/IBM/sarama"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
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
	return topicMetas(resp), nil
}

// DescribeTopicsOnce is DescribeTopics without the second try: one
// request, so one read timeout at most when the cluster hangs (the
// refresh and the second try took 32 s and more), for a caller that can
// do without the answer.
func DescribeTopicsOnce(client sarama.Client, topics []string) (map[string]TopicMeta, error) {
	resp, err := describe(client, topics)
	if err != nil {
		return nil, fmt.Errorf("coordinator: metadata: %w", err)
	}
	return topicMetas(resp), nil
}

// topicMetas returns the topics of resp that exist, by name.
func topicMetas(resp *sarama.MetadataResponse) map[string]TopicMeta {
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
	return out
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

// writeTopicEvent records ev under history/topics/, fenced by term.
func writeTopicEvent(ctx context.Context, term election.Term, k keys.Fleet, ev state.TopicEvent) error {
	val, err := json.Marshal(ev)
	if err != nil {
		return err
	}
	_, err = term.Txn(ctx, nil, clientv3.OpPut(k.TopicEvent(ev.At.UnixNano()), string(val)))
	return err
}

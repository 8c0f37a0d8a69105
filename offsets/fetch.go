package offsets

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/internal/kafka"
)

// minOffsetFetchVersion is the oldest OffsetFetch version sent: Kafka 4.0
// removed v0 (KIP-896), which read offsets from ZooKeeper.
const minOffsetFetchVersion = 1

// Fetch reads the group's committed offsets of tps with one OffsetFetch
// request to the group's coordinator: the position a consumer of the
// group resumes from, whoever committed it (this fleet's mirror, another
// fleet that shares the group, a Kafka consumer, MirrorMaker 2's
// checkpoint sync). A partition the group has no offset for is absent
// from the map; so is one whose answer carries an error, which the
// returned error names. A group that does not exist has no offsets (no
// error).
//
// Retries, timeout and recovery are Commit's: one retry after looking
// the coordinator up again, the whole call bounded by the mirror's
// timeout and ctx (ctx.Err() is returned unwrapped).
func (m *KafkaMirror) Fetch(ctx context.Context, tps []TopicPartition) (map[TopicPartition]int64, error) {
	out := make(map[TopicPartition]int64, len(tps))
	if len(tps) == 0 {
		return out, nil // no partitions would mean "all of them"
	}
	partitions := map[string][]int32{}
	asked := map[TopicPartition]bool{}
	for _, tp := range tps {
		if !asked[tp] {
			asked[tp] = true
			partitions[tp.Topic] = append(partitions[tp.Topic], tp.Partition)
		}
	}
	req := sarama.NewOffsetFetchRequest(m.client.Config().Version, m.group, partitions)
	if req.Version < minOffsetFetchVersion {
		req.Version = minOffsetFetchVersion
	}
	ctx, cancel := context.WithTimeout(ctx, m.timeout)
	defer cancel()

	var resp *sarama.OffsetFetchResponse
	var err error
	for attempt := range 2 {
		if attempt > 0 {
			if rerr := kafka.Call(ctx, func() error { return m.client.RefreshCoordinator(m.group) }); rerr != nil {
				return nil, m.wrapFetch(ctx, rerr)
			}
		}
		err = kafka.Call(ctx, func() error {
			b, err := m.client.Coordinator(m.group)
			if err != nil {
				return err
			}
			r, err := b.FetchOffset(req)
			kafka.CloseOnTransportError(b, err)
			if err != nil {
				return err
			}
			if gerr := r.GroupError(); gerr != sarama.ErrNoError {
				return gerr
			}
			resp = r // read only once Call returned
			return nil
		})
		if err == nil || !kafka.RetriableError(err) || ctx.Err() != nil {
			break
		}
	}
	if errors.Is(err, sarama.ErrGroupIDNotFound) {
		return out, nil
	}
	if err != nil {
		return nil, m.wrapFetch(ctx, err)
	}
	var errs []error
	for _, tp := range slices.SortedFunc(maps.Keys(asked), TopicPartition.Compare) {
		b := resp.GetBlock(tp.Topic, tp.Partition)
		switch {
		case b == nil || b.Offset < 0 && b.Err == sarama.ErrNoError:
			// Nothing committed.
		case b.Err != sarama.ErrNoError:
			errs = append(errs, fmt.Errorf("%s: %w", tp, b.Err))
		default:
			out[tp] = b.Offset
		}
	}
	return out, m.wrapFetch(ctx, errors.Join(errs...))
}

func (m *KafkaMirror) wrapFetch(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	if ctxErr := ctx.Err(); ctxErr != nil && errors.Is(err, ctxErr) {
		return err
	}
	return fmt.Errorf("offsets: fetch the committed offsets of group %q: %w", m.group, err)
}

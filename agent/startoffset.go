package agent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/IBM/sarama"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/state"
)

// maxLoggedStarts bounds the partitions a start's log line lists by name:
// at 1 200 partitions the line gives the count and the first ones.
const maxLoggedStarts = 20

// groupStarts returns where those of tps that have no position in etcd
// (positions) start when the Kafka group source.group holds a committed
// offset for them on cluster: a fleet whose etcd has no position (a new
// fleet name, etcd restored empty) resumes where the group's consumers
// left off (another fleet of the same group, this fleet's mirror, a Kafka
// consumer the fleet replaces) instead of at source.initial_offset. The
// group's offsets name the physical topics of cluster, as tps do.
//
// One OffsetFetch asks for every partition of tps without a position,
// and one ListOffsets per partition leader for the log start and one for
// the end of those the group has an offset for, each bounded by the
// worker's request timeout (etcd.request_timeout, as the group mirror). A group's offset outside
// the log (its records deleted by retention, or the topic created again
// shorter) is not used: the partition starts at source.initial_offset, as
// a Kafka consumer's auto.offset.reset would, and the log line says so.
//
// An error means the group or the logs could not be read for a reason
// that may pass (the coordinator moving or loading, a broken connection,
// the request timeout): the caller keeps the partitions pending and
// tries again rather than guess. A refusal that stays (the group's ACL,
// say) is logged and the partitions start at source.initial_offset, as
// before the group was read.
func (w *worker) groupStarts(ctx context.Context, k *kafkaConn, cluster string, tps []state.TopicPartition,
	positions map[state.TopicPartition]offsets.Position) (map[state.TopicPartition]int64, error) {
	var without []state.TopicPartition
	for _, tp := range tps {
		if _, ok := positions[tp]; !ok {
			without = append(without, tp)
		}
	}
	if len(without) == 0 {
		return nil, nil
	}
	group := w.cfg.Source.Group
	log := w.log.With(zap.String("cluster", cluster), zap.String("group", group), zap.Int64("generation", w.applied.Generation))
	committed, err := k.mirror.Fetch(ctx, without)
	switch {
	case err == nil:
	case ctx.Err() != nil || errors.Is(err, context.DeadlineExceeded) || kafka.RetriableError(err):
		return nil, err
	default:
		log.Warn("cannot read the group's committed offsets; partitions the group has no offset read for start at source.initial_offset",
			zap.Int("partitions", len(without)), zap.String("initial_offset", w.initial), zap.Error(err))
	}
	if len(committed) == 0 {
		return nil, nil
	}
	// Bounded as the group's read is (dialKafka).
	lctx, cancel := context.WithTimeout(ctx, w.cfg.Etcd.RequestTimeout)
	bounds, err := logBounds(lctx, k.client, slices.SortedFunc(maps.Keys(committed), state.TopicPartition.Compare))
	cancel()
	if err != nil {
		// A leader moved: the retry asks the new one.
		topics := map[string]bool{}
		for tp := range committed {
			topics[tp.Topic] = true
		}
		_ = k.refresh(slices.Sorted(maps.Keys(topics)))
		return nil, fmt.Errorf("kafka: log bounds on cluster %s of the partitions source.group %q has offsets for: %w", cluster, group, err)
	}
	starts := make(map[state.TopicPartition]int64, len(committed))
	var used, outside []string
	for _, tp := range slices.SortedFunc(maps.Keys(committed), state.TopicPartition.Compare) {
		off, b := committed[tp], bounds[tp]
		if off < b.start || off > b.end {
			outside = append(outside, fmt.Sprintf("%s=%d (log %d-%d)", tp, off, b.start, b.end))
			continue
		}
		starts[tp] = off
		used = append(used, fmt.Sprintf("%s=%d", tp, off))
	}
	if len(used) > 0 {
		log.Info("partitions without a position in etcd start at the group's committed offsets in Kafka",
			zap.Int("partitions", len(used)), zap.Strings("offsets", firstOf(used)))
	}
	if len(outside) > 0 {
		log.Warn("the group's committed offsets lie outside the partitions' logs; those partitions start at source.initial_offset",
			zap.Int("partitions", len(outside)), zap.Strings("offsets", firstOf(outside)), zap.String("initial_offset", w.initial))
	}
	return starts, nil
}

// firstOf returns the first maxLoggedStarts of s, and how many more there
// are.
func firstOf(s []string) []string {
	if len(s) <= maxLoggedStarts {
		return s
	}
	return append(slices.Clip(s[:maxLoggedStarts]), fmt.Sprintf("and %d more", len(s)-maxLoggedStarts))
}

// logBound is a partition's log start and end offsets.
type logBound struct{ start, end int64 }

// logBounds returns the log start and end offsets of tps: one ListOffsets
// request per partition leader for the starts and one for the ends,
// bounded by ctx. Any error fails the whole call, naming the partitions.
func logBounds(ctx context.Context, client sarama.Client, tps []state.TopicPartition) (map[state.TopicPartition]logBound, error) {
	byLeader := map[*sarama.Broker][]state.TopicPartition{}
	for _, tp := range tps {
		leader, err := client.Leader(tp.Topic, tp.Partition)
		if err != nil {
			return nil, fmt.Errorf("leader of %s: %w", tp, err)
		}
		byLeader[leader] = append(byLeader[leader], tp)
	}
	out := make(map[state.TopicPartition]logBound, len(tps))
	for leader, tps := range byLeader {
		for _, at := range []int64{sarama.OffsetOldest, sarama.OffsetNewest} {
			req := &sarama.OffsetRequest{Version: 1}
			for _, tp := range tps {
				req.AddBlock(tp.Topic, tp.Partition, at, 1)
			}
			var resp *sarama.OffsetResponse
			err := kafka.Call(ctx, func() error {
				r, err := leader.GetAvailableOffsets(req)
				kafka.CloseOnTransportError(leader, err)
				if err == nil {
					resp = r // read only once Call returned
				}
				return err
			})
			if err != nil {
				return nil, fmt.Errorf("list offsets on broker %d: %w", leader.ID(), err)
			}
			var errs []string
			for _, tp := range tps {
				blk := resp.GetBlock(tp.Topic, tp.Partition)
				switch {
				case blk == nil:
					errs = append(errs, tp.String()+": not answered")
				case blk.Err != sarama.ErrNoError:
					errs = append(errs, fmt.Sprintf("%s: %v", tp, blk.Err))
				default:
					b := out[tp]
					if at == sarama.OffsetOldest {
						b.start = blk.Offset
					} else {
						b.end = blk.Offset
					}
					out[tp] = b
				}
			}
			if len(errs) > 0 {
				return nil, fmt.Errorf("list offsets on broker %d: %s", leader.ID(), strings.Join(errs, "; "))
			}
		}
	}
	return out, nil
}

package offsets

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/internal/kafka"
)

// DefaultKafkaTimeout bounds a KafkaMirror.Commit whose timeout is not
// positive.
const DefaultKafkaTimeout = 10 * time.Second

// minOffsetCommitVersion is the oldest OffsetCommit version sent: Kafka 4.0
// removed v0 and v1 (KIP-896); v2 is understood by every broker since 0.9.
const minOffsetCommitVersion = 2

// KafkaMirror copies commits into a Kafka consumer group, so that Kafka
// tooling (kafka-consumer-groups, lag monitors, MirrorMaker 2's checkpoint
// connector) sees the fleet's position. It is safe for concurrent use and
// owns no goroutines beyond those of a call in flight (see Commit).
//
// The commits are standalone (simple) commits: generation -1 and no member
// id, as with Kafka's assign() consumers. Kafka accepts them only while the
// group has no active members: if a regular consumer group with the same
// name is running, the brokers answer UNKNOWN_MEMBER_ID or
// ILLEGAL_GENERATION per partition, and Commit returns those errors.
type KafkaMirror struct {
	client  sarama.Client
	group   string
	timeout time.Duration
}

// NewKafkaMirror returns a mirror committing into group through client.
// timeout bounds each Commit call (DefaultKafkaTimeout if not positive).
//
// client must be connected to the cluster whose offsets are mirrored:
// Commit cannot check that a Commit's Cluster is this client's cluster, so
// the caller passes only those commits.
func NewKafkaMirror(client sarama.Client, group string, timeout time.Duration) *KafkaMirror {
	if timeout <= 0 {
		timeout = DefaultKafkaTimeout
	}
	return &KafkaMirror{client: client, group: group, timeout: timeout}
}

// Commit commits the offsets of commits to the group with one OffsetCommit
// request to the group's coordinator. Errors of single partitions are
// joined into the returned error, each naming its partition; the other
// partitions are committed. If the coordinator has moved (a coordinator
// error, on the request or on any partition) or its connection broke, the
// coordinator is looked up again and the request is retried once.
//
// Version: the request version follows the client's Config.Version the way
// sarama's own offset manager does (v8 for Kafka 2.4 and later, which every
// supported broker and kfake accept), and is never below v2, the oldest
// version Kafka 4 still serves. The committed leader epoch is -1 (unknown):
// kswitch does not track leader epochs, and a made-up epoch could make Java
// consumers detect a false log truncation.
//
// Timeout: sarama's broker calls take no ctx. The whole call, coordinator
// lookup included, is bounded by the mirror's timeout and by ctx: when
// either expires Commit returns ctx.Err() (context.DeadlineExceeded for the
// timeout), while the abandoned sarama call goes on in the background until
// sarama's own Net.ReadTimeout (30 s by default) ends it. Set
// Net.ReadTimeout near the mirror timeout so abandoned calls do not pile up
// against a hung cluster. Whether an abandoned commit was applied is
// unknown; the next commit overwrites it anyway.
//
// Recovery: after a read timeout sarama keeps the broker connection but
// fails every later request on it at once; the mirror closes the
// coordinator connection after any transport error (see
// kafka.CloseOnTransportError), so a later Commit reconnects once the cluster
// answers again, about Net.ReadTimeout after the hang began at the latest.
func (m *KafkaMirror) Commit(ctx context.Context, commits []Commit) error {
	if len(commits) == 0 {
		return nil
	}
	req := newCommitRequest(m.client.Config(), m.group, commits)
	ctx, cancel := context.WithTimeout(ctx, m.timeout)
	defer cancel()

	var err error
	for attempt := range 2 {
		if attempt > 0 {
			if rerr := kafka.Call(ctx, func() error { return m.client.RefreshCoordinator(m.group) }); rerr != nil {
				return m.wrap(ctx, rerr)
			}
		}
		var resp *sarama.OffsetCommitResponse
		err = kafka.Call(ctx, func() error {
			b, err := m.client.Coordinator(m.group)
			if err != nil {
				return err
			}
			resp, err = b.CommitOffset(req)
			kafka.CloseOnTransportError(b, err)
			return err
		})
		if err == nil {
			err = m.partitionErrors(resp)
		}
		if err == nil || !kafka.RetriableError(err) || ctx.Err() != nil {
			break
		}
	}
	return m.wrap(ctx, err)
}

// newCommitRequest builds the standalone OffsetCommit request of commits
// (see KafkaMirror.Commit on the version).
func newCommitRequest(conf *sarama.Config, group string, commits []Commit) *sarama.OffsetCommitRequest {
	req := sarama.NewOffsetCommitRequest(conf, group) // generation -1, no member id
	if req.Version < minOffsetCommitVersion {
		req.Version = minOffsetCommitVersion
		req.RetentionTime = -1 // the broker's offsets.retention.minutes
	}
	for _, c := range commits {
		req.AddBlockWithLeaderEpoch(c.Topic, c.Partition, c.Offset, -1, 0, "")
	}
	return req
}

func (m *KafkaMirror) wrap(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	if ctxErr := ctx.Err(); ctxErr != nil && errors.Is(err, ctxErr) {
		return err
	}
	return fmt.Errorf("offsets: mirror commit to group %q: %w", m.group, err)
}

// partitionErrors joins the per-partition errors of resp, sorted by
// partition, or returns nil.
func (m *KafkaMirror) partitionErrors(resp *sarama.OffsetCommitResponse) error {
	type perr struct {
		tp  TopicPartition
		err sarama.KError
	}
	var errs []perr
	for topic, ps := range resp.Errors {
		for p, kerr := range ps {
			if kerr != sarama.ErrNoError {
				errs = append(errs, perr{TopicPartition{Topic: topic, Partition: p}, kerr})
			}
		}
	}
	if len(errs) == 0 {
		return nil
	}
	slices.SortFunc(errs, func(a, b perr) int { return a.tp.Compare(b.tp) })
	joined := make([]error, len(errs))
	for i, e := range errs {
		joined[i] = fmt.Errorf("%s: %w", e.tp, e.err)
	}
	return errors.Join(joined...)
}

package offsets

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/internal/kafka"
)

// DefaultKafkaTimeout bounds a KafkaMirror.Commit whose timeout is not
// positive, and a FetchGroupOffsets whose ctx has no deadline.
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
			if rerr := call(ctx, func() error { return m.client.RefreshCoordinator(m.group) }); rerr != nil {
				return m.wrap(ctx, rerr)
			}
		}
		var resp *sarama.OffsetCommitResponse
		err = call(ctx, func() error {
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
		if err == nil || !retriableCoordinatorError(err) || ctx.Err() != nil {
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
	return joinErrors(joined)
}

// FetchGroupOffsets returns the offsets group has committed for tps on
// client's cluster; -1 stands for none. A group that does not exist has
// none: real Kafka answers offset -1 for it, kfake GROUP_ID_NOT_FOUND, and
// both give -1 here. Per-partition errors are joined into the returned
// error, with the map holding what was read. A coordinator error or a broken
// connection makes it look the coordinator up again and retry once.
//
// The call is bounded by ctx, or DefaultKafkaTimeout if ctx has no deadline,
// the same way as KafkaMirror.Commit (an abandoned sarama call ends at the
// client's Net.ReadTimeout).
func FetchGroupOffsets(ctx context.Context, client sarama.Client, group string, tps []TopicPartition) (map[TopicPartition]int64, error) {
	out := make(map[TopicPartition]int64, len(tps))
	if len(tps) == 0 {
		// A fetch with no partitions would mean "all of them".
		return out, nil
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, DefaultKafkaTimeout)
		defer cancel()
	}
	partitions := make(map[string][]int32)
	for _, tp := range tps {
		if _, dup := out[tp]; dup {
			continue
		}
		out[tp] = -1
		partitions[tp.Topic] = append(partitions[tp.Topic], tp.Partition)
	}
	req := sarama.NewOffsetFetchRequest(client.Config().Version, group, partitions)

	wrap := func(err error) error {
		if ctxErr := ctx.Err(); ctxErr != nil && errors.Is(err, ctxErr) {
			return err
		}
		return fmt.Errorf("offsets: fetch offsets of group %q: %w", group, err)
	}
	var resp *sarama.OffsetFetchResponse
	var err error
	for attempt := range 2 {
		if attempt > 0 {
			if rerr := call(ctx, func() error { return client.RefreshCoordinator(group) }); rerr != nil {
				return nil, wrap(rerr)
			}
		}
		err = call(ctx, func() error {
			b, err := client.Coordinator(group)
			if err != nil {
				return err
			}
			resp, err = b.FetchOffset(req)
			if err != nil {
				kafka.CloseOnTransportError(b, err)
				return err
			}
			if gerr := resp.GroupError(); gerr != sarama.ErrNoError {
				return gerr
			}
			return nil
		})
		if err == nil || !retriableCoordinatorError(err) || ctx.Err() != nil {
			break
		}
	}
	if errors.Is(err, sarama.ErrGroupIDNotFound) {
		return out, nil
	}
	if err != nil {
		return nil, wrap(err)
	}
	var errs []error
	for _, tp := range slices.SortedFunc(maps.Keys(out), TopicPartition.Compare) {
		b := resp.GetBlock(tp.Topic, tp.Partition)
		switch {
		case b == nil:
			// Not answered: nothing committed.
		case b.Err != sarama.ErrNoError:
			errs = append(errs, fmt.Errorf("%s: %w", tp, b.Err))
		default:
			out[tp] = b.Offset
		}
	}
	if len(errs) > 0 {
		return out, wrap(joinErrors(errs))
	}
	return out, nil
}

// retriableCoordinatorError reports whether err (or one of the joined
// per-partition errors) says the coordinator moved or is not ready, or the
// connection to it broke: cases where looking the coordinator up again and
// retrying can succeed.
func retriableCoordinatorError(err error) bool {
	return errors.Is(err, sarama.ErrNotCoordinatorForConsumer) ||
		errors.Is(err, sarama.ErrConsumerCoordinatorNotAvailable) ||
		errors.Is(err, sarama.ErrOffsetsLoadInProgress) ||
		errors.Is(err, sarama.ErrNotConnected) ||
		errors.Is(err, sarama.ErrBrokerNotAvailable) ||
		errors.Is(err, io.EOF) ||
		errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.EPIPE)
}

// joinedErrors is errors.Join on one line, for logs.
type joinedErrors []error

func joinErrors(errs []error) error {
	if len(errs) == 1 {
		return errs[0]
	}
	return joinedErrors(errs)
}

func (e joinedErrors) Error() string {
	parts := make([]string, len(e))
	for i, err := range e {
		parts[i] = err.Error()
	}
	return strings.Join(parts, "; ")
}

func (e joinedErrors) Unwrap() []error { return e }

// call runs fn, a blocking sarama call that takes no ctx, and returns its
// error, or ctx.Err() as soon as ctx is done. In the latter case fn keeps
// running in its goroutine until it returns by itself (sarama's
// Net.ReadTimeout/WriteTimeout bound it); its result is dropped.
func call(ctx context.Context, fn func() error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- fn() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

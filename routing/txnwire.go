package routing

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/kafka"
)

// Exactly-once streams (docs/RELAY.md §4): each stream's wire is a
// kafka.TxnStream on its cluster's transactional Producer. That Producer
// is the txnSet's, one per cluster, not the pool's at_least_once one: the
// pool closes a producer its channels no longer use (sweep, by its count of unsettled
// produces, which a stream's records do not enter: a TxnStream reports
// them to Commit, never to the Producer's handler), retires it when the
// cluster is redefined, and keys it by acks, while a stream needs one
// Producer with acks all that lives as long as the streams on it. The
// cost is a second set of connections to a cluster that has channels of
// both kinds; every stream of a cluster shares the one set.

// txnWire is the wire under a txnProducer: a kafka.TxnStream, one
// transactional.id opened for one owner. The txnProducer's loop calls
// commit without the txnProducer's mu and never while send runs (records
// given meanwhile are queued); send, place and close may be called by any
// goroutine.
type txnWire struct {
	s  *kafka.TxnStream
	pr *producer // the cluster's transactional Producer, for partitions
}

// txnCommitWait bounds a stream's Commit: it waits for every batch
// of the transaction, which the Producer sends again without end while a
// destination is away. A commit not finished then is taken as broken: the
// stream is opened again (which aborts the transaction unless its EndTxn
// landed) and the position read back decides which records to send again.
const txnCommitWait = 30 * time.Second

// txnCloseWait bounds the Close of a stream or of a cluster's Producer.
const txnCloseWait = 5 * time.Second

// openStream opens k's stream on the cluster's transactional Producer,
// opening that first if needed.
func (s *txnSet) openStream(k txnKey, cl config.Cluster) (*txnWire, error) {
	pr, err := s.clusterProducer(k.cluster, cl)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), openTimeout)
	defer cancel()
	ts, err := pr.kp.OpenTxn(ctx, kafka.DefaultTxnConfig(k.transactionalID(s.fleet)))
	if err != nil {
		return nil, err
	}
	return &txnWire{s: ts, pr: pr}, nil
}

// clusterProducer returns the cluster's transactional Producer, opening it
// if it is not open: one opening at a time (openMu), bounded by
// openTimeout.
func (s *txnSet) clusterProducer(name string, cl config.Cluster) (*producer, error) {
	s.openMu.Lock()
	defer s.openMu.Unlock()
	s.mu.Lock()
	pr, closed := s.producers[name], s.closed
	s.mu.Unlock()
	switch {
	case closed:
		return nil, errClosed
	case pr != nil:
		return pr, nil
	}
	cfg := kafka.DefaultProducerConfig()
	cfg.Logger = s.r.log
	ctx, cancel := context.WithTimeout(context.Background(), openTimeout)
	kp, err := kafka.NewProducer(ctx, name, cl, cfg, txnHandler{})
	cancel()
	if err != nil {
		return nil, fmt.Errorf("routing: open the transactional producer for cluster %s: %w", name, err)
	}
	pr = &producer{key: producerKey{cluster: name, acks: "all"}, kp: kp}
	s.mu.Lock()
	keep := !s.closed && sameConnection(s.clusters[name], cl)
	if keep {
		s.producers[name] = pr
	}
	s.mu.Unlock()
	if !keep {
		// Closed, or redefined while it opened: the next opening uses
		// the new definition. (Openings run in s.wg, which close waits
		// for.)
		closeClusterProducer(pr)
		return nil, fmt.Errorf("routing: the transactional producer for cluster %s opened as the router closed or the cluster was redefined", name)
	}
	return pr, nil
}

// closeClusterProducer closes a cluster's transactional Producer: its
// streams that are still open fail with kafka.ErrTxnClosed (broken: their
// txnProducers open them again on the cluster's next Producer).
func closeClusterProducer(pr *producer) {
	ctx, cancel := context.WithTimeout(context.Background(), txnCloseWait)
	defer cancel()
	_ = pr.kp.Close(ctx)
}

// txnHandler is the transactional Producer's ProduceHandler: every
// message given to it goes through a TxnStream, which reports it to
// Commit instead.
type txnHandler struct{}

func (txnHandler) Acked([]*kafka.Message, int64) {}
func (txnHandler) Refused(*kafka.Message, error) {}

// placePoll is how often place looks again for a topic's partition count
// being looked up.
const placePoll = 5 * time.Millisecond

// place readies om to be sent, before any produce of its record is handed
// over (a record goes to all its channels or to none): it stamps om's
// kafka.Message and chooses its partition as at_least_once does
// (direct.go). A topic whose partition count the Producer has not seen
// yet is looked up in the background (kafka.ErrPartitionsUnknown): place
// waits for it at most wait.
func (w *txnWire) place(ctx context.Context, om *outMsg, wait time.Duration) error {
	m := &om.km
	n, err := w.pr.kp.Partitions(m.Topic)
	if errors.Is(err, kafka.ErrPartitionsUnknown) {
		deadline := time.NewTimer(wait)
		defer deadline.Stop()
		poll := time.NewTicker(placePoll)
		defer poll.Stop()
		for errors.Is(err, kafka.ErrPartitionsUnknown) {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-deadline.C:
				return fmt.Errorf("routing: the partitions of %s on cluster %s are not known after %s: %w", m.Topic, w.pr.key.cluster, wait, err)
			case <-poll.C:
			}
			n, err = w.pr.kp.Partitions(m.Topic)
		}
	}
	if err != nil {
		return err
	}
	if m.Timestamp.IsZero() {
		m.Timestamp = time.Now() // here, not in the stream: the message is read by a stream left broken when it is sent again
	}
	m.Partition, err = w.pr.partition(om, m.Key, n)
	return err
}

// send puts om's message in the open transaction, beginning one if needed.
// It is placed once: sent again (in a transaction after an abort, or on a
// stream opened again), it goes to the same partition, in the same order.
// Called with the txnProducer's mu held.
func (w *txnWire) send(om *outMsg) error {
	return w.s.Produce(&om.km)
}

// commit ends the open transaction with the position record (key, value)
// as its last message, waiting at most txnCommitWait. Its error is nil
// (committed), a *kafka.TxnAbortedError (aborted: its messages but refused
// are in a new transaction already, to commit next), fenced (see fenced)
// or else broken (the transaction's outcome is unknown: open the id again
// and read the position back).
func (w *txnWire) commit(key, value []byte) ([]*outMsg, error) {
	ctx, cancel := context.WithTimeout(context.Background(), txnCommitWait)
	defer cancel()
	_, err := w.s.Commit(ctx, &kafka.Message{Topic: config.PositionsTopic, Key: key, Value: value})
	if err == nil {
		return nil, nil
	}
	if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
		return nil, fmt.Errorf("commit of %s not finished after %s (a destination away?): %w", w.s.ID(), txnCommitWait, kafka.ErrTxnBroken)
	}
	var ae *kafka.TxnAbortedError
	if !errors.As(err, &ae) {
		return nil, err
	}
	refused := make([]*outMsg, 0, len(ae.Refused))
	for _, m := range ae.Refused {
		if om, ok := m.Ref.(*outMsg); ok {
			refused = append(refused, om)
		}
	}
	return refused, err
}

// close stops the stream without committing; what it has open is aborted
// by the id's next opening or its transaction timeout.
func (w *txnWire) close() {
	ctx, cancel := context.WithTimeout(context.Background(), txnCloseWait)
	defer cancel()
	_ = w.s.Close(ctx)
}

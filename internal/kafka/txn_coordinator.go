package kafka

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"
)

// addPartitions adds todo to the open transaction and wakes their sinks.
func (t *TxnStream) addPartitions(todo []*partState) {
	p := t.p
	tps := map[string][]int32{}
	for _, ps := range todo {
		tps[ps.topic] = append(tps[ps.topic], ps.partition)
	}
	p.mu.Lock()
	req := &sarama.AddPartitionsToTxnRequest{Version: AddPartitionsToTxnVersion(p.sc.Version), TransactionalID: t.cfg.ID,
		ProducerID: t.pid, ProducerEpoch: t.epoch, TopicPartitions: tps}
	p.mu.Unlock()
	var resp *sarama.AddPartitionsToTxnResponse
	err := t.call(t.ctx, "AddPartitionsToTxn", false, func(b *sarama.Broker) (sarama.KError, error) {
		r := *req
		var err error
		if resp, err = b.AddPartitionsToTxn(&r); err != nil {
			return 0, err
		}
		return addPartitionsErr(resp), nil
	})
	p.mu.Lock()
	defer p.mu.Unlock()
	if t.err != nil {
		return
	}
	if err != nil {
		if final(err) {
			t.fail(err)
			return
		}
		if t.abortable == nil {
			t.abortable = fmt.Errorf("kafka: AddPartitionsToTxn for %s on cluster %s: %w", t.cfg.ID, p.name, err)
		}
		if errors.Is(err, sarama.ErrTopicAuthorizationFailed) {
			t.refuseUnauthorized(resp)
		}
		return
	}
	var sinks []*sink
	for _, ps := range todo {
		t.added[ps] = true
		if ps.sink != nil {
			sinks = append(sinks, ps.sink)
		}
	}
	t.begun = true
	for _, s := range sinks {
		s.wake()
	}
}

// refuseUnauthorized refuses for good the open transaction's messages to
// the partitions resp answers TOPIC_AUTHORIZATION_FAILED, as the
// idempotent path refuses a produce so answered: the abort leaves them
// out of the next transaction (TxnAbortedError.Refused), which otherwise
// would be refused again, and every one after it. The caller holds p.mu.
func (t *TxnStream) refuseUnauthorized(resp *sarama.AddPartitionsToTxnResponse) {
	if resp == nil {
		return
	}
	if t.denied == nil {
		t.denied = map[topicPartition]bool{}
	}
	for topic, pes := range resp.Errors {
		for _, pe := range pes {
			if pe.Err == sarama.ErrTopicAuthorizationFailed {
				t.denied[topicPartition{topic, pe.Partition}] = true
			}
		}
	}
}

// refusedAtAbort returns, in the order given, the messages of the
// aborted transaction (cur) and of the next (next) that are refused for
// good: those a destination refused, and those to a partition the
// coordinator denied, including the ones given after the denial. The
// caller holds p.mu.
func (t *TxnStream) refusedAtAbort() []*Message {
	marked := map[*Message]bool{}
	for _, m := range t.refused {
		marked[m] = true
	}
	var out []*Message
	for _, msgs := range [][]*Message{t.cur, t.next} {
		for _, m := range msgs {
			if marked[m] || t.denied[topicPartition{m.Topic, m.Partition}] {
				out = append(out, m)
				delete(marked, m)
			}
		}
	}
	for _, m := range t.refused { // refused and in neither (not expected): kept
		if marked[m] {
			out = append(out, m)
		}
	}
	return out
}

// addPartitionsErr is the error of an AddPartitionsToTxn answer: the
// first partition's that is not OPERATION_NOT_ATTEMPTED (the others are
// not added because of it).
func addPartitionsErr(resp *sarama.AddPartitionsToTxnResponse) sarama.KError {
	worst := sarama.ErrNoError
	for _, pes := range resp.Errors {
		for _, pe := range pes {
			switch {
			case pe.Err == sarama.ErrNoError:
			case pe.Err == sarama.ErrOperationNotAttempted:
				if worst == sarama.ErrNoError {
					worst = pe.Err
				}
			default:
				if worst == sarama.ErrNoError || worst == sarama.ErrOperationNotAttempted {
					worst = pe.Err
				}
			}
		}
	}
	return worst
}

// abort ends the open transaction without committing it (EndTxn abort,
// once nothing of it is in flight), bumps the epoch (KIP-360:
// InitProducerID with the stream's producer id and epoch), which resets
// the sequences, and puts the records back: for Abort those given after
// it; after a failed commit the transaction's own (but the refused) too.
func (t *TxnStream) abort() {
	p := t.p
	p.mu.Lock()
	begun, why, explicit, pid, epoch := t.begun, t.abortable, t.aborting, t.pid, t.epoch
	p.mu.Unlock()
	if begun {
		if err := t.endTxn(false); err != nil {
			if fencedErr(err) || errors.Is(err, context.Canceled) {
				p.mu.Lock()
				t.fail(err)
				p.mu.Unlock()
				return
			}
			// The bump aborts what is open as well.
			t.log.Info("EndTxn abort failed; the epoch bump aborts the transaction", zap.Error(err))
		}
		var err error
		if pid, epoch, err = t.initProducerID(t.ctx, pid, epoch); err != nil {
			p.mu.Lock()
			t.fail(err)
			p.mu.Unlock()
			return
		}
		t.stats.bumps.Add(1)
	}
	t.stats.aborts.Add(1)
	p.mu.Lock()
	defer p.mu.Unlock()
	if t.err != nil {
		return
	}
	var keep, dropped, refused []*Message
	if explicit {
		dropped = t.cur
		keep = append(keep, t.next...)
	} else {
		refused = t.refusedAtAbort()
		out := map[*Message]bool{}
		for _, m := range refused {
			out[m] = true
		}
		for _, msgs := range [][]*Message{t.cur, t.next} {
			for _, m := range msgs {
				if !out[m] {
					keep = append(keep, m)
				}
			}
		}
	}
	t.rebuild(keep, begun, pid, epoch)
	if explicit {
		t.finish(dropped, nil)
		t.log.Info("transaction aborted", zap.Int("records", len(dropped)), zap.Int16("epoch", epoch))
		return
	}
	t.log.Warn("transaction aborted; its records are sent again in the next one",
		zap.Int("records", len(keep)), zap.Int("refused", len(refused)), zap.Int16("epoch", epoch), zap.Error(why))
	t.finish(nil, &TxnAbortedError{Refused: refused, Err: why})
}

// rebuild starts transaction gen+1 with msgs, under pid and epoch; a
// bumped epoch starts every partition's sequence at 0. Nothing of the
// stream is in flight. The caller holds p.mu.
func (t *TxnStream) rebuild(msgs []*Message, bumped bool, pid int64, epoch int16) {
	for _, ps := range t.parts {
		ps.queue, ps.open, ps.inflight = nil, nil, nil
		ps.failed, ps.gate, ps.retries, ps.retryAt = false, true, 0, time.Time{}
		ps.pending, ps.since, ps.lastErr = 0, time.Time{}, nil
		if bumped {
			ps.nextSeq = 0
		}
	}
	t.pid, t.epoch = pid, epoch
	t.gen++
	t.added, t.begun, t.settled, t.refused, t.denied, t.abortable = map[*partState]bool{}, false, 0, nil, nil, nil
	t.cur, t.next = msgs, nil
	for _, m := range msgs {
		t.enqueue(t.part(topicPartition{m.Topic, m.Partition}), m, messageSize(m), t.gen)
	}
	t.wake()
}

// endTxn ends the open transaction. A commit whose request or answer
// is lost is ErrTxnBroken (its outcome is unknown); an abort is sent
// again.
func (t *TxnStream) endTxn(commit bool) error {
	p := t.p
	p.mu.Lock()
	req := &sarama.EndTxnRequest{Version: EndTxnVersion(p.sc.Version), TransactionalID: t.cfg.ID,
		ProducerID: t.pid, ProducerEpoch: t.epoch, TransactionResult: commit}
	p.mu.Unlock()
	what := "EndTxn abort"
	if commit {
		what = "EndTxn commit"
	}
	return t.call(t.ctx, what, commit, func(b *sarama.Broker) (sarama.KError, error) {
		r := *req
		resp, err := b.EndTxn(&r)
		if err != nil {
			return 0, err
		}
		return resp.Err, nil
	})
}

// initProducerID takes the id's producer id and epoch: a new one (pid
// -1) at open, or the epoch after epoch (KIP-360, InitProducerID v3 and
// later; older brokers take the id's current epoch and bump it, as at
// open).
func (t *TxnStream) initProducerID(ctx context.Context, pid int64, epoch int16) (int64, int16, error) {
	id := t.cfg.ID
	req := &sarama.InitProducerIDRequest{Version: InitProducerIDVersion(t.p.sc.Version), TransactionalID: &id,
		TransactionTimeout: t.cfg.TxnTimeout, ProducerID: pid, ProducerEpoch: epoch}
	var resp *sarama.InitProducerIDResponse
	err := t.call(ctx, "InitProducerID", false, func(b *sarama.Broker) (sarama.KError, error) {
		r := *req
		var err error
		if resp, err = b.InitProducerID(&r); err != nil {
			return 0, err
		}
		return resp.Err, nil
	})
	if err != nil {
		return 0, 0, err
	}
	return resp.ProducerID, resp.ProducerEpoch, nil
}

// call sends a request to the coordinator with send until it is
// answered without a retriable error: the coordinator moved or not
// found (found again), loading or still ending a transaction, a
// connection lost (unless ambiguous: then ErrTxnBroken at once). It
// tries for RetryTimeout, with the Producer's backoff, then returns
// errGaveUp with the last error. It runs on one goroutine at a time
// (OpenTxn's, then run).
func (t *TxnStream) call(ctx context.Context, what string, ambiguous bool, send func(*sarama.Broker) (sarama.KError, error)) error {
	deadline := time.Now().Add(t.cfg.RetryTimeout)
	for n := 1; ; n++ {
		b, err := t.coordinator()
		if err == nil {
			var kerr sarama.KError
			if kerr, err = send(b); err != nil {
				CloseOnTransportError(b, err)
				t.coord = nil
				// ErrNotConnected: closed before the request was written
				// (by another user of the client's connection), so not
				// lost: sent again on a new one.
				if ambiguous && !errors.Is(err, sarama.ErrNotConnected) {
					return fmt.Errorf("kafka: %s for %s on cluster %s: %w: %w", what, t.cfg.ID, t.p.name, ErrTxnBroken, err)
				}
			} else if kerr != sarama.ErrNoError {
				err = kerr
			} else {
				return nil
			}
		}
		var kerr sarama.KError
		switch {
		case errors.Is(err, sarama.ErrNotCoordinatorForConsumer), errors.Is(err, sarama.ErrConsumerCoordinatorNotAvailable):
			t.coord = nil
		case errors.Is(err, sarama.ErrConcurrentTransactions), errors.Is(err, sarama.ErrOffsetsLoadInProgress),
			errors.Is(err, sarama.ErrUnknownTopicOrPartition), errors.Is(err, sarama.ErrBrokerNotAvailable),
			errors.Is(err, sarama.ErrRequestTimedOut):
		case errors.As(err, &kerr):
			return err // the caller's to judge: fenced, abortable
		}
		t.log.Debug("transaction coordinator request failed; retrying", zap.String("request", what), zap.Int("attempt", n), zap.Error(err))
		d := t.p.backoff(n)
		if errors.Is(err, sarama.ErrConcurrentTransactions) {
			d = min(d, concurrentTxnBackoff(n))
		}
		if time.Now().Add(d).After(deadline) {
			return fmt.Errorf("kafka: %s for %s on cluster %s: %w for %s: %w", what, t.cfg.ID, t.p.name, errGaveUp, t.cfg.RetryTimeout, err)
		}
		if serr := sleepCtx(ctx, d); serr != nil {
			return serr
		}
	}
}

// concurrentTxnBackoff is the wait before attempt n+1 of a request
// answered CONCURRENT_TRANSACTIONS: 1, 2, 4, 8, 16, then 20 ms. The
// answer nearly always follows a commit, to the next transaction's
// AddPartitionsToTxn, while the coordinator writes the last one's markers,
// which takes a millisecond or two on a healthy cluster. At the 20 ms of
// Java's producer (and of this stream before), a stream committing
// every megabyte stood idle more than half the time on real Kafka (one
// stream, 1 KiB records: 40 000 records/s against 93 000-119 000 at this
// backoff).
func concurrentTxnBackoff(n int) time.Duration {
	return min(time.Millisecond<<min(n-1, 5), 20*time.Millisecond)
}

// coordinator returns the connection to the id's transaction
// coordinator: FindCoordinator (key type transaction) at any broker, then
// the client's connection to the broker it names.
func (t *TxnStream) coordinator() (*sarama.Broker, error) {
	if t.coord != nil {
		if ok, _ := t.coord.Connected(); ok {
			return t.coord, nil
		}
		// Closed since: the connection is the client's, shared with every
		// stream of the cluster and the metadata calls, and closed by
		// whichever of them lost a request on it. Found and opened again.
		t.coord = nil
	}
	c := t.p.client
	b := c.LeastLoadedBroker()
	if b == nil {
		if err := c.RefreshMetadata(); err != nil {
			return nil, err
		}
		return nil, sarama.ErrBrokerNotAvailable
	}
	resp, err := b.FindCoordinator(&sarama.FindCoordinatorRequest{Version: FindCoordinatorVersion(t.p.sc.Version),
		CoordinatorKey: t.cfg.ID, CoordinatorType: sarama.CoordinatorTransaction})
	if err != nil {
		CloseOnTransportError(b, err)
		// The client's least loaded broker stays this one (a broker gone
		// is still in its metadata, with no request pending) until the
		// metadata is read again: without this every retry asked it.
		if rerr := c.RefreshMetadata(); rerr != nil {
			t.log.Debug("metadata refresh after a failed FindCoordinator failed", zap.Error(rerr))
		}
		return nil, err
	}
	if resp.Err != sarama.ErrNoError {
		return nil, resp.Err
	}
	id := resp.Coordinator.ID()
	cb, err := c.Broker(id)
	if err != nil {
		// Not in the client's metadata yet (a broker added).
		if rerr := c.RefreshMetadata(); rerr != nil {
			return nil, rerr
		}
		if cb, err = c.Broker(id); err != nil {
			return nil, fmt.Errorf("coordinator broker %d (%s): %w", id, resp.Coordinator.Addr(), err)
		}
	}
	// Open dials in the background: wait for it, so that a failed dial
	// is this call's error (retried) and not a request's (an EndTxn
	// commit's would be taken as lost).
	if ok, err := cb.Connected(); !ok {
		if err == nil {
			err = sarama.ErrNotConnected
		}
		return nil, fmt.Errorf("coordinator broker %d (%s): %w", id, resp.Coordinator.Addr(), err)
	}
	t.coord = cb
	return cb, nil
}

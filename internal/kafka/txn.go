package kafka

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"
)

// Transactions on the Producer (docs/RELAY.md §4). A TxnStream is one
// transactional id on a cluster's shared Producer: its batches go through
// the Producer's sinks and connections, in ProduceRequests of their own
// (a request carries one transactional id), under the stream's producer
// id and epoch, with sequences per partition that continue across its
// transactions. The stream's goroutine speaks to the transaction
// coordinator: AddPartitionsToTxn before a partition's first batch of a
// transaction (the batch is not sent before it succeeded), EndTxn, and
// InitProducerID to bump the epoch after an abort (txn_coordinator.go).

var (
	// ErrTxnFenced: another producer opened the transactional id (or the
	// id may not be used): the stream's open transaction is aborted by
	// the coordinator, its records are dropped, and the stream must not
	// be opened again by this owner.
	ErrTxnFenced = errors.New("kafka: transactional id fenced: another producer opened it")
	// ErrTxnBroken: the stream cannot go on and the outcome of its last
	// transaction is unknown (a connection lost during EndTxn commit, or
	// the coordinator unreachable for RetryTimeout). Open the id again
	// (that aborts what is not committed) and read back what was
	// committed to decide which records to send again.
	ErrTxnBroken = errors.New("kafka: transactional stream broken: the outcome of its open transaction is unknown")
	// ErrTxnAborted: Commit aborted the transaction instead (a produce
	// refused in it, or the coordinator refused it). Its records, but
	// those refused for good, are in the next transaction, under a
	// bumped epoch: Commit again.
	ErrTxnAborted = errors.New("kafka: transaction aborted; its records are sent again in the next transaction")
	// ErrTxnClosed is returned after Close.
	ErrTxnClosed = errors.New("kafka: transactional stream closed")
	// ErrTxnOtherPending: a Commit was called while an Abort whose caller
	// gave up (its ctx ended) is still carried out, or the other way
	// round. Its outcome is not handed to a request of the other kind
	// (aborted records taken for committed), and nothing of the refused
	// call is taken (a Commit's last neither): call the same kind again
	// to learn the outcome.
	ErrTxnOtherPending = errors.New("kafka: an earlier Commit or Abort of the other kind is still being carried out; call it again to learn its outcome")
)

// TxnAbortedError is Commit's error when it aborted the transaction: it
// wraps ErrTxnAborted and the cause.
type TxnAbortedError struct {
	// Refused are the messages a destination refused for good (too
	// large, invalid): they are not in the next transaction.
	Refused []*Message
	// Err is why the transaction was aborted.
	Err error
}

func (e *TxnAbortedError) Error() string {
	return fmt.Sprintf("%v: %v (%d refused for good, left out)", ErrTxnAborted, e.Err, len(e.Refused))
}

// Unwrap returns ErrTxnAborted and the cause.
func (e *TxnAbortedError) Unwrap() []error { return []error{ErrTxnAborted, e.Err} }

// TxnStats counts what a TxnStream did.
type TxnStats struct {
	Commits int64 // transactions committed
	Aborts  int64 // transactions aborted (by Abort or by Commit)
	Bumps   int64 // epochs bumped after an abort
}

// txnOutcome is a Commit's or Abort's result, for the caller waiting.
type txnOutcome struct {
	msgs []*Message
	err  error
}

// TxnStream is one transactional id producing through a Producer. Produce
// may be called concurrently with anything; Commit and Abort by one
// goroutine at a time.
type TxnStream struct {
	p      *Producer
	cfg    TxnConfig
	log    *zap.Logger
	ctx    context.Context // ends at Close or the Producer's Close: interrupts retries
	cancel context.CancelFunc
	kick   chan struct{} // wakes run
	done   chan struct{} // closed when run returned
	once   sync.Once

	coord *sarama.Broker // the coordinator's connection (the client's); run's

	stats struct{ commits, aborts, bumps atomic.Int64 }

	// Under p.mu.
	pid   int64
	epoch int16
	parts map[topicPartition]*partState
	// gen numbers the transactions: batches of gen are sent once their
	// partition is added to it; batches of gen+1 (given while gen
	// commits) wait.
	gen   uint64
	added map[*partState]bool
	begun bool // a partition was added: the coordinator has gen open
	// cur are gen's messages in the order given; next gen+1's;
	// settled how many of cur were acknowledged or refused.
	cur, next []*Message
	settled   int
	refused   []*Message
	// denied are the partitions the coordinator refused to add to gen for
	// good (TOPIC_AUTHORIZATION_FAILED): every message to them is
	// refused at the abort, those given after the refusal too.
	denied    map[topicPartition]bool
	abortable error // the open transaction must be aborted, why
	// committing/aborting: a Commit/Abort is being carried out; its
	// outcome is handed over through outcome and outcomeCh to the next
	// request of its kind (askedCommit: a Commit's).
	committing, aborting bool
	askedCommit          bool
	outcome              *txnOutcome
	outcomeCh            chan struct{}
	err                  error // fenced, broken or closed: for good
}

// OpenTxn opens a transactional stream on p, which must be idempotent
// (acks all): it finds the id's transaction coordinator and takes the
// id's producer id and epoch (InitProducerID), which fences the id's
// previous producer (the coordinator aborts its open transaction).
// Coordinator errors that pass are retried for cfg.RetryTimeout or until
// ctx ends. The caller must Close the stream.
func (p *Producer) OpenTxn(ctx context.Context, cfg TxnConfig) (*TxnStream, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if p.cfg.Acks != sarama.WaitForAll {
		return nil, fmt.Errorf("kafka: transactional stream %s on cluster %s: the producer has acks %d; transactions need acks all", cfg.ID, p.name, p.cfg.Acks)
	}
	if FindCoordinatorVersion(p.sc.Version) < 1 {
		return nil, fmt.Errorf("kafka: transactional stream %s on cluster %s: Kafka version %s has no transactions (0.11): raise the cluster's version", cfg.ID, p.name, p.sc.Version)
	}
	tctx, cancel := context.WithCancel(p.ctx)
	t := &TxnStream{
		p: p, cfg: cfg, log: p.log.With(zap.String("transactional_id", cfg.ID)),
		ctx: tctx, cancel: cancel, kick: make(chan struct{}, 1), done: make(chan struct{}),
		parts: map[topicPartition]*partState{}, added: map[*partState]bool{},
	}
	octx, ocancel := context.WithCancel(ctx)
	stop := context.AfterFunc(tctx, ocancel)
	pid, epoch, err := t.initProducerID(octx, -1, -1)
	stop()
	ocancel()
	if err != nil {
		cancel()
		return nil, fmt.Errorf("kafka: open transactional stream %s on cluster %s: %w", cfg.ID, p.name, err)
	}
	p.mu.Lock()
	if p.closing {
		p.mu.Unlock()
		cancel()
		return nil, ErrProducerClosed
	}
	if p.streams == nil {
		p.streams, p.running = map[*TxnStream]struct{}{}, map[*TxnStream]struct{}{}
	}
	p.streams[t], p.running[t] = struct{}{}, struct{}{}
	p.clientUsers++ // released by run
	t.pid, t.epoch = pid, epoch
	p.mu.Unlock()
	go t.run()
	t.log.Info("transactional stream opened", zap.Int64("producer_id", pid), zap.Int16("epoch", epoch))
	return t, nil
}

// ID returns the stream's transactional id.
func (t *TxnStream) ID() string { return t.cfg.ID }

// Stats returns the stream's counters.
func (t *TxnStream) Stats() TxnStats {
	return TxnStats{Commits: t.stats.commits.Load(), Aborts: t.stats.aborts.Load(), Bumps: t.stats.bumps.Load()}
}

// Produce puts m in the open transaction (beginning one if none is), or,
// while a Commit or Abort is being carried out, in the next. It does not
// block. The Producer keeps m as Producer.Produce does; m is reported by
// Commit, never to the Producer's handler. It returns the stream's error
// once fenced, broken or closed.
func (t *TxnStream) Produce(m *Message) error {
	if m.Timestamp.IsZero() {
		m.Timestamp = time.Now()
	}
	size := messageSize(m)
	p := t.p
	p.mu.Lock()
	if t.err != nil {
		err := t.err
		p.mu.Unlock()
		return err
	}
	if p.closing {
		p.mu.Unlock()
		return ErrProducerClosed
	}
	gen := t.gen
	if t.committing || t.aborting {
		gen++
		t.next = append(t.next, m)
	} else {
		t.cur = append(t.cur, m)
	}
	ps := t.part(topicPartition{m.Topic, m.Partition})
	t.enqueue(ps, m, size, gen)
	if gen == t.gen && !t.added[ps] {
		t.wake()
	}
	s := ps.sink
	p.mu.Unlock()
	if s != nil {
		s.wake()
	}
	return nil
}

// Commit commits the open transaction: last, unless nil, is added as its
// last message (the stream's position, written with the records it
// completes), every batch of it is sealed, and once each is acknowledged
// the transaction is ended (EndTxn commit). It returns the transaction's
// messages in the order given. Messages given meanwhile go to the next
// transaction. Nothing to commit (and no last) returns nil, nil. Errors:
//   - *TxnAbortedError (ErrTxnAborted): the transaction was aborted and
//     its records are in the next one;
//   - ErrTxnFenced, ErrTxnBroken: the stream is done (see them); the
//     messages are not reported;
//   - ctx.Err(): the commit goes on; the next Commit waits for its
//     outcome and returns it (that call's last goes to the next
//     transaction, as Produce would put it); an Abort meanwhile returns
//     ErrTxnOtherPending.
func (t *TxnStream) Commit(ctx context.Context, last *Message) ([]*Message, error) {
	return t.request(ctx, true, last)
}

// Abort aborts the open transaction and returns its messages, which are
// not sent again; messages given meanwhile go to the next transaction.
// The epoch is bumped, as after any abort. Errors as Commit's (an Abort
// given up is learnt by the next Abort; a Commit meanwhile returns
// ErrTxnOtherPending).
func (t *TxnStream) Abort(ctx context.Context) ([]*Message, error) {
	return t.request(ctx, false, nil)
}

func (t *TxnStream) request(ctx context.Context, commit bool, last *Message) ([]*Message, error) {
	if last != nil && last.Timestamp.IsZero() {
		last.Timestamp = time.Now()
	}
	p := t.p
	var lastSink *sink
	p.mu.Lock()
	if t.outcomeCh != nil && t.askedCommit != commit && t.err == nil {
		p.mu.Unlock()
		return nil, ErrTxnOtherPending
	}
	if t.outcomeCh == nil {
		if t.err == nil && last != nil {
			t.cur = append(t.cur, last)
			ps := t.part(topicPartition{last.Topic, last.Partition})
			t.enqueue(ps, last, messageSize(last), t.gen)
			last, lastSink = nil, ps.sink
		}
		switch {
		case t.err != nil:
			p.mu.Unlock()
			return nil, t.err
		case len(t.cur) == 0 && !t.begun && t.abortable == nil:
			p.mu.Unlock()
			return nil, nil
		}
		t.committing, t.aborting, t.askedCommit = commit, !commit, commit
		t.outcomeCh = make(chan struct{})
		t.wake()
	}
	ch := t.outcomeCh
	p.mu.Unlock()
	if lastSink != nil {
		lastSink.wake() // its partition may be in the transaction already
	}
	if last != nil {
		if err := t.Produce(last); err != nil {
			return nil, err
		}
	}
	select {
	case <-ch:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	p.mu.Lock()
	o := t.outcome
	t.outcome, t.outcomeCh = nil, nil
	p.mu.Unlock()
	return o.msgs, o.err
}

// Close stops the stream: Produce, Commit and Abort fail from now on with
// ErrTxnClosed, nothing more of it is sent, and its goroutine returns (a
// coordinator request in progress is bounded by the client's timeouts;
// Close waits for it until ctx ends). An open transaction is left to the
// coordinator: the next InitProducerID of the id, or the transaction
// timeout, aborts it. Close may be called more than once.
func (t *TxnStream) Close(ctx context.Context) error {
	t.once.Do(func() {
		p := t.p
		p.mu.Lock()
		t.fail(ErrTxnClosed)
		delete(p.streams, t)
		for _, ps := range t.parts {
			if ps.sink != nil {
				p.detach(ps) // answers in flight still settle it; the resolver no longer sees it
			}
		}
		p.mu.Unlock()
		t.cancel()
	})
	select {
	case <-t.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (t *TxnStream) wake() {
	select {
	case t.kick <- struct{}{}:
	default:
	}
}

// part returns the stream's state of partition k. The caller holds p.mu.
func (t *TxnStream) part(k topicPartition) *partState {
	ps := t.parts[k]
	if ps == nil {
		ps = &partState{topicPartition: k, gate: true, txn: t}
		t.parts[k] = ps
		t.p.kickResolver()
	}
	return ps
}

// enqueue appends m to ps's open batch of transaction gen. The caller
// holds p.mu.
func (t *TxnStream) enqueue(ps *partState, m *Message, size int, gen uint64) {
	if ps.open != nil && (ps.open.gen != gen || !ps.open.fits(m, size, t.p.cfg.BatchBytes, t.p.cfg.BatchRecords)) {
		ps.queue = append(ps.queue, ps.open)
		ps.open = nil
	}
	if ps.open == nil {
		ps.open = newBatch(m)
		ps.open.gen = gen
	}
	ps.open.add(m, size)
	if ps.pending == 0 {
		ps.since = time.Now()
	}
	ps.pending++
}

// mayStart reports whether ps may send b now as far as the transaction
// goes: b is of the open transaction, ps is added to it, and nothing
// wants it aborted. The caller holds p.mu.
func (t *TxnStream) mayStart(ps *partState, b *batch) bool {
	return t.err == nil && t.abortable == nil && !t.aborting && b.gen == t.gen && t.added[ps]
}

// ends reports whether err, answered to the head batch of one of the
// stream's partitions, ends the transaction: fenced (for good) or
// abortable (lost sequence, state the coordinator does not know). The
// caller holds p.mu.
func (t *TxnStream) ends(err error) bool {
	switch {
	case fencedErr(err):
		t.fail(err)
	case errors.Is(err, sarama.ErrOutOfOrderSequenceNumber), errors.Is(err, sarama.ErrUnknownProducerID),
		errors.Is(err, sarama.ErrInvalidProducerIDMapping), errors.Is(err, sarama.ErrInvalidTxnState):
		if t.abortable == nil {
			t.abortable = err
		}
		t.wake()
	default:
		return false
	}
	return true
}

// reported settles an acknowledged batch (msgs) or a message refused for
// good (refused, err) of the stream's transaction gen. The caller holds
// p.mu.
func (t *TxnStream) reported(gen uint64, msgs []*Message, refused *Message, err error) {
	if t.err != nil || gen != t.gen {
		// Only the open transaction's batches are sent (mayStart), and
		// an abort waits for every answer before it starts another.
		return
	}
	if refused != nil {
		t.settled++
		t.refused = append(t.refused, refused)
		if t.abortable == nil {
			t.abortable = err
		}
	} else {
		t.settled += len(msgs)
	}
	t.wake()
}

// errGaveUp: a coordinator request kept failing with retriable errors
// for RetryTimeout.
var errGaveUp = errors.New("the transaction coordinator kept failing")

// final reports whether err, from a coordinator request, ends the stream
// (fenced, or broken: an unknown outcome, or a coordinator gone for
// RetryTimeout), rather than only its open transaction.
func final(err error) bool {
	return fencedErr(err) || errors.Is(err, ErrTxnBroken) || errors.Is(err, errGaveUp) || errors.Is(err, context.Canceled)
}

// fencedErr reports whether err says the transactional id is another
// producer's now, or not ours to use.
func fencedErr(err error) bool {
	return errors.Is(err, sarama.ErrProducerFenced) || errors.Is(err, sarama.ErrInvalidProducerEpoch) ||
		errors.Is(err, sarama.ErrTransactionalIDAuthorizationFailed) || errors.Is(err, sarama.ErrTransactionCoordinatorFenced)
}

// fail ends the stream for good: fenced, broken or closed. A Commit or
// Abort waiting gets the error. The caller holds p.mu.
func (t *TxnStream) fail(err error) {
	if t.err != nil {
		return
	}
	switch {
	case errors.Is(err, ErrTxnClosed), errors.Is(err, ErrTxnBroken):
	case errors.Is(err, context.Canceled):
		// The stream's context, ended by the Producer's Close (Close of
		// the stream fails it first).
		err = fmt.Errorf("%w: %w", ErrTxnClosed, ErrProducerClosed)
	case fencedErr(err):
		err = fmt.Errorf("kafka: transactional stream %s on cluster %s: %w: %w", t.cfg.ID, t.p.name, ErrTxnFenced, err)
	default:
		err = fmt.Errorf("kafka: transactional stream %s on cluster %s: %w: %w", t.cfg.ID, t.p.name, ErrTxnBroken, err)
	}
	t.err = err
	if !errors.Is(err, ErrTxnClosed) {
		t.log.Warn("transactional stream failed; its open transaction's records are not reported",
			zap.Int("records", len(t.cur)+len(t.next)), zap.Error(err))
	}
	t.finish(nil, err)
	t.wake()
}

// finish hands a Commit's or Abort's outcome to its caller, if one
// waits. The caller holds p.mu.
func (t *TxnStream) finish(msgs []*Message, err error) {
	t.committing, t.aborting = false, false
	if t.outcomeCh != nil && t.outcome == nil {
		t.outcome = &txnOutcome{msgs: msgs, err: err}
		close(t.outcomeCh)
	}
}

// busy reports whether a batch of the stream is in flight or being
// reported. The caller holds p.mu.
func (t *TxnStream) busy() bool {
	for _, ps := range t.parts {
		if len(ps.inflight) > 0 || ps.reported > 0 {
			return true
		}
	}
	return false
}

// run is the stream's goroutine: it adds partitions to the open
// transaction, commits and aborts as asked, until Close or the
// Producer's Close, which both wait for it.
func (t *TxnStream) run() {
	defer close(t.done)
	defer t.p.releaseClient()
	defer func() {
		// Closed, or the Producer was: a Commit or Abort waiting learns it.
		t.p.mu.Lock()
		t.fail(fmt.Errorf("%w: %w", ErrTxnClosed, ErrProducerClosed))
		delete(t.p.running, t)
		t.p.mu.Unlock()
	}()
	for {
		again := t.step()
		select {
		case <-t.ctx.Done():
			return
		default:
		}
		if again {
			continue
		}
		select {
		case <-t.ctx.Done():
			return
		case <-t.kick:
		}
	}
}

// step does the next thing the stream needs of its coordinator and
// reports whether there may be more to do at once.
func (t *TxnStream) step() bool {
	p := t.p
	p.mu.Lock()
	switch {
	case t.err != nil:
		p.mu.Unlock()
		return false
	case t.aborting || t.abortable != nil && t.committing:
		if t.busy() {
			p.mu.Unlock()
			return false // the answers in flight wake us
		}
		p.mu.Unlock()
		t.abort()
		return true
	}
	var todo []*partState
	for _, ps := range t.parts {
		if b := ps.next(); b != nil && b.gen == t.gen && !t.added[ps] {
			todo = append(todo, ps)
		}
	}
	if len(todo) > 0 && t.abortable == nil {
		p.mu.Unlock()
		t.addPartitions(todo)
		return true
	}
	if !t.committing || t.settled < len(t.cur) {
		p.mu.Unlock()
		return false
	}
	begun := t.begun
	p.mu.Unlock()
	if begun {
		if err := t.endTxn(true); err != nil {
			p.mu.Lock()
			if !final(err) {
				// Refused, not lost: the transaction can be aborted.
				t.abortable = err
			} else {
				t.fail(err)
			}
			p.mu.Unlock()
			return true
		}
	}
	p.mu.Lock()
	committed := t.cur
	t.cur, t.next = t.next, nil
	t.gen++
	t.added, t.begun, t.settled = map[*partState]bool{}, false, 0
	t.stats.commits.Add(1) // before the caller learns of it
	t.finish(committed, nil)
	p.mu.Unlock()
	t.log.Debug("transaction committed", zap.Int("records", len(committed)))
	return true
}

package kafka

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"
)

// maxPartitionInFlight is Kafka's window of recognised resends: a
// broker keeps the last 5 batches of a producer per partition.
const maxPartitionInFlight = 5

// connFailuresBeforeMove is how many dials in a row to a broker fail
// before its partitions have their leaders looked up again.
const connFailuresBeforeMove = 3

// sink sends the batches of the partitions one broker leads, on a
// connection of its own, and settles the answers. Its goroutine (run)
// owns the connection; parts is under Producer.mu.
type sink struct {
	p     *Producer
	id    int32
	addr  string
	parts []*partState // under p.mu

	kick    chan struct{} // 1-buffered: something to send
	answers chan answer   // cap MaxInFlight: sarama's callback never blocks
	done    chan struct{} // closed when run returned

	// owned by run
	conn *Conn
	// ver is the Produce version agreed with the broker; perPartition
	// the batches one partition may have in flight on it: 1 below v4
	// (Kafka 0.11 recognises a resend of the last batch only, not of the
	// last 5), as franz-go limits it.
	ver          int16
	perPartition int
	inflight     int // requests sent whose answer run has not read
	dialFails    int
	dialAfter    time.Time
	cursor       int
	everOpened   bool
	lastDialErr  error
}

// sentBatch is one batch of a request.
type sentBatch struct {
	ps *partState
	b  *batch
}

// answer is a request's outcome, from sarama's response goroutine.
type answer struct {
	sent []sentBatch
	resp *sarama.ProduceResponse
	err  error
	conn *Conn
	// unanswered: acks 0, the request was written and gets no answer.
	unanswered bool
}

// report is an outcome to hand to the ProduceHandler, outside the lock.
type report struct {
	ps     *partState
	msgs   []*Message // acknowledged
	offset int64
	msg    *Message // refused
	err    error
	gen    uint64 // the batch's transaction (TxnStream's)
}

func newSink(p *Producer, id int32, addr string) *sink {
	s := &sink{p: p, id: id, addr: addr, kick: make(chan struct{}, 1),
		answers: make(chan answer, p.cfg.MaxInFlight), done: make(chan struct{}),
		ver: p.ver, perPartition: maxPartitionInFlight}
	p.allSinks = append(p.allSinks, s)
	go s.run()
	return s
}

func (s *sink) wake() {
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

func (s *sink) run() {
	defer close(s.done)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		if wait := s.send(); wait > 0 {
			timer.Reset(wait)
		}
		select {
		case <-s.p.quit:
			s.closeConn()
			return
		case <-s.kick:
		case a := <-s.answers:
			s.handle(a)
		case <-timer.C:
		}
		for more := true; more; {
			select {
			case a := <-s.answers:
				s.handle(a)
			default:
				more = false
			}
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
	}
}

// send sends requests while a slot is free and batches are ready. It
// returns how long until a partition waiting for its backoff (or the
// connection's) may send, 0 when nothing waits for time.
func (s *sink) send() time.Duration {
	for s.inflight < s.p.cfg.MaxInFlight {
		if s.conn == nil {
			now := time.Now()
			s.p.mu.Lock()
			ready, wait := s.ready(now)
			s.p.mu.Unlock()
			if !ready {
				return wait
			}
			if now.Before(s.dialAfter) {
				return s.dialAfter.Sub(now)
			}
			if !s.dial() {
				return time.Until(s.dialAfter)
			}
		}
		s.p.mu.Lock()
		sent, owner, wait := s.build(time.Now())
		if len(sent) > 0 {
			s.p.requests++
		}
		pid, epoch := s.p.pid, s.p.epoch
		var txnID *string
		if owner != nil {
			pid, epoch, txnID = owner.pid, owner.epoch, &owner.cfg.ID
		}
		s.p.mu.Unlock()
		if len(sent) == 0 {
			return wait
		}
		// Encoded outside the lock: a batch in flight is the sink's
		// alone (a bump waits until none is; a split or a refusal
		// renumbers it on this goroutine; a stream's abort waits until
		// none of its batches is in flight).
		req := &sarama.ProduceRequest{Version: s.ver, RequiredAcks: s.p.cfg.Acks, Timeout: int32(s.p.cfg.Timeout / time.Millisecond),
			TransactionalID: txnID}
		for _, sb := range sent {
			rb := sb.b.recordBatch(pid, epoch)
			rb.IsTransactional = owner != nil
			req.AddBatch(sb.ps.topic, sb.ps.partition, rb)
		}
		s.inflight++
		conn := s.conn
		err := conn.Broker().AsyncProduce(req, func(resp *sarama.ProduceResponse, err error) {
			s.answers <- answer{sent: sent, resp: resp, err: err, conn: conn}
		})
		if err != nil {
			// Not sent, or partly: settled as a lost request (its slot
			// is counted, so the channel has room).
			s.answers <- answer{sent: sent, err: err, conn: conn}
			return 0
		}
		if req.RequiredAcks == sarama.NoResponse {
			s.answers <- answer{sent: sent, conn: conn, unanswered: true} // written: all acks 0 learns
		}
	}
	return 0
}

// ready reports whether a partition of s has a batch to send now, or how
// long until one may. The caller holds p.mu.
func (s *sink) ready(now time.Time) (bool, time.Duration) {
	var wait time.Duration
	for _, ps := range s.parts {
		ok, w := s.p.sendable(ps, s.perPartition, now)
		if ok {
			return true, 0
		}
		if w > 0 && (wait == 0 || w < wait) {
			wait = w
		}
	}
	return false, wait
}

// build takes the next batch of each partition that may send, up to
// RequestBytes, starting after the partition that started the last
// request, and puts them in flight. A request carries one transactional
// id: the batches of the first partition's owner (a TxnStream, or nil
// for the Producer's own), which it returns. The caller holds p.mu.
func (s *sink) build(now time.Time) ([]sentBatch, *TxnStream, time.Duration) {
	p := s.p
	var sent []sentBatch
	var owner *TxnStream
	var wait time.Duration
	size, n := 0, len(s.parts)
	for i := range n {
		ps := s.parts[(s.cursor+i)%n]
		if len(sent) > 0 && ps.txn != owner {
			continue // in a request of its own, next
		}
		ok, w := p.sendable(ps, s.perPartition, now)
		if !ok {
			if w > 0 && (wait == 0 || w < wait) {
				wait = w
			}
			continue
		}
		b := ps.next()
		if size > 0 && size+b.size > p.cfg.RequestBytes {
			break
		}
		ps.take()
		owner = ps.txn
		if b.seq < 0 && (p.pid >= 0 || ps.txn != nil) {
			if p.gapAt[ps.topicPartition] {
				delete(p.gapAt, ps.topicPartition)
				ps.nextSeq = addSeq(ps.nextSeq, 1)
			}
			b.seq = ps.nextSeq
			ps.nextSeq = addSeq(ps.nextSeq, int32(len(b.msgs)))
		}
		b.maybe = true
		ps.inflight = append(ps.inflight, b)
		p.maxPartInflight = max(p.maxPartInflight, len(ps.inflight))
		ps.unanswered++
		size += b.size
		sent = append(sent, sentBatch{ps, b})
	}
	if n > 0 {
		s.cursor = (s.cursor + 1) % n
	}
	return sent, owner, wait
}

// dial opens the sink's connection (Close interrupts it) and checks the
// broker serves Produce v3 or later. On failure it sets when to try
// again, and after a few failures in a row has the leaders of its
// partitions looked up again.
func (s *sink) dial() bool {
	c, err := DialConn(s.p.ctx, s.p.sc, s.addr)
	ver := s.p.ver
	if err == nil {
		if ver, err = c.Negotiate(APIKeyProduce, s.p.ver, 3); err != nil {
			c.Close()
		}
	}
	if err == nil {
		s.p.log.Info("produce connection opened", zap.String("addr", s.addr), zap.Int16("produce_version", ver), zap.Int16("ceiling", s.p.ver))
		s.ver, s.perPartition = ver, maxPartitionInFlight
		if ver < 4 {
			s.perPartition = 1
		}
		if s.everOpened {
			s.p.stats.reconnected.Add(1)
		}
		s.conn, s.everOpened, s.dialFails, s.lastDialErr = c, true, 0, nil
		return true
	}
	s.dialFails++
	s.dialAfter = time.Now().Add(s.p.backoff(s.dialFails))
	s.lastDialErr = err
	s.p.log.Debug("cannot connect to broker", zap.Int32("broker", s.id), zap.String("addr", s.addr), zap.Int("failures", s.dialFails), zap.Error(err))
	s.p.mu.Lock()
	defer s.p.mu.Unlock()
	move := s.dialFails >= connFailuresBeforeMove && s.inflight == 0
	for _, ps := range slices.Clone(s.parts) {
		ps.lastErr = fmt.Errorf("kafka: cluster %s broker %d (%s), leader of %s/%d: %w", s.p.name, s.id, s.addr, ps.topic, ps.partition, err)
		if move && len(ps.inflight) == 0 && ps.reported == 0 {
			s.p.detach(ps)
		}
	}
	return false
}

func (s *sink) closeConn() {
	if s.conn != nil {
		s.conn.Close()
		s.conn = nil
	}
}

// handle settles the answer of one request, then reports what it
// decided, outside the lock.
func (s *sink) handle(a answer) {
	s.inflight--
	if a.err != nil && a.conn == s.conn {
		// The connection is broken or timed out: close it (its other
		// requests are answered with the error at once) and dial again.
		s.p.log.Info("produce connection lost; its batches are sent again under their sequences",
			zap.Int32("broker", s.id), zap.String("addr", s.addr), zap.Error(a.err))
		s.closeConn()
	}
	p := s.p
	now := time.Now()
	var reps []report
	p.mu.Lock()
	p.requests--
	if p.closing && p.requests == 0 && p.quiet != nil {
		close(p.quiet)
		p.quiet = nil
	}
	for _, sb := range a.sent {
		err := a.err
		var blk *sarama.ProduceResponseBlock
		if err == nil && !a.unanswered {
			blk = a.resp.GetBlock(sb.ps.topic, sb.ps.partition)
			switch {
			case blk == nil:
				err = sarama.ErrIncompleteResponse
			case !errors.Is(blk.Err, sarama.ErrNoError):
				err = blk.Err
			}
		}
		reps = p.settle(sb.ps, sb.b, blk, err, now, reps)
		if t := sb.ps.txn; t != nil {
			t.wake() // its commit or abort waits for its batches' answers
		}
	}
	bumping := p.bump != ""
	p.mu.Unlock()
	if bumping {
		p.kickResolver() // the bump waits for this drain
	}
	if len(reps) == 0 {
		return
	}
	for _, r := range reps {
		switch {
		case r.ps.txn != nil: // the stream's, reported at its commit
		case r.msg != nil:
			p.h.Refused(r.msg, r.err)
		default:
			p.h.Acked(r.msgs, r.offset)
		}
	}
	p.mu.Lock()
	for _, r := range reps {
		n := len(r.msgs)
		if r.msg != nil {
			n = 1
		}
		r.ps.reported--
		r.ps.pending -= n
		if t := r.ps.txn; t != nil {
			t.reported(r.gen, r.msgs, r.msg, r.err)
		} else {
			p.pending -= n
		}
	}
	if p.pending == 0 && p.drained != nil {
		close(p.drained)
		p.drained = nil
	}
	moving := false
	for _, r := range reps {
		moving = moving || r.ps.sink == nil
	}
	p.mu.Unlock()
	if moving {
		p.kickResolver() // a partition waited for its reports to move
	}
}

// errClass is what the answer for a batch means (docs/RELAY.md §3).
type errClass int

const (
	classAcked     errClass = iota // written (or had already been)
	classSeqLost                   // not written; the broker lost the sequence: drain-and-bump
	classSplit                     // not written; split the batch, or refuse its single record
	classLeader                    // not written; the leader moved: look it up again
	classRetry                     // not written; send again
	classAmbiguous                 // maybe written: send again under the same sequence
	classLost                      // the connection failed: maybe written, look the leader up again
)

func classify(err error) errClass {
	var kerr sarama.KError
	if !errors.As(err, &kerr) {
		if err == nil {
			return classAcked
		}
		return classLost
	}
	switch kerr {
	case sarama.ErrNoError, sarama.ErrDuplicateSequenceNumber:
		return classAcked
	case sarama.ErrOutOfOrderSequenceNumber, sarama.ErrUnknownProducerID, sarama.ErrInvalidProducerIDMapping,
		sarama.ErrInvalidProducerEpoch, sarama.ErrProducerFenced:
		return classSeqLost
	case sarama.ErrMessageSizeTooLarge, sarama.ErrMessageSetSizeTooLarge, sarama.ErrInvalidRecord,
		sarama.ErrInvalidTimestamp, sarama.ErrTopicAuthorizationFailed,
		sarama.ErrPolicyViolation, sarama.ErrUnsupportedForMessageFormat, sarama.ErrInvalidTopic:
		return classSplit
	case sarama.ErrNotLeaderForPartition, sarama.ErrLeaderNotAvailable, sarama.ErrUnknownTopicOrPartition,
		sarama.ErrKafkaStorageError, sarama.ErrFencedLeaderEpoch, sarama.ErrUnknownLeaderEpoch, sarama.ErrReplicaNotAvailable:
		return classLeader
	case sarama.ErrNotEnoughReplicas, sarama.ErrConcurrentTransactions,
		sarama.ErrInvalidMessage: // CORRUPT_MESSAGE: a CRC mismatch on the way, not the record's fault (franz-go retries it)
		return classRetry
	default: // REQUEST_TIMED_OUT, NOT_ENOUGH_REPLICAS_AFTER_APPEND, NETWORK_EXCEPTION, unknown
		return classAmbiguous
	}
}

// settle applies the answer for batch b of ps (err nil: acknowledged at
// blk.Offset) and appends what to report to reps. Only the head of a
// round decides: once it failed, the answers behind it only say whether
// a batch may have been written. The caller holds p.mu.
func (p *Producer) settle(ps *partState, b *batch, blk *sarama.ProduceResponseBlock, err error, now time.Time, reps []report) []report {
	ps.unanswered--
	cls := classify(err)
	switch {
	case ps.failed:
		switch cls {
		case classAcked:
		case classAmbiguous, classLost:
			b.unsure = true
		default:
			b.maybe = b.unsure // this send was refused; an earlier one may have been written
		}
	case len(ps.inflight) == 0 || ps.inflight[0] != b:
		// Cannot happen: a partition's batches are answered in order,
		// on one connection. Settle nothing and send the round again.
		p.log.Error("produce answer out of order; the partition's batches are sent again",
			zap.String("topic", ps.topic), zap.Int32("partition", ps.partition))
		ps.failed = true
	case cls == classAcked:
		ps.popInflight()
		off := int64(-1)
		if blk != nil {
			off = blk.Offset
		}
		if errors.Is(err, sarama.ErrDuplicateSequenceNumber) {
			off = -1
			p.stats.duplicates.Add(1)
		}
		reps = append(reps, report{ps: ps, msgs: b.msgs, offset: off, gen: b.gen})
		ps.reported++
		ps.gate, ps.retries, ps.lastErr, ps.since = false, 0, nil, now
	case ps.txn != nil && ps.txn.ends(err):
		// Fenced, or the transaction must be aborted (§4: no
		// drain-and-bump inside a transaction): nothing of the stream
		// is sent until its abort rebuilds its batches.
		ps.failed = true
		ps.lastErr = fmt.Errorf("kafka: produce to %s/%d on cluster %s in transaction %s: %w", ps.topic, ps.partition, p.name, ps.txn.cfg.ID, err)
		b.maybe, b.unsure = false, false
	default:
		ps.failed = true
		ps.lastErr = fmt.Errorf("kafka: produce to %s/%d on cluster %s: %w", ps.topic, ps.partition, p.name, err)
		switch cls {
		case classSplit:
			ps.retryAt = time.Time{}
			if b.unsure {
				reps = p.refuseUnsure(ps, b, err, reps)
			} else {
				b.maybe = false
				reps = p.splitHead(ps, b, err, reps)
			}
		case classSeqLost:
			// OUT_OF_ORDER_SEQUENCE / UNKNOWN_PRODUCER_ID to the head: the
			// broker has not got its sequence (a written head would be
			// answered as a duplicate: its last 5 batches are cached), so
			// not written, whatever an earlier answer left open. An epoch
			// refusal says nothing of an earlier send, but nothing can be
			// sent under this id any more: renumbered, it may be written
			// twice (a non-transactional id is never fenced by another).
			if b.unsure && !errors.Is(err, sarama.ErrOutOfOrderSequenceNumber) && !errors.Is(err, sarama.ErrUnknownProducerID) {
				p.log.Warn("a batch whose earlier send went unanswered is renumbered after an epoch refusal: it may be written twice",
					zap.String("topic", ps.topic), zap.Int32("partition", ps.partition), zap.Error(err))
			}
			b.maybe, b.unsure = false, false
			if p.bump == "" {
				p.bump = fmt.Sprintf("%s on %s/%d", err, ps.topic, ps.partition)
			}
			p.retryLater(ps, now)
		case classLeader:
			b.maybe = b.unsure
			ps.refresh = true
			p.retryLater(ps, now)
		case classLost:
			b.unsure = true
			ps.refresh = true
			p.retryLater(ps, now)
		case classRetry:
			b.maybe = b.unsure
			p.retryLater(ps, now)
		default:
			b.unsure = true
			p.retryLater(ps, now)
		}
	}
	if ps.failed && ps.unanswered == 0 {
		p.endRound(ps)
	}
	return reps
}

func (p *Producer) retryLater(ps *partState, now time.Time) {
	ps.retries++
	ps.retryAt = now.Add(p.backoff(ps.retries))
}

// splitHead handles a head batch refused as too large or invalid: split
// in place keeping its sequence range, or, for a single record, refused
// for good and the sequences behind it moved down by one (none of them
// can have been written past the gap).
func (p *Producer) splitHead(ps *partState, b *batch, err error, reps []report) []report {
	if len(b.msgs) > 1 {
		h1, h2 := b.split()
		ps.inflight = append([]*batch{h1, h2}, ps.inflight[1:]...)
		p.stats.splits.Add(1)
		return reps
	}
	ps.popInflight()
	for _, l := range [][]*batch{ps.inflight, ps.queue} {
		for _, later := range l {
			if later.seq >= 0 {
				later.seq = addSeq(later.seq, -1)
			}
		}
	}
	ps.nextSeq = addSeq(ps.nextSeq, -1)
	p.stats.refused.Add(1)
	ps.reported++
	p.log.Warn("destination refused a record for good", zap.String("topic", ps.topic), zap.Int32("partition", ps.partition),
		zap.Int("size", len(b.msgs[0].Value)), zap.Error(err))
	return append(reps, report{ps: ps, msg: b.msgs[0], err: err, gen: b.gen})
}

// refuseUnsure handles a head batch refused for good (too large,
// invalid, not authorised: checks Kafka runs before its duplicate check)
// after an earlier send's answer was lost: that send may be in the log.
// Resending cannot tell (the refusal comes first) and the refusal may
// well be permanent (max.message.bytes lowered), so its records are
// reported refused with an error that says they may have been written:
// the router chooses (dead letter, or block). Its sequences stay used:
// lowering those behind it would have the next batch answered as a
// duplicate of it, and lost. A bump (a new producer id, whose sequences
// the broker has no cache of) comes before anything behind it is sent;
// the drain resends the batches behind it that are themselves unsure.
// Not split: halves match none of the broker's cached batches.
func (p *Producer) refuseUnsure(ps *partState, b *batch, err error, reps []report) []report {
	ps.popInflight()
	if p.bump == "" && p.pid >= 0 && ps.txn == nil { // acks 0 or 1: no producer id, no sequences to collide; a stream aborts instead
		p.bump = fmt.Sprintf("%s on %s/%d after an unanswered send", err, ps.topic, ps.partition)
	}
	rerr := fmt.Errorf("kafka: %s/%d on cluster %s refused a resend of %d record(s) whose first send went unanswered: "+
		"they may have been written once; the resend was refused: %w", ps.topic, ps.partition, p.name, len(b.msgs), err)
	p.stats.refused.Add(int64(len(b.msgs)))
	p.log.Warn("destination refused for good records that may have been written (an earlier send went unanswered)",
		zap.String("topic", ps.topic), zap.Int32("partition", ps.partition), zap.Int("records", len(b.msgs)), zap.Error(err))
	for _, m := range b.msgs {
		ps.reported++
		reps = append(reps, report{ps: ps, msg: m, err: rerr, gen: b.gen})
	}
	return reps
}

// endRound puts a failed round's batches back at the head of the queue,
// under their sequences, to be sent again one at a time until one is
// acknowledged; with the leader looked up again if asked.
func (p *Producer) endRound(ps *partState) {
	ps.queue = append(slices.Clip(ps.inflight), ps.queue...)
	ps.inflight = nil
	ps.failed, ps.gate = false, true
	p.stats.retries.Add(1)
	if ps.refresh {
		p.detach(ps)
	}
}

// detach takes ps from its sink, for the resolver to find its leader.
// The caller holds p.mu; nothing of ps is in flight.
func (p *Producer) detach(ps *partState) {
	if s := ps.sink; s != nil {
		s.parts = slices.DeleteFunc(s.parts, func(o *partState) bool { return o == ps })
	}
	ps.sink, ps.refresh = nil, true
	p.kickResolver()
}

// sendable reports whether ps may send its next batch now (with at most
// perPartition of its batches in flight), or how long until its backoff
// ends. The caller holds p.mu.
func (p *Producer) sendable(ps *partState, perPartition int, now time.Time) (bool, time.Duration) {
	b := ps.next()
	switch {
	case b == nil, ps.failed, p.closing,
		len(ps.inflight) >= perPartition,
		p.pid < 0 && ps.txn == nil && len(ps.inflight) > 0, // no sequences: one batch at a time keeps the order
		ps.gate && len(ps.inflight) > 0,
		ps.txn != nil && !ps.txn.mayStart(ps, b):
		return false, 0
	case p.bump != "" && ps.txn == nil && !(b.maybe && len(ps.inflight) == 0):
		// Draining for a bump: only a batch that may have been written
		// is sent again, under its old sequence, until it is settled.
		return false, 0
	case now.Before(ps.retryAt):
		return false, ps.retryAt.Sub(now)
	}
	return true, 0
}

// next is the batch ps sends next: the queue's head, else the open batch.
func (ps *partState) next() *batch {
	if len(ps.queue) > 0 {
		return ps.queue[0]
	}
	return ps.open
}

// popInflight removes the oldest batch in flight. Its slot is cleared
// first: a slice's backing array keeps every pointer in it reachable,
// those before the slice's start too, and a settled batch's messages
// hold the fetched responses their values slice.
func (ps *partState) popInflight() {
	ps.inflight[0] = nil
	ps.inflight = ps.inflight[1:]
}

// take removes next() from ps.
func (ps *partState) take() {
	if len(ps.queue) > 0 {
		ps.queue[0] = nil
		ps.queue = ps.queue[1:]
		return
	}
	ps.open = nil
}

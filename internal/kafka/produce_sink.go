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

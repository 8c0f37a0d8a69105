package kafka

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"
)

// errClass is what the answer for a batch means (docs/RELAY.md §3).
type errClass int

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
		reps = p.acked(ps, b, blk, err, now, reps)
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
		reps = p.headFailed(ps, b, cls, err, now, reps)
	}
	if ps.failed && ps.unanswered == 0 {
		p.endRound(ps)
	}
	return reps
}

// acked settles b, the head of ps's round, written (at blk.Offset; -1 when
// the broker had it already).
func (p *Producer) acked(ps *partState, b *batch, blk *sarama.ProduceResponseBlock, err error, now time.Time, reps []report) []report {
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
	return reps
}

// headFailed settles b, the head of ps's round, refused with err (of class
// cls): split, renumbered, or sent again after a pause, as the class says.
func (p *Producer) headFailed(ps *partState, b *batch, cls errClass, err error, now time.Time, reps []report) []report {
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

const (
	classAcked     errClass = iota // written (or had already been)
	classSeqLost                   // not written; the broker lost the sequence: drain-and-bump
	classSplit                     // not written; split the batch, or refuse its single record
	classLeader                    // not written; the leader moved: look it up again
	classRetry                     // not written; send again
	classAmbiguous                 // maybe written: send again under the same sequence
	classLost                      // the connection failed: maybe written, look the leader up again
)

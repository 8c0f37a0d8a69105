package routing

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/offsets"
)

// commit commits the open transaction with the position it completes,
// then acknowledges its records. An abortable failure aborts it and
// sends the same records again in a new one. It reports whether the
// producer should close: idle for long, or failed for good (fenced: the
// partition has a new owner, whose consumption redoes what this owner did
// not commit).
//
// The commit's round trips run without mu: records handed meanwhile are
// queued (committing) and admitted into the next transaction after it.
func (t *txnProducer) commit() (closeIt bool) {
	t.mu.Lock()
	w, val, ready, closeIt := t.beginCommit()
	t.mu.Unlock()
	if !ready {
		return closeIt
	}
	refused, err := w.commit([]byte(t.key.positionKey(t.set.fleet)), val)
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.endCommit(refused, err)
}

// beginCommit, under mu, settles what must be settled before a commit
// (a failed producer, an alignment timed out, an idle one) and, when a
// transaction is open, marks it committing and returns its wire and the
// position to write (ready). Otherwise closeIt says whether the producer
// should close.
func (t *txnProducer) beginCommit() (w *txnWire, val []byte, ready, closeIt bool) {
	if t.failed != nil {
		t.dropAll()
		return nil, nil, false, true
	}
	if t.broken != nil {
		return nil, nil, false, false // reopen's business
	}
	if a := t.align; a != nil && time.Since(a.since) >= alignTimeout {
		held := a.held
		t.endAlign(0, "timed out")
		for _, h := range held {
			if err := t.put(h); err != nil {
				t.dropAll()
				return nil, nil, false, true
			}
		}
	}
	if !t.inTxn {
		if t.align != nil || len(t.queued) > 0 {
			t.idle = 0 // records held while a copy is aligned
		} else {
			t.idle++
		}
		return nil, nil, false, t.idle >= txnIdleTicks
	}
	t.settlePos()
	val, err := json.Marshal(t.pos)
	if err != nil {
		t.fail(err)
		t.dropAll()
		return nil, nil, false, true
	}
	t.committing = true
	return t.w, val, true, false
}

// endCommit, under mu, applies a commit's outcome: the records
// acknowledged; or, aborted, sent again in the next transaction; or the
// wire broken (reopen); or fenced. It reports whether the producer
// should close.
func (t *txnProducer) endCommit(refused []*outMsg, err error) (closeIt bool) {
	t.committing = false
	defer t.admitQueued()
	if err == nil {
		t.r.countTxn(t.key.cluster, "committed")
		t.inTxn, t.bytes = false, 0
		pos := t.pos
		t.committed = &pos
		t.pos.Done, t.pos.IDs = nil, nil // the next transaction's start from copies of pos's
		msgs := t.msgs
		t.msgs = nil
		for _, om := range msgs {
			t.r.produced(om)
		}
		return false
	}
	if errors.Is(err, kafka.ErrTxnAborted) && !fenced(err) {
		t.log.Warn("transaction aborted; its records are sent again in the next", zap.String("cluster", t.key.cluster),
			zap.String("stream", t.key.positionKey(t.set.fleet)), zap.Int("records", len(t.msgs)), zap.Int("refused", len(refused)), zap.Error(err))
		t.r.countTxn(t.key.cluster, "aborted")
		t.refusedInTxn(refused, err)
		return false
	}
	if t.fail(fmt.Errorf("transaction on cluster %s failed: %w", t.key.cluster, err)); t.broken != nil {
		t.r.countTxn(t.key.cluster, "failed")
		t.log.Warn("transactional producer failed; it is opened again and its open transaction's records sent again",
			zap.String("cluster", t.key.cluster), zap.String("stream", t.key.positionKey(t.set.fleet)), zap.Int("records", len(t.msgs)), zap.Error(err))
		return false
	}
	if fenced(err) {
		t.r.countTxn(t.key.cluster, "fenced")
		t.set.markFenced(t.key, t.own)
		t.log.Info("transactional producer fenced: the partition has a new owner", zap.String("cluster", t.key.cluster),
			zap.String("stream", t.key.positionKey(t.set.fleet)))
	}
	t.dropAll()
	return true
}

// settlePos completes pos with posRec: its copy's done offset and its
// fingerprint. Called with mu held, while posRec is not acknowledged (its
// key and value are whole until then: record.Handler).
func (t *txnProducer) settlePos() {
	if r := t.posRec; r != nil {
		markDone(t.pos.Done, t.pos.IDs, r)
		t.pos.Fingerprint, t.posRec = offsets.FingerprintOf(r.Key, r.Value, r.Timestamp), nil
	}
}

// refusedInTxn takes out of the open transaction the records a
// destination refused for good in the one just aborted (the stream names
// them; they are not in the new one). With a dead-letter channel
// they go there, at least once, as at_least_once produces refused do;
// without one, or for an error the router does not take for a refusal,
// they are put in the transaction again: it is refused and aborted again,
// and the stream's records wait until the routes change, as an
// at_least_once partition blocks. Called with mu held.
func (t *txnProducer) refusedInTxn(refused []*outMsg, err error) {
	if len(refused) == 0 {
		return
	}
	if slices.ContainsFunc(refused, func(om *outMsg) bool { return om.d.rec == t.posRec }) {
		t.settlePos() // now: dead-lettered, it may be acknowledged (and let go of its value) before the next commit
	}
	t.msgs = slices.DeleteFunc(t.msgs, func(om *outMsg) bool { return slices.Contains(refused, om) })
	var ae *kafka.TxnAbortedError
	cause := err
	if errors.As(err, &ae) {
		cause = ae.Err
	}
	if t.r.cur.Load().deadLetter != nil && permanent(cause) {
		for _, om := range refused {
			t.r.failed(om, cause)
		}
		return
	}
	t.log.Error("a destination refused a record of a transaction for good and there is no dead-letter channel; the stream's transactions abort until the routes change",
		zap.String("cluster", t.key.cluster), zap.String("stream", t.key.positionKey(t.set.fleet)), zap.Int("refused", len(refused)), zap.Error(cause))
	for _, om := range refused {
		if t.w.send(om) != nil {
			t.r.settle(om) // the wire failed: consumed again from the committed position
			continue
		}
		t.msgs = append(t.msgs, om)
	}
}

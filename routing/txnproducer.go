package routing

import (
	"cmp"
	"context"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/record"
)

// txnProducer is the transactional producer of one stream on one cluster
// for one owner.
type txnProducer struct {
	key txnKey
	own owner
	set *txnSet
	// r is the router whose records the producer settles (produced,
	// skipped, failed); log is its logger.
	r   *Router
	log *zap.Logger
	w   *txnWire // replaced, under mu, when it broke (reopen)
	// committed is the position of the last committed transaction (read
	// at open, then ours); nil when there is none.
	committed *TxnPosition

	mu   sync.Mutex
	msgs []*outMsg   // in the open transaction
	pos  TxnPosition // after the last record in the open transaction, but its Fingerprint
	// posRec is the last record in the open transaction: pos's
	// Fingerprint is hashed from it at the commit, not at every record
	// (FNV over the key and value was a microsecond per KiB record).
	// posRec is also the one record of its copy not yet marked in pos's
	// Done: a copy's records come in offset order, so only the last one
	// moves it (markDone once per copy and transaction, not per record).
	posRec *record.Record
	inTxn  bool
	failed error // fenced: the partition has a new owner
	// broken is set when the wire failed otherwise (its cluster went
	// away, or a commit's outcome is unknown): the loop opens another,
	// which aborts what was not committed, and sends the open
	// transaction's records again.
	broken error
	align  *alignment
	// committing is set while CommitTxn runs without mu; records handed
	// meanwhile are queued for the next transaction.
	committing bool
	queued     []*outMsg
	// aligned are the copies aligned with the committed position.
	aligned map[string]bool
	idle    int // commit ticks without a record
	// bytes is what the open transaction's records weigh (keys and
	// values); at txnCommitBytes put kicks run to commit before the
	// interval ends.
	bytes    int
	kick     chan struct{} // 1-buffered
	stop     chan struct{}
	stopOnce sync.Once // closes stop
	done     chan struct{}
	shut     sync.Once // closes w
}

// txnCommitBytes is what an open transaction's records weigh when it is
// committed without waiting for the transaction interval. Its records are
// acknowledged to the agent only at the commit, so they count against
// source.max_in_flight_mib until then: at the 50 ms default interval a
// fast stream filled the budget, and the fetching waited for the commits
// (exactly_once moved half what at_least_once did).
const txnCommitBytes = 1 << 20

// txnIdleTicks is how many transaction intervals a producer waits without
// a record before it closes.
const txnIdleTicks = 600

// halt ends the producer's loop; any goroutine may call it, more than
// once.
func (t *txnProducer) halt() { t.stopOnce.Do(func() { close(t.stop) }) }

// stopped is the end of the loop of a producer halted after it failed
// (fenced, or released): what it holds is dropped unacknowledged, and it
// is closed, in the background (a producer whose cluster is failing may
// take its retries to close). A producer halted otherwise is closed by
// close.
func (t *txnProducer) stopped() {
	t.mu.Lock()
	failed := t.failed
	dropped := len(t.msgs) + len(t.queued)
	if a := t.align; a != nil {
		dropped += len(a.held)
	}
	if failed != nil {
		t.dropAll()
	}
	t.mu.Unlock()
	if failed == nil {
		return
	}
	if dropped > 0 {
		t.log.Info("transactional producer stopped: its records not committed are dropped, for the partition's next owner to deliver",
			zap.String("cluster", t.key.cluster), zap.String("stream", t.key.positionKey(t.set.fleet)), zap.Int("records", dropped), zap.Error(failed))
	}
	t.set.wg.Go(t.closeProducer)
}

// add puts om in the open transaction, beginning one if needed. It does
// not wait on the network.
func (t *txnProducer) add(om *outMsg) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.failed != nil {
		return t.failed
	}
	if t.broken != nil {
		return fmt.Errorf("transactional producer of %s on %s being opened again: %w", t.key.positionKey(t.set.fleet), t.key.cluster, t.broken)
	}
	if t.committing {
		// The partition's loop does not wait for the commit: the
		// record joins the next transaction when it ends.
		t.queued = append(t.queued, om)
		return nil
	}
	return t.admit(om)
}

// admit puts om in the open transaction, or holds or skips it while a
// copy is aligned. Called with mu held.
func (t *txnProducer) admit(om *outMsg) error {
	rec := om.d.rec
	if t.align == nil && t.mustAlign(rec) {
		t.align = &alignment{copy: physical(rec.Cluster, rec.Topic, rec.Partition), since: time.Now()}
	}
	if a := t.align; a != nil {
		c := t.committed
		ts := rec.Timestamp.UnixMilli()
		switch {
		case ts == c.TimestampMs && offsets.FingerprintOf(rec.Key, rec.Value, rec.Timestamp) == c.Fingerprint:
			// The last record committed, on this copy: it and what
			// came before it here were delivered from the other copy.
			for _, h := range append(a.held, om) {
				t.r.skip(h)
			}
			t.endAlign(len(a.held)+1, "matched")
			return nil
		case ts <= c.TimestampMs:
			a.held = append(a.held, om) // before the last committed record, or it
			return nil
		default: // after it: the copy does not hold it where expected
			held := a.held
			t.endAlign(0, "passed")
			for _, h := range held {
				if err := t.put(h); err != nil {
					return err
				}
			}
		}
	}
	return t.put(om)
}

// put adds om to the open transaction, beginning one if needed. Called
// with mu held.
func (t *txnProducer) put(om *outMsg) error {
	if err := t.w.send(om); err != nil {
		return t.fail(fmt.Errorf("transactional producer of %s on %s: %w", t.key.positionKey(t.set.fleet), t.key.cluster, err))
	}
	t.inTxn = true
	rec := om.d.rec
	t.msgs = append(t.msgs, om)
	t.idle = 0
	if t.bytes += len(rec.Key) + len(rec.Value); t.bytes >= txnCommitBytes {
		select {
		case t.kick <- struct{}{}:
		default:
		}
	}
	done, ids := t.pos.Done, t.pos.IDs
	if done == nil {
		done, ids = t.committed.carried()
	}
	if p := t.posRec; p != nil && (p.Cluster != rec.Cluster || p.Topic != rec.Topic || p.Partition != rec.Partition || p.TopicID != rec.TopicID) {
		markDone(done, ids, p) // the last of another copy's records: its copy is done to there
	}
	t.pos = TxnPosition{Cluster: rec.Cluster, Topic: rec.Topic, Partition: rec.Partition, Offset: rec.Offset + 1,
		TimestampMs: rec.Timestamp.UnixMilli(), Generation: rec.Generation, Session: rec.Session, Done: done, IDs: ids}
	t.posRec = rec
	return nil
}

// fail marks the producer fenced or broken; called with mu held.
func (t *txnProducer) fail(err error) error {
	if fenced(err) {
		t.failed = err
	} else {
		t.broken = err
	}
	return err
}

// run commits the open transaction every transaction interval, or sooner
// when it weighs txnCommitBytes, until the producer is closed.
func (t *txnProducer) run() {
	defer close(t.done)
	t.set.mu.Lock()
	// A configuration built in code without config.Validate has none.
	interval := cmp.Or(t.set.clusters[t.key.cluster].TransactionInterval, config.DefaultTransactionInterval)
	t.set.mu.Unlock()
	tick := time.NewTicker(max(interval, 10*time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-t.stop:
			t.stopped()
			return
		case <-tick.C:
		case <-t.kick:
			t.mu.Lock()
			open := t.inTxn // not if a commit since the kick took its records: a commit of nothing counts an idle tick
			t.mu.Unlock()
			if !open {
				continue
			}
		}
		if t.reopen() {
			continue
		}
		if t.commit() {
			t.retire()
			return
		}
	}
}

// retire removes an idle or failed producer from the set and closes it.
func (t *txnProducer) retire() {
	s := t.set
	s.mu.Lock()
	if s.live[t.key] == t {
		delete(s.live, t.key)
	}
	s.mu.Unlock()
	t.closeProducer()
}

func (t *txnProducer) closeProducer() {
	t.mu.Lock()
	w := t.w
	t.mu.Unlock()
	t.shut.Do(w.close)
}

// place readies om for its wire (txnWire.place) before any produce of
// its record is handed over.
func (t *txnProducer) place(ctx context.Context, om *outMsg, wait time.Duration) error {
	t.mu.Lock()
	w := t.w
	t.mu.Unlock()
	return w.place(ctx, om, wait)
}

// covers reports whether rec was produced by a committed transaction.
func (t *txnProducer) covers(rec *record.Record) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.committed.covers(rec)
}

// reopen replaces a broken wire (see broken) and reports
// whether it tried. The new one aborts what the old one did not commit;
// the records of the open transaction are then skipped if the position
// read says that their transaction did commit (the commit's answer was
// lost), and sent again in a new one otherwise. A failed attempt is tried
// again at the next tick.
func (t *txnProducer) reopen() bool {
	t.mu.Lock()
	broken, failed := t.broken, t.failed
	t.mu.Unlock()
	if broken == nil || failed != nil {
		return false // failed: released or fenced, never opened again
	}
	w, committed, err := t.set.openWire(t.key)
	if err != nil {
		t.log.Debug("transactional producer not opened again yet", zap.String("cluster", t.key.cluster), zap.Error(err))
		return true
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.failed != nil {
		// Released while it opened: its opening fenced whoever opened
		// the stream's producer meanwhile (release waited for it, at
		// most releaseWait).
		t.set.wg.Go(w.close)
		return true
	}
	old := t.w
	t.set.wg.Go(old.close) // a broken producer's Close may wait for its retries
	t.w, t.committed, t.broken, t.inTxn = w, committed, nil, false
	t.shut = sync.Once{}
	msgs := t.msgs
	t.msgs, t.pos.Done, t.pos.IDs, t.posRec, t.bytes = nil, nil, nil, nil, 0
	skipped := 0
	for i, om := range msgs {
		if committed.covers(om.d.rec) {
			t.r.skip(om)
			skipped++
			continue
		}
		if err := t.put(om); err != nil {
			// Broken again: the rest wait for the next attempt.
			t.msgs = append(t.msgs, msgs[i:]...)
			break
		}
	}
	if t.broken == nil {
		t.admitQueued()
	}
	t.log.Info("transactional producer opened again", zap.String("cluster", t.key.cluster),
		zap.String("stream", t.key.positionKey(t.set.fleet)), zap.Int("committed_before", skipped), zap.Int("sent_again", len(msgs)-skipped))
	return true
}

// admitQueued puts the records queued during a commit in the next
// transaction; those that cannot go in yet (the producer failed) stay
// queued. Called with mu held.
func (t *txnProducer) admitQueued() {
	if t.failed != nil || t.broken != nil {
		return
	}
	q := t.queued
	t.queued = nil
	for i, om := range q {
		if err := t.admit(om); err != nil {
			t.queued = append(q[i:i:i], q[i:]...)
			return
		}
	}
}

// dropAll forgets the open transaction's records without acknowledging
// them: they are consumed again (by this agent or the partition's next
// owner) from the last committed position. Called with mu held.
func (t *txnProducer) dropAll() {
	for _, om := range t.msgs {
		t.r.settle(om)
	}
	if a := t.align; a != nil {
		for _, om := range a.held {
			t.r.settle(om)
		}
		t.align = nil
	}
	for _, om := range t.queued {
		t.r.settle(om)
	}
	t.msgs, t.queued = nil, nil
	t.inTxn = false
}

// close commits what the producer holds and closes it.
func (t *txnProducer) close() {
	t.halt()
	<-t.done
	t.commit()
	t.mu.Lock()
	t.dropAll()
	t.mu.Unlock()
	t.closeProducer()
}

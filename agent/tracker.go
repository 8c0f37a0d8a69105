package agent

import (
	"sync"
	"time"

	"github.com/kswitch/kswitch/offsets"
)

// pending is the tracker's state of one record delivered to the handler,
// allocated with the record (Record.pending).
type pending struct {
	fp     offsets.Fingerprint
	hashed bool // fp is set
	acked  bool
}

// fingerprint returns r's fingerprint, hashing the record the first time:
// only the last offsets.MaxFingerprints records before a commit position
// are ever fingerprinted, so the hot path (deliver, ack) hashes nothing.
func fingerprint(r *Record) offsets.Fingerprint {
	if p := &r.pending; !p.hashed {
		p.fp, p.hashed = offsets.FingerprintOf(r.Key, r.Value, r.Timestamp), true
	}
	return r.pending.fp
}

// tracker follows one partition's delivered and acknowledged records and
// derives the position that may be committed: just past the longest
// acknowledged prefix. Methods are safe for concurrent use; the partition
// loop delivers, any goroutine acks.
type tracker struct {
	mu      sync.Mutex
	queue   []*Record // delivered, in offset order; head is the oldest unacked
	next    int64     // committable: next offset to consume
	lastTS  time.Time // timestamp of record next-1
	last    []*Record // the acknowledged records just before next, at most offsets.MaxFingerprints
	drained *sync.Cond
	max     int           // bound on the records delivered and not acknowledged
	out     int           // records delivered and not acknowledged
	room    chan struct{} // closed by the next ack; nil unless deliver found no room
}

func newTracker(start int64, maxInFlight int) *tracker {
	t := &tracker{next: start, max: maxInFlight}
	t.drained = sync.NewCond(&t.mu)
	return t
}

// deliver records that r is being handed to the handler, and returns nil;
// or, when the records delivered and not acknowledged number the bound,
// it records nothing and returns a channel closed by the next ack.
func (t *tracker) deliver(r *Record) (full <-chan struct{}) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.out >= t.max {
		if t.room == nil {
			t.room = make(chan struct{})
		}
		return t.room
	}
	t.out++
	r.pending = pending{}
	t.queue = append(t.queue, r)
	r.t = t
	return nil
}

func (t *tracker) ack(r *Record) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if r.pending.acked {
		return
	}
	r.pending.acked = true
	t.out--
	if t.room != nil {
		close(t.room)
		t.room = nil
	}
	n := 0
	for n < len(t.queue) && t.queue[n].pending.acked {
		h := t.queue[n]
		t.next, t.lastTS = h.Offset+1, h.Timestamp
		n++
	}
	if n > 0 {
		// Keep the last MaxFingerprints records passed.
		last := append(t.last, t.queue[:n]...)
		if drop := len(last) - offsets.MaxFingerprints; drop > 0 {
			copy(last, last[drop:])
			clear(last[offsets.MaxFingerprints:])
			last = last[:offsets.MaxFingerprints]
		}
		t.last = last
		clear(t.queue[:n])
		t.queue = t.queue[n:]
	}
	if len(t.queue) == 0 {
		t.drained.Broadcast()
	}
}

// position returns the committable position: the next offset to consume,
// the timestamp and fingerprints of the records before it.
func (t *tracker) position() (next int64, ts time.Time, fps []offsets.Fingerprint) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, r := range t.last {
		fps = append(fps, fingerprint(r))
	}
	return t.next, t.lastTS, fps
}

// progress returns the committable position and how many delivered
// records are not yet acknowledged in order.
func (t *tracker) progress() (next int64, unacked int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.next, len(t.queue)
}

// unacked returns the number of delivered records not yet acknowledged
// in order.
func (t *tracker) unacked() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.queue)
}

// waitDrained waits until every delivered record is acknowledged or the
// timeout passes, and reports whether it drained.
func (t *tracker) waitDrained(timeout time.Duration) bool {
	done := make(chan struct{})
	timer := time.AfterFunc(timeout, func() {
		t.mu.Lock()
		close(done)
		t.drained.Broadcast()
		t.mu.Unlock()
	})
	defer timer.Stop()
	t.mu.Lock()
	defer t.mu.Unlock()
	for len(t.queue) > 0 {
		select {
		case <-done:
			return false
		default:
		}
		t.drained.Wait()
	}
	return true
}

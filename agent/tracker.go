package agent

import (
	"sync"
	"time"

	"github.com/kswitch/kswitch/offsets"
)

// pending is one record delivered to the handler and not yet passed by
// the commit position.
type pending struct {
	offset     int64
	ts         time.Time
	key, value []byte // kept for the fingerprint, computed only if needed
	fp         offsets.Fingerprint
	hashed     bool // fp is set
	acked      bool
}

// fingerprint returns p's fingerprint, hashing the record the first time:
// only the last offsets.MaxFingerprints records before a commit position
// are ever fingerprinted, so the hot path (deliver, ack) hashes nothing.
func (p *pending) fingerprint() offsets.Fingerprint {
	if !p.hashed {
		p.fp, p.hashed = offsets.FingerprintOf(p.key, p.value, p.ts), true
		p.key, p.value = nil, nil
	}
	return p.fp
}

// tracker follows one partition's delivered and acknowledged records and
// derives the position that may be committed: just past the longest
// acknowledged prefix. Methods are safe for concurrent use; the partition
// loop delivers, any goroutine acks.
type tracker struct {
	mu      sync.Mutex
	queue   []*pending // delivered, in offset order; head is the oldest unacked
	next    int64      // committable: next offset to consume
	lastTS  time.Time  // timestamp of record next-1
	last    []*pending // the acknowledged records just before next, at most offsets.MaxFingerprints
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
	p := &r.pending // allocated with the record
	*p = pending{offset: r.Offset, ts: r.Timestamp, key: r.Key, value: r.Value}
	t.queue = append(t.queue, p)
	r.entry, r.t = p, t
	return nil
}

func (t *tracker) ack(p *pending) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if p.acked {
		return
	}
	p.acked = true
	t.out--
	if t.room != nil {
		close(t.room)
		t.room = nil
	}
	n := 0
	for n < len(t.queue) && t.queue[n].acked {
		h := t.queue[n]
		t.next, t.lastTS = h.offset+1, h.ts
		n++
	}
	if n > 0 {
		// Keep the last MaxFingerprints records passed, and let go of
		// the bytes of the others.
		last := append(t.last, t.queue[:n]...)
		if drop := len(last) - offsets.MaxFingerprints; drop > 0 {
			for _, p := range last[:drop] {
				p.key, p.value = nil, nil
			}
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
	for _, p := range t.last {
		fps = append(fps, p.fingerprint())
	}
	return t.next, t.lastTS, fps
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

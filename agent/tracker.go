package agent

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/record"
)

// delivery is a record handed to the handler with the tracker's state of
// it, allocated together: the record's Ack reaches the tracker through it.
type delivery struct {
	rec     record.Record
	t       *tracker // set once delivered
	pending pending
	// chunk is the fetched chunk the record is of: its first
	// acknowledgement counts down the chunk's records.
	chunk *chunkRef
}

// Ack tells the tracker that d's record is acknowledged (record.Acker).
func (d *delivery) Ack() {
	if d.t != nil && d.t.ack(d) && d.chunk != nil {
		d.chunk.acked()
	}
}

// chunkRef counts the records of a fetched chunk not yet acknowledged:
// the chunk is released (its response's bytes given back to the agent's
// budget, once every chunk of that response is) when the last one is.
// The partition's stop releases the chunks whose records it dropped.
type chunkRef struct {
	c    *kafka.Chunk
	left atomic.Int64
	// ds is the deliveries of the chunk's records (deliverChunk), set
	// before the first is delivered. Once the committable position passes
	// the last, the tracker drops their keys, values and headers (passed).
	ds []delivery
}

// passed is called, under the tracker's lock, once the committable
// position is past the chunk's last record: every record of it is
// acknowledged. Their keys, values and headers are slices of the fetch
// response (or of a batch decompressed from it), which the budget has
// already been given back: the records the tracker keeps for the
// fingerprints of the next commit (tracker.last) are hashed now, and
// every delivery of the chunk lets go of the response's bytes. Kept until
// they left tracker.last, they held a response per partition past the
// budget: 50 MiB of 100 MiB live in one agent relaying 1 KiB records at
// the default source.max_in_flight_mib of 32.
func (r *chunkRef) passed(last []*delivery) {
	for _, d := range last {
		if d.chunk == r {
			fingerprint(d)
		}
	}
	for i := range r.ds {
		rec := &r.ds[i].rec
		rec.Key, rec.Value, rec.Headers = nil, nil, nil
	}
}

// isLast reports whether d is the last record of its chunk.
func (d *delivery) isLast() bool {
	return d.chunk != nil && len(d.chunk.ds) > 0 && d == &d.chunk.ds[len(d.chunk.ds)-1]
}

func newChunkRef(c *kafka.Chunk) *chunkRef {
	r := &chunkRef{c: c}
	r.left.Store(int64(len(c.Records)))
	if len(c.Records) == 0 {
		c.Release()
	}
	return r
}

func (r *chunkRef) acked() {
	if r.left.Add(-1) == 0 {
		r.c.Release()
	}
}

// done reports whether every record of the chunk is acknowledged.
func (r *chunkRef) done() bool { return r.left.Load() <= 0 }

// pending is the tracker's state of one delivered record.
type pending struct {
	fp     offsets.Fingerprint
	hashed bool // fp is set
	acked  bool
}

// fingerprint returns r's fingerprint, hashing the record the first time:
// only the last offsets.MaxFingerprints records before a commit position
// are ever fingerprinted, so the hot path (deliver, ack) hashes nothing.
func fingerprint(d *delivery) offsets.Fingerprint {
	if p := &d.pending; !p.hashed {
		p.fp, p.hashed = offsets.FingerprintOf(d.rec.Key, d.rec.Value, d.rec.Timestamp), true
	}
	return d.pending.fp
}

// tracker follows one partition's delivered and acknowledged records and
// derives the position that may be committed: just past the longest
// acknowledged prefix. Methods are safe for concurrent use; the partition
// loop delivers, any goroutine acks.
type tracker struct {
	mu      sync.Mutex
	queue   []*delivery // delivered, in offset order; head is the oldest unacked
	next    int64       // committable: next offset to consume
	lastTS  time.Time   // timestamp of record next-1
	last    []*delivery // the acknowledged records just before next, at most offsets.MaxFingerprints
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
// it records nothing and returns a channel closed when there may be room.
// (The agent's byte budget is charged by the Fetcher, per response.)
func (t *tracker) deliver(d *delivery) (full <-chan struct{}) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.out >= t.max {
		if t.room == nil {
			t.room = make(chan struct{})
		}
		return t.room
	}
	t.out++
	d.pending = pending{}
	t.queue = append(t.queue, d)
	d.t = t
	d.rec.SetAcker(d)
	return nil
}

// ack records d's acknowledgement and reports whether it is the first.
func (t *tracker) ack(d *delivery) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if d.pending.acked {
		return false
	}
	d.pending.acked = true
	t.out--
	if t.room != nil {
		close(t.room)
		t.room = nil
	}
	n := 0
	for n < len(t.queue) && t.queue[n].pending.acked {
		h := &t.queue[n].rec
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
		for _, d := range t.queue[:n] {
			if d.isLast() {
				d.chunk.passed(last)
			}
		}
		clear(t.queue[:n])
		t.queue = t.queue[n:]
	}
	if len(t.queue) == 0 {
		t.drained.Broadcast()
	}
	return true
}

// position returns the committable position: the next offset to consume,
// the timestamp and fingerprints of the records before it.
func (t *tracker) position() (next int64, ts time.Time, fps []offsets.Fingerprint) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, d := range t.last {
		fps = append(fps, fingerprint(d))
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

// byteBudget bounds the bytes of the fetch responses an agent holds
// whose records are not all acknowledged, over all its partitions
// (source.max_in_flight_mib): its Fetchers' kafka.Budget, charged per
// response. Safe for concurrent use. Charging and giving are atomic adds;
// the lock is only for waiting.
type byteBudget struct {
	max     int64
	used    atomic.Int64
	waiting atomic.Int32 // Room found none since the last give
	mu      sync.Mutex
	room    chan struct{} // closed by the next give after Room found none
}

func newByteBudget(max int64) *byteBudget { return &byteBudget{max: max} }

// Give gives n bytes back (kafka.Budget).
func (b *byteBudget) Give(n int64) {
	if n == 0 {
		return
	}
	b.used.Add(-n)
	if b.waiting.Load() == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.waiting.Store(0)
	if b.room != nil {
		close(b.room)
		b.room = nil
	}
}

// Charge takes n bytes, beyond the bound if need be (kafka.Budget).
func (b *byteBudget) Charge(n int64) { b.used.Add(n) }

// Room returns nil when n bytes are free, or when nothing is taken (so
// that a budget below a fetch's size cannot stop it for ever); otherwise
// a channel closed by the next give (kafka.Budget).
func (b *byteBudget) Room(n int64) <-chan struct{} {
	if used := b.used.Load(); used+n <= b.max || used <= 0 {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.room == nil {
		b.room = make(chan struct{})
	}
	b.waiting.Store(1)
	// A give between the first look and the registration found nobody
	// waiting: look again, now that a give will close room.
	if used := b.used.Load(); used+n <= b.max || used <= 0 {
		return nil
	}
	return b.room
}

// Free returns the bytes free now (kafka.Budget).
func (b *byteBudget) Free() int64 { return b.max - b.used.Load() }

var _ kafka.Budget = (*byteBudget)(nil)

// inUse returns the bytes taken.
func (b *byteBudget) inUse() int64 {
	if b == nil {
		return 0
	}
	return b.used.Load()
}

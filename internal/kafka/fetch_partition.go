package kafka

import (
	"sync"
	"sync/atomic"
	"time"
)

// Chunk is the records of one partition from one response, in offset
// order. Its records' keys, values and headers are slices of the response:
// the bytes of the whole response count against the Fetcher's Budget until
// every chunk of it is released. Release drops Records, so that a chunk
// kept after it does not keep the response; the keys, values and headers
// taken from them stay valid (and keep the response's memory while they
// are held).
type Chunk struct {
	// Records holds at least one record.
	Records []Record
	// Next is the partition's fetch position after the chunk: the offset
	// after its last batch, past the last record when the batch ended
	// with records not passed on (transaction markers, aborted records).
	Next int64
	// HighWaterMark is the partition's high watermark in the response.
	HighWaterMark int64

	p    *FetchPartition
	resp *fetchResponse
	// size is what the chunk is charged against the Budget (RecordOverhead
	// a record); held what it counts against its partition's
	// heldFactor × PartitionMaxBytes (DefaultFetchRecordOverhead a record:
	// a byte count of the fetch's, as PartitionMaxBytes is, so that a
	// consumer's larger overhead does not shrink each partition's share).
	size, held int64
	released   atomic.Bool
}

// Release tells the Fetcher the consumer is done with the chunk, and
// drops Records: read them before. Calling it again does nothing. Safe
// from any goroutine.
func (c *Chunk) Release() {
	if c.released.Swap(true) {
		return
	}
	c.Records = nil
	limit := int64(heldFactor) * int64(c.p.f.cfg.PartitionMaxBytes)
	if after := c.p.held.Add(-c.held); after < limit && after+c.held >= limit {
		if b := c.p.broker.Load(); b != nil {
			kick(b.kick)
		}
	}
	c.resp.unref()
}

// FetchPartition is the fetching of one partition, from ConsumePartition
// until Close or until it ends on its own (Err). Its records come as
// Chunks, queued in offset order: Ready signals that Poll has chunks to
// take, or that the partition ended. Its methods are safe for concurrent
// use; none waits on the network.
type FetchPartition struct {
	f         *Fetcher
	topic     string
	partition int32
	ready     chan struct{}
	done      chan struct{}

	hwm     atomic.Int64
	held    atomic.Int64 // the size of the chunks queued or polled, not released
	paused  atomic.Bool
	stopped atomic.Bool                 // closed or ended
	broker  atomic.Pointer[fetchBroker] // the loop it is assigned to, nil while homeless

	// Fetch state, owned by the loop the partition is assigned to or by
	// the mover while it has none (handed over under Fetcher.mu and
	// fetchBroker.mu).
	offset    int64
	maxBytes  int32
	epoch     int32
	failures  int
	notBefore time.Time

	mu     sync.Mutex
	queue  []*Chunk
	err    error
	closed bool
}

// Topic returns the partition's topic.
func (p *FetchPartition) Topic() string { return p.topic }

// Partition returns the partition's number.
func (p *FetchPartition) Partition() int32 { return p.partition }

// Ready receives a value when chunks were queued or the partition ended
// since the last Poll (at most one value is pending).
func (p *FetchPartition) Ready() <-chan struct{} { return p.ready }

// Done is closed when the partition ends on its own or is closed.
func (p *FetchPartition) Done() <-chan struct{} { return p.done }

// Poll appends the queued chunks to dst, in offset order, and returns it.
// When none is queued and the partition ended on its own, it returns why
// (Err); every chunk queued before the end is returned first. The caller
// owns the chunks returned and must Release each, also after Close.
func (p *FetchPartition) Poll(dst []*Chunk) ([]*Chunk, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.queue) == 0 {
		return dst, p.err
	}
	dst = append(dst, p.queue...)
	clear(p.queue)
	p.queue = p.queue[:0]
	return dst, nil
}

// Err returns why the partition ended on its own: an error satisfying
// errors.Is(err, sarama.ErrOffsetOutOfRange) when its fetch position left
// the log (retention, deletion, or a start beyond the end); a batch too
// large to fetch; a broker below the protocol floor. Nil while it runs.
func (p *FetchPartition) Err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// HighWaterMark returns the partition's high watermark as of the latest
// response, -1 before the first.
func (p *FetchPartition) HighWaterMark() int64 { return p.hwm.Load() }

// Pause leaves the partition out of requests until Resume. Chunks already
// queued stay queued; a response in flight when Pause is called queues
// nothing (its records are fetched again after Resume), so no chunk is
// queued between Pause and Resume. Other partitions keep flowing.
func (p *FetchPartition) Pause() {
	p.mu.Lock()
	p.paused.Store(true)
	p.mu.Unlock()
}

// Resume undoes Pause: the partition fetches on from its position.
func (p *FetchPartition) Resume() {
	p.paused.Store(false)
	if b := p.broker.Load(); b != nil {
		kick(b.kick)
	}
}

// Close stops fetching the partition at once and releases the chunks
// queued; a response in flight for it is dropped when it arrives. Chunks
// taken by Poll are the caller's to Release. Safe to call more than once.
func (p *FetchPartition) Close() {
	p.mu.Lock()
	if p.closed || p.stopped.Load() {
		p.closed = true
		p.mu.Unlock()
		p.releaseQueued()
		return
	}
	p.closed = true
	p.stopped.Store(true)
	close(p.done)
	p.mu.Unlock()
	p.releaseQueued()
	if b := p.broker.Load(); b != nil {
		kick(b.kick) // drops it from its list, so a restart is not refused
	}
}

func (p *FetchPartition) releaseQueued() {
	p.mu.Lock()
	q := p.queue
	p.queue = nil
	p.mu.Unlock()
	for _, c := range q {
		c.Release()
	}
}

// enqueue queues c, unless the partition is paused or stopped.
func (p *FetchPartition) enqueue(c *Chunk) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped.Load() || p.paused.Load() {
		return false
	}
	p.held.Add(c.held)
	p.queue = append(p.queue, c)
	kick(p.ready)
	return true
}

// end ends the partition on its own with err.
func (p *FetchPartition) end(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped.Load() {
		return
	}
	p.err = err
	p.stopped.Store(true)
	close(p.done)
	kick(p.ready)
}

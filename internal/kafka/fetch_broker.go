package kafka

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"
)

// fetchBroker is the loop of one source broker: the only goroutine that
// sends requests on its Conn and the owner of its partitions' fetch
// state while they are assigned to it.
type fetchBroker struct {
	f    *Fetcher
	id   int32
	kick chan struct{}

	mu     sync.Mutex
	addr   string
	parts  []*FetchPartition
	cursor int // where the next request's partitions start
}

func (b *fetchBroker) run() {
	f := b.f
	defer f.loops.Done()
	log := f.log.With(zap.Int32("broker", b.id))
	var conn *Conn
	defer func() {
		if conn != nil {
			conn.Close()
		}
	}()
	var version int16
	failures := 0
	for f.ctx.Err() == nil {
		parts, wake := b.pick()
		if len(parts) == 0 {
			b.sleep(wake, nil)
			continue
		}
		if f.cfg.Budget != nil {
			if room := f.cfg.Budget.Room(int64(f.cfg.PartitionMaxBytes)); room != nil {
				b.sleep(time.Time{}, room)
				continue
			}
		}
		if conn == nil {
			var ended bool
			var err error
			if conn, version, ended, err = b.open(log); ended {
				continue
			}
			if err != nil {
				if f.ctx.Err() != nil {
					return // closed while dialling
				}
				failures++
				b.failed(log, err, failures)
				continue
			}
		}
		req := b.request(version, parts, f.maxBytes())
		before := conn.BytesRead()
		resp, err := conn.Broker().Fetch(req)
		if err != nil {
			conn.Close()
			conn = nil
			if f.ctx.Err() != nil {
				return
			}
			failures++
			b.failed(log, err, failures)
			continue
		}
		f.requests.Add(1)
		if resp.ErrorCode != 0 {
			// A request-level error (v7+: fetch sessions, which we
			// do not open; or the broker shutting down) answers no
			// partition: back off as after a failed request.
			failures++
			b.failed(log, fmt.Errorf("broker %d: %w", b.id, sarama.KError(resp.ErrorCode)), failures)
			continue
		}
		failures = 0
		b.handle(log, parts, resp, conn.BytesRead()-before)
		if t := resp.ThrottleTime; t > 0 {
			// sarama delays the next request on this connection by
			// this much, holding the broker's lock; wait here, where
			// Close interrupts the wait, so that sarama finds the time
			// over.
			f.throttled.Add(int64(t))
			b.wait(t)
		}
	}
}

// open dials b's broker and agrees on a Fetch version. ended: the broker
// speaks none this fetcher can use, and b's partitions were ended with
// that error.
func (b *fetchBroker) open(log *zap.Logger) (conn *Conn, version int16, ended bool, err error) {
	f := b.f
	b.mu.Lock()
	addr := b.addr
	b.mu.Unlock()
	if conn, err = DialConn(f.ctx, f.conf, addr); err != nil {
		return nil, 0, false, err
	}
	if version, err = conn.Negotiate(APIKeyFetch, f.ceiling, 4); err != nil {
		conn.Close()
		log.Error("cannot fetch from broker", zap.Error(err))
		b.endAll(err)
		return nil, 0, true, err
	}
	log.Info("fetch connection opened", zap.String("addr", addr), zap.Int16("fetch_version", version), zap.Int16("ceiling", f.ceiling))
	return conn, version, false, nil
}

// sleep waits for a kick, the end of the Fetcher, until (if not zero) or
// ch (if not nil).
func (b *fetchBroker) sleep(until time.Time, ch <-chan struct{}) {
	var tc <-chan time.Time
	if !until.IsZero() {
		t := time.NewTimer(time.Until(until))
		defer t.Stop()
		tc = t.C
	}
	select {
	case <-b.f.ctx.Done():
	case <-b.kick:
	case <-tc:
	case <-ch:
	}
}

// failed handles a request that failed as a whole: every partition of the
// broker goes back to the mover (the leader may have moved to a broker we
// can reach), and the loop waits out its backoff before it connects again.
func (b *fetchBroker) failed(log *zap.Logger, err error, failures int) {
	b.f.errs.Add(1)
	d := backoff(failures)
	log.Warn("fetch failed; its partitions look for their leader again", zap.Error(err), zap.Int("failures", failures), zap.Duration("backoff", d))
	b.mu.Lock()
	parts := b.parts
	b.parts, b.cursor = nil, 0
	b.mu.Unlock()
	for _, p := range parts {
		p.broker.Store(nil)
		b.f.homeward(p, true)
	}
	b.wait(d)
}

// wait waits for d or the end of the Fetcher, whatever the kicks.
func (b *fetchBroker) wait(d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-b.f.ctx.Done():
	case <-t.C:
	}
}

// endAll ends every partition of the broker with err.
func (b *fetchBroker) endAll(err error) {
	b.mu.Lock()
	parts := b.parts
	b.parts, b.cursor = nil, 0
	b.mu.Unlock()
	for _, p := range parts {
		p.end(fmt.Errorf("kafka: cluster %s: fetch %s/%d: %w", b.f.name, p.topic, p.partition, err))
	}
}

// pick returns the partitions of the next request: up to MaxPartitions of
// the ready ones (not paused, not holding too many unreleased chunks, not
// backing off after an error), starting after the last one picked. With
// none ready it returns when the earliest backoff ends (zero: none).
func (b *fetchBroker) pick() (parts []*FetchPartition, wake time.Time) {
	f := b.f
	now := time.Now()
	b.mu.Lock()
	defer b.mu.Unlock()
	kept := b.parts[:0]
	for i, p := range b.parts {
		if p.stopped.Load() {
			if i < b.cursor {
				b.cursor--
			}
			p.broker.Store(nil)
			continue
		}
		kept = append(kept, p)
	}
	clear(b.parts[len(kept):])
	b.parts = kept
	n := len(b.parts)
	if b.cursor >= n {
		b.cursor = 0
	}
	limit := int64(heldFactor) * int64(f.cfg.PartitionMaxBytes)
	last := -1
	for i := range n {
		j := (b.cursor + i) % n
		p := b.parts[j]
		switch {
		case p.paused.Load() || p.held.Load() >= limit:
		case now.Before(p.notBefore):
			if wake.IsZero() || p.notBefore.Before(wake) {
				wake = p.notBefore
			}
		default:
			parts = append(parts, p)
			last = j
		}
		if len(parts) == f.cfg.MaxPartitions {
			break
		}
	}
	if last >= 0 {
		b.cursor = (last + 1) % n
	}
	return parts, wake
}

// maxBytes is the MaxBytes of the next request: MaxBytes, cut to what
// the budget has free (Room found PartitionMaxBytes free before the
// request) divided by the last response's inflation, so that the
// response's charge fits: MaxBytes bounds the bytes on the wire, and a
// compressed response can weigh many times more once decoded (zeros: 15
// times). Asking for MaxBytes whatever the budget held let one response
// overshoot the budget by up to MaxBytes (default 16 MiB; the agent's is
// a quarter of its budget), times its inflation. At least 1 byte: a
// broker returns the first batch whole whatever the bound (KIP-74).
func (f *Fetcher) maxBytes() int32 {
	if f.cfg.Budget == nil {
		return f.cfg.MaxBytes
	}
	free := float64(f.cfg.Budget.Free())
	if bits := f.inflation.Load(); bits != 0 {
		free /= math.Float64frombits(bits)
	}
	return int32(max(min(free, float64(f.cfg.MaxBytes)), 1))
}

// request builds the Fetch of parts. The request holds each partition
// once: ConsumePartition refuses a second FetchPartition of a partition
// until the first is stopped, and pick drops stopped ones.
func (b *fetchBroker) request(version int16, parts []*FetchPartition, maxBytes int32) *sarama.FetchRequest {
	cfg := b.f.cfg
	req := &sarama.FetchRequest{
		Version:      version,
		MaxWaitTime:  int32(cfg.MaxWait / time.Millisecond),
		MinBytes:     1,
		MaxBytes:     maxBytes,
		Isolation:    sarama.ReadCommitted,
		SessionID:    0,
		SessionEpoch: -1, // no fetch session
	}
	for _, p := range parts {
		req.AddBlock(p.topic, p.partition, p.offset, p.maxBytes, p.epoch)
	}
	return req
}

// handle applies a response of size bytes to the partitions it answers.
func (b *fetchBroker) handle(log *zap.Logger, parts []*FetchPartition, resp *sarama.FetchResponse, size int64) {
	f := b.f
	ref := &fetchResponse{budget: f.cfg.Budget, size: size}
	ref.refs.Store(1)
	if ref.budget != nil {
		ref.budget.Charge(size)
	}
	// The records of a compressed batch slice its decompressed buffer,
	// not the response: the response is charged the larger of its size
	// and its records' (the chunks hold the last reference until the
	// loop is done with the response, so the size may still change).
	var decoded int64
	defer func() {
		if extra := decoded - ref.size; extra > 0 && ref.budget != nil {
			ref.budget.Charge(extra)
			ref.size = decoded
		}
		if decoded > 0 && size > 0 {
			f.inflation.Store(math.Float64bits(max(1, float64(decoded)/float64(size))))
		}
		ref.unref()
	}()
	for _, p := range parts {
		block := resp.GetBlock(p.topic, p.partition)
		if block == nil {
			continue // not answered: in the next request again
		}
		switch err := block.Err; {
		case errors.Is(err, sarama.ErrNoError):
			p.failures = 0
			decoded += b.accept(p, block, ref)
		case errors.Is(err, sarama.ErrOffsetOutOfRange):
			b.remove(p)
			p.end(fmt.Errorf("kafka: cluster %s: fetch %s/%d at %d (log %d-%d): %w", f.name, p.topic, p.partition, p.offset, block.LogStartOffset, block.HighWaterMarkOffset, err))
		case leaderMoved(err):
			log.Debug("partition moves", zap.String("topic", p.topic), zap.Int32("partition", p.partition), zap.Error(err))
			b.remove(p)
			b.f.homeward(p, true)
		default:
			f.errs.Add(1)
			p.failures++
			p.notBefore = time.Now().Add(backoff(p.failures))
			log.Warn("partition fetch error; retrying", zap.String("topic", p.topic), zap.Int32("partition", p.partition),
				zap.Int64("offset", p.offset), zap.Error(err), zap.Int("failures", p.failures))
		}
	}
}

// leaderMoved reports whether a partition error says to look for the
// partition's leader again.
func leaderMoved(err error) bool {
	return errors.Is(err, sarama.ErrNotLeaderForPartition) ||
		errors.Is(err, sarama.ErrFencedLeaderEpoch) ||
		errors.Is(err, sarama.ErrUnknownLeaderEpoch) ||
		errors.Is(err, sarama.ErrLeaderNotAvailable) ||
		errors.Is(err, sarama.ErrReplicaNotAvailable) ||
		errors.Is(err, sarama.ErrUnknownTopicOrPartition) ||
		errors.Is(err, sarama.ErrKafkaStorageError) ||
		errors.Is(err, sarama.ErrOffsetNotAvailable)
}

// remove takes p out of the broker's partitions.
func (b *fetchBroker) remove(p *FetchPartition) {
	b.mu.Lock()
	for i, q := range b.parts {
		if q == p {
			b.parts = append(b.parts[:i], b.parts[i+1:]...)
			if i < b.cursor {
				b.cursor--
			}
			break
		}
	}
	b.mu.Unlock()
	p.broker.Store(nil)
}

// accept decodes p's block and queues its records; it returns their size.
func (b *fetchBroker) accept(p *FetchPartition, block *sarama.FetchResponseBlock, ref *fetchResponse) int64 {
	p.hwm.Store(block.HighWaterMarkOffset)
	recs, next := DecodeBlockInto(block, p.offset, math.MaxInt64, nil)
	if next == p.offset {
		if partialBlock(block) {
			if p.maxBytes >= fetchMaxBytesCap {
				b.remove(p)
				p.end(fmt.Errorf("kafka: cluster %s: fetch %s/%d at %d: record batch larger than %d bytes", b.f.name, p.topic, p.partition, p.offset, p.maxBytes))
				return 0
			}
			p.maxBytes = min(2*p.maxBytes, fetchMaxBytesCap)
		}
		return 0
	}
	p.maxBytes = b.f.cfg.PartitionMaxBytes
	if len(recs) == 0 {
		p.offset = next // control records, aborted ones, compaction gaps
		return 0
	}
	held := recordsSize(recs)
	c := &Chunk{Records: recs, Next: next, HighWaterMark: block.HighWaterMarkOffset, p: p, resp: ref,
		size: held + int64(len(recs))*int64(b.f.cfg.RecordOverhead-DefaultFetchRecordOverhead), held: held}
	ref.refs.Add(1)
	if !p.enqueue(c) {
		// Paused or stopped meanwhile: dropped, fetched again from
		// the same offset after a resume.
		ref.unref()
		return 0
	}
	p.offset = next
	return c.size
}

// recordsSize is what recs weigh to the Fetcher: their keys, values and
// headers, and DefaultFetchRecordOverhead each.
func recordsSize(recs []Record) int64 {
	const overhead = DefaultFetchRecordOverhead
	n := int64(0)
	for i := range recs {
		r := &recs[i]
		n += overhead + int64(len(r.Key)+len(r.Value))
		for _, h := range r.Headers {
			if h != nil {
				n += int64(len(h.Key) + len(h.Value))
			}
		}
	}
	return n
}

// fetchResponse counts the chunks of one response not yet released; the
// last release gives the response's bytes back to the budget.
type fetchResponse struct {
	budget Budget
	size   int64
	refs   atomic.Int32
}

func (r *fetchResponse) unref() {
	if r.refs.Add(-1) == 0 && r.budget != nil {
		r.budget.Give(r.size)
	}
}

package mirror

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/translate"
)

// run is the mirror's loop, its only goroutine.
func (m *Mirror) run(ctx context.Context) {
	defer close(m.done)
	defer func() {
		m.closeClients()
		m.log.Info("mirror: stopped", zap.Int64("copied", m.copied.Load()))
	}()
	backoff := m.cfg.RetryBackoff
	for {
		for m.held.Load() {
			select {
			case <-ctx.Done():
				return
			case <-m.released:
			}
		}
		m.roundMu.Lock()
		if m.held.Load() { // held since the check: Hold may have returned
			m.roundMu.Unlock()
			continue
		}
		err := m.round(ctx)
		m.roundMu.Unlock()
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			if m.stalled {
				m.stalled = false
				m.log.Info("mirror: copying resumed", zap.Duration("stalled_for", time.Since(m.stalledSince)))
			}
			backoff = m.cfg.RetryBackoff
			continue
		}
		if !m.stalled {
			m.stalled, m.stalledSince = true, time.Now()
			m.log.Info("mirror: copying stalled, retrying", zap.Error(err))
		} else if msg := err.Error(); msg != m.lastErr {
			m.log.Debug("mirror: still stalled", zap.Error(err), zap.Duration("backoff", backoff))
		}
		m.lastErr = err.Error()
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		backoff = min(2*backoff, m.cfg.RetryBackoffMax)
	}
}

// round writes what was fetched, then fetches more. It fetches only after
// everything fetched before is on the target, so memory stays bounded by one
// fetch.
func (m *Mirror) round(ctx context.Context) error {
	if err := m.write(ctx); err != nil {
		return err
	}
	if err := m.grow(); err != nil {
		return err
	}
	return m.fetch(ctx)
}

// write copies every partition's pending records to the target, batch by
// batch, each followed by its offset-syncs.
func (m *Mirror) write(ctx context.Context) error {
	if err := m.flushSyncs(); err != nil {
		return err
	}
	for _, p := range m.parts {
		for len(p.pending) > 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
			if p.check {
				if err := m.resolve(p); err != nil {
					return fmt.Errorf("mirror: look at %s/%d on %s after a failed write: %w", p.remote, p.id, m.cfg.TargetName, err)
				}
			} else {
				n := chunk(p.pending)
				base, err := produce(m.dst, m.cfg.Version, p.remote, p.id, p.pending[:n])
				if err != nil {
					p.check = true
					if isLeaderError(err) {
						_ = m.dst.RefreshMetadata(p.remote) // best effort; the next try tells
					}
					return fmt.Errorf("mirror: write %d records of %s/%d to %s/%d on %s: %w", n, p.topic, p.id, p.remote, p.id, m.cfg.TargetName, err)
				}
				m.confirm(p, n, base)
			}
			if err := m.flushSyncs(); err != nil {
				return err
			}
		}
	}
	return nil
}

// confirm records that the first n pending records of p are on the target
// from offset base on, and queues their offset-syncs.
func (m *Mirror) confirm(p *partition, n int, base int64) {
	if base != p.next {
		m.log.Warn("mirror: target partition did not end where the mirror left it; another writer?",
			zap.String("topic", p.remote), zap.Int32("partition", p.id),
			zap.Int64("expected_offset", p.next), zap.Int64("target_offset", base))
	}
	recs := p.pending[:n]
	p.pending = p.pending[n:]
	if len(p.pending) == 0 {
		p.pending = nil
	}
	p.next = base + int64(n)
	pos := recs[n-1].offset + 1
	if p.pending == nil {
		pos = p.fetchAt // past trailing markers too
	}
	m.copied.Add(int64(n))
	if ce := m.log.Check(zap.DebugLevel, "mirror: copied"); ce != nil {
		ce.Write(zap.String("topic", p.topic), zap.Int32("partition", p.id), zap.Int("records", n),
			zap.Int64("source_offset", recs[0].offset), zap.Int64("target_offset", base))
	}
	if m.cfg.OffsetSyncsTopic == "" {
		m.publish(p, pos)
		return
	}
	now := time.Now().UnixMilli()
	for i, r := range recs {
		k, v := translate.EncodeOffsetSync(p.topic, p.id, r.offset, base+int64(i))
		e := syncEntry{rec: record{key: k, value: v, ts: now}, p: p, pos: r.offset + 1}
		if i == n-1 {
			e.pos = pos
		}
		m.pendingSyncs = append(m.pendingSyncs, e)
	}
}

// flushSyncs writes the queued offset-syncs and publishes the positions
// they complete.
func (m *Mirror) flushSyncs() error {
	for len(m.pendingSyncs) > 0 {
		n := min(len(m.pendingSyncs), maxBatchRecords)
		recs := make([]record, n)
		for i, e := range m.pendingSyncs[:n] {
			recs[i] = e.rec
		}
		if _, err := produce(m.syncs, m.cfg.Version, m.cfg.OffsetSyncsTopic, 0, recs); err != nil {
			// A retry may write some syncs twice; readers keep the latest.
			if isLeaderError(err) {
				_ = m.syncs.RefreshMetadata(m.cfg.OffsetSyncsTopic)
			}
			return fmt.Errorf("mirror: write %d offset-syncs to %s on %s: %w", n, m.cfg.OffsetSyncsTopic, m.syncsName(), err)
		}
		for _, e := range m.pendingSyncs[:n] {
			e.p.pos.Store(e.pos)
		}
		m.pendingSyncs = m.pendingSyncs[n:]
		m.notify()
	}
	m.pendingSyncs = nil
	return nil
}

func (m *Mirror) publish(p *partition, pos int64) {
	p.pos.Store(pos)
	m.notify()
}

func (m *Mirror) notify() {
	m.progressMu.Lock()
	defer m.progressMu.Unlock()
	close(m.progress)
	m.progress = make(chan struct{})
}

// resolve finds out what became of p's last write, whose outcome is
// unknown, from the target partition's end: the records that landed count
// as copied, and the rest of the pending records will be written.
func (m *Mirror) resolve(p *partition) error {
	hwm, err := m.dst.GetOffset(p.remote, p.id, sarama.OffsetNewest)
	if err != nil {
		return err
	}
	fields := []zap.Field{zap.String("topic", p.remote), zap.Int32("partition", p.id),
		zap.Int64("expected_offset", p.next), zap.Int64("target_end", hwm)}
	switch landed := hwm - p.next; {
	case landed == 0:
		m.log.Debug("mirror: failed write did not land; writing it again", fields...)
	case landed < 0:
		m.log.Warn("mirror: target partition is shorter than the mirror left it (restarted without its data?); "+
			"what it lost is not copied again", fields...)
		p.next = hwm
	default:
		want := int(min(landed, int64(len(p.pending))))
		got, err := readRecords(m.dst, m.cfg.Version, p.remote, p.id, p.next, want)
		if err != nil {
			return err
		}
		k := 0
		for k < want && sameRecord(got[k], p.pending[k]) {
			k++
		}
		if k > 0 {
			m.log.Info("mirror: a failed write had landed; not writing it again", append(fields, zap.Int("records", k))...)
			m.confirm(p, k, p.next)
		}
		if int64(k) < landed {
			m.log.Warn("mirror: target partition holds records the mirror did not write; continuing after them "+
				"(the mirror's next records may end up there twice)", append(fields, zap.Int64("foreign", landed-int64(k)))...)
		}
		p.next = hwm
	}
	p.check = false
	return nil
}

// fetch reads from every source partition (all pending records are written
// when it is called) with one long-poll Fetch per leader.
func (m *Mirror) fetch(ctx context.Context) error {
	type leaderFetch struct {
		b     *sarama.Broker
		parts []*partition
	}
	var (
		order    []*leaderFetch
		byBroker = make(map[*sarama.Broker]*leaderFetch)
		errs     []error
		refresh  bool
	)
	for _, p := range m.parts {
		if len(p.pending) > 0 {
			continue
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		b, err := m.src.Leader(p.topic, p.id)
		if err != nil {
			// Each lookup of an unknown leader refreshes the metadata
			// (with sarama's retries): with the source down, asking for
			// every partition made one round last minutes at 1200
			// partitions, and Stop wait for it. One refresh, then the
			// next round.
			errs = append(errs, fmt.Errorf("leader of %s/%d: %w", p.topic, p.id, err))
			refresh = true
			break
		}
		lf := byBroker[b]
		if lf == nil {
			lf = &leaderFetch{b: b}
			byBroker[b] = lf
			order = append(order, lf)
		}
		lf.parts = append(lf.parts, p)
	}
	for _, lf := range order {
		if err := ctx.Err(); err != nil {
			return err
		}
		req := newFetchRequest(m.cfg.Version, m.cfg.FetchMaxWait)
		for _, p := range lf.parts {
			req.AddBlock(p.topic, p.id, p.fetchAt, p.fetchSize, -1)
		}
		resp, err := lf.b.Fetch(req)
		if err != nil {
			kafka.CloseOnTransportError(lf.b, err)
			errs = append(errs, fmt.Errorf("broker %s: %w", lf.b.Addr(), err))
			refresh = true
			continue
		}
		for _, p := range lf.parts {
			if err := m.take(p, resp.GetBlock(p.topic, p.id)); err != nil {
				errs = append(errs, fmt.Errorf("%s/%d at offset %d: %w", p.topic, p.id, p.fetchAt, err))
				refresh = refresh || isLeaderError(err)
			}
		}
	}
	if refresh {
		_ = m.src.RefreshMetadata(m.topics...) // best effort; the next try tells
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("mirror: fetch from %s: %w", m.cfg.SourceName, err)
	}
	return nil
}

// take makes the records of a fetched block p's pending records.
func (m *Mirror) take(p *partition, block *sarama.FetchResponseBlock) error {
	if block == nil {
		return sarama.ErrIncompleteResponse
	}
	switch block.Err {
	case sarama.ErrNoError:
	case sarama.ErrOffsetOutOfRange:
		return m.outOfRange(p)
	default:
		return block.Err
	}
	recs, next, partial, err := parseBlock(block, p.fetchAt)
	if err != nil {
		return err
	}
	if partial {
		if p.fetchSize >= fetchPartitionBytesMax {
			return fmt.Errorf("batch larger than %d bytes", p.fetchSize)
		}
		p.fetchSize *= 2 // and fetch again
		return nil
	}
	p.fetchSize = fetchPartitionBytes
	if next == p.fetchAt {
		return nil
	}
	p.fetchAt = next
	if len(recs) == 0 {
		m.publish(p, next) // only markers or compacted-away offsets
		return nil
	}
	p.pending = recs
	return nil
}

// outOfRange moves p's fetch position to the source partition's start
// after the source answered OFFSET_OUT_OF_RANGE, as MirrorMaker 2 does
// with auto.offset.reset=earliest, and says what that means.
func (m *Mirror) outOfRange(p *partition) error {
	oldest, err := m.src.GetOffset(p.topic, p.id, sarama.OffsetOldest)
	if err != nil {
		return err
	}
	newest, err := m.src.GetOffset(p.topic, p.id, sarama.OffsetNewest)
	if err != nil {
		return err
	}
	fields := []zap.Field{zap.String("topic", p.topic), zap.Int32("partition", p.id),
		zap.Int64("position", p.fetchAt), zap.Int64("source_start", oldest), zap.Int64("source_end", newest)}
	switch {
	case p.fetchAt < oldest:
		m.log.Warn("mirror: source records were deleted before they were copied; skipping them", fields...)
	case p.fetchAt > newest:
		m.log.Warn("mirror: source partition ends before the mirror's position (restarted without its data?); "+
			"copying from its start", fields...)
	default:
		return nil // in range again: fetch again
	}
	p.fetchAt = oldest
	m.publish(p, oldest)
	return nil
}

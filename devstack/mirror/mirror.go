package mirror

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"
)

// ErrStopped is returned by the methods of a Mirror that has stopped (Stop
// was called or the context given to Start ended).
var ErrStopped = errors.New("mirror: stopped")

// Mirror copies topics from one cluster to another until stopped. Its
// methods are safe for concurrent use.
type Mirror struct {
	cfg    Config
	log    *zap.Logger
	dialer *dialer
	topics []string // source topics, for metadata refreshes
	// parts grows (PartitionRefresh) on the loop goroutine, under
	// partsMu; the loop reads it without the lock, others through
	// partitions.
	parts   []*partition
	partsMu sync.Mutex

	// src and dst are the two clusters' clients; syncs is the one that
	// holds the offset-syncs topic. The loop uses them; Lag and CaughtUp
	// use src under clientsMu, which the loop's exit takes to close them.
	src, dst, syncs sarama.Client
	clientsMu       sync.RWMutex
	clientsClosed   bool

	cancel    context.CancelFunc
	stopAfter func() bool // stops the closing of connections when Start's ctx ends
	stopOnce  sync.Once
	done      chan struct{} // closed when the loop has returned and the clients are closed

	copied atomic.Int64

	// held is set between Hold and Release; roundMu is held by the loop
	// for each round, so Hold can wait for the one under way; released
	// wakes a held loop.
	held     atomic.Bool
	roundMu  sync.Mutex
	released chan struct{}

	// progress is closed, and replaced, whenever a partition's published
	// position moves (see partition.pos).
	progressMu sync.Mutex
	progress   chan struct{}

	// Owned by the loop goroutine.
	pendingSyncs []syncEntry
	stalled      bool
	stalledSince time.Time
	lastErr      string
	grownAt      time.Time // the last look for partitions added (PartitionRefresh)
}

// partition is one source partition and its copy.
type partition struct {
	topic  string // on the source
	remote string // on the target
	id     int32

	// Owned by the loop goroutine.
	fetchAt   int64    // next source offset to fetch
	fetchSize int32    // per-partition fetch size
	pending   []record // fetched, not yet confirmed on the target, in source order
	next      int64    // the target offset the next copied record should get
	check     bool     // the last write's outcome is unknown: look at the target before writing again

	// pos is the published position: every source record before it is on
	// the target, and its offset-sync (if any) is written.
	pos atomic.Int64
}

// syncEntry is an offset-sync record not yet written, and the position its
// partition reaches once it is.
type syncEntry struct {
	rec record
	p   *partition
	pos int64
}

// Start connects to both clusters, creates the target topics that are
// missing (with the source topic's partition count) and the offset-syncs
// topic, writes the TargetPrefill filler records, and starts copying from
// the source's oldest offsets. The mirror runs until Stop is called or ctx
// ends. Both clusters must be reachable during Start; afterwards, either
// may come and go.
func Start(ctx context.Context, cfg Config) (*Mirror, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	m := &Mirror{
		cfg:      cfg,
		log:      cfg.Logger.With(zap.String("source", cfg.SourceName), zap.String("target", cfg.TargetName)),
		dialer:   newDialer(),
		topics:   cfg.Topics,
		done:     make(chan struct{}),
		progress: make(chan struct{}),
		released: make(chan struct{}, 1),
	}
	runCtx, cancel := context.WithCancel(ctx)
	m.cancel = cancel
	m.stopAfter = context.AfterFunc(runCtx, m.dialer.closeAll)
	if err := m.setup(); err != nil {
		m.stopAfter()
		cancel()
		m.closeClients()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	m.log.Info("mirror: started",
		zap.Strings("topics", cfg.Topics), zap.Int("partitions", len(m.parts)),
		zap.Int("target_prefill", cfg.TargetPrefill), zap.String("offset_syncs_topic", cfg.OffsetSyncsTopic))
	go m.run(runCtx)
	return m, nil
}

func (m *Mirror) setup() error {
	c := m.cfg
	var err error
	if m.src, err = sarama.NewClient(c.Source, c.saramaConfig(m.dialer)); err != nil {
		return fmt.Errorf("mirror: connect to source %s %v: %w", c.SourceName, c.Source, err)
	}
	if m.dst, err = sarama.NewClient(c.Target, c.saramaConfig(m.dialer)); err != nil {
		return fmt.Errorf("mirror: connect to target %s %v: %w", c.TargetName, c.Target, err)
	}
	m.syncs = m.src
	if c.OffsetSyncsOnTarget {
		m.syncs = m.dst
	}
	for _, t := range c.Topics {
		ids, err := m.src.Partitions(t)
		if err != nil {
			return fmt.Errorf("mirror: source topic %s on %s: %w", t, c.SourceName, err)
		}
		ids = slices.Sorted(slices.Values(ids)) // a copy: ids is sarama's cache
		r := c.RemoteTopic(t)
		n, err := ensureTopic(m.dst, c.Version, r, int32(len(ids)), nil)
		if err != nil {
			return fmt.Errorf("mirror: target topic %s on %s: %w", r, c.TargetName, err)
		}
		if n < int32(len(ids)) {
			return fmt.Errorf("mirror: target topic %s on %s has %d partitions, fewer than the %d of %s on %s", r, c.TargetName, n, len(ids), t, c.SourceName)
		}
		for _, id := range ids {
			m.parts = append(m.parts, &partition{topic: t, remote: r, id: id, fetchSize: fetchPartitionBytes})
		}
	}
	if c.OffsetSyncsTopic != "" {
		compact := "compact" // as MirrorMaker 2 creates it
		if _, err := ensureTopic(m.syncs, c.Version, c.OffsetSyncsTopic, 1, map[string]*string{"cleanup.policy": &compact}); err != nil {
			return fmt.Errorf("mirror: offset-syncs topic %s on %s: %w", c.OffsetSyncsTopic, m.syncsName(), err)
		}
	}
	for _, p := range m.parts {
		if err := m.begin(p); err != nil {
			return err
		}
	}
	m.grownAt = time.Now()
	return nil
}

// begin prefills p's target partition and sets p to copy from the source
// partition's start.
func (m *Mirror) begin(p *partition) error {
	if err := m.prefill(p); err != nil {
		return err
	}
	var err error
	if p.next, err = m.dst.GetOffset(p.remote, p.id, sarama.OffsetNewest); err != nil {
		return fmt.Errorf("mirror: end of %s/%d on %s: %w", p.remote, p.id, m.cfg.TargetName, err)
	}
	if p.fetchAt, err = m.src.GetOffset(p.topic, p.id, sarama.OffsetOldest); err != nil {
		return fmt.Errorf("mirror: start of %s/%d on %s: %w", p.topic, p.id, m.cfg.SourceName, err)
	}
	p.pos.Store(p.fetchAt)
	return nil
}

// grow looks, every PartitionRefresh, for partitions added to the source
// topics: the remote topic grows to the source topic's count, and each
// new partition is prefilled and then copied from its start. A failure
// fails the round; the next round looks again (a partition prefilled
// and not yet added is prefilled again: fillers only).
func (m *Mirror) grow() error {
	if m.cfg.PartitionRefresh <= 0 || time.Since(m.grownAt) < m.cfg.PartitionRefresh {
		return nil
	}
	if err := m.src.RefreshMetadata(m.topics...); err != nil {
		return fmt.Errorf("mirror: metadata of %v on %s: %w", m.topics, m.cfg.SourceName, err)
	}
	known := map[string]map[int32]bool{}
	for _, p := range m.parts {
		if known[p.topic] == nil {
			known[p.topic] = map[int32]bool{}
		}
		known[p.topic][p.id] = true
	}
	var added []*partition
	for _, t := range m.topics {
		ids, err := m.src.Partitions(t)
		if err != nil {
			return fmt.Errorf("mirror: source topic %s on %s: %w", t, m.cfg.SourceName, err)
		}
		ids = slices.Sorted(slices.Values(ids))
		var fresh []int32
		for _, id := range ids {
			if !known[t][id] {
				fresh = append(fresh, id)
			}
		}
		if len(fresh) == 0 {
			continue
		}
		r := m.cfg.RemoteTopic(t)
		if err := growTopic(m.dst, m.cfg.Version, r, int32(len(ids))); err != nil {
			return fmt.Errorf("mirror: grow %s on %s to the %d partitions of %s on %s: %w", r, m.cfg.TargetName, len(ids), t, m.cfg.SourceName, err)
		}
		for _, id := range fresh {
			p := &partition{topic: t, remote: r, id: id, fetchSize: fetchPartitionBytes}
			if err := m.begin(p); err != nil {
				return err
			}
			added = append(added, p)
		}
		m.log.Info("mirror: partitions added to the source topic; copying them",
			zap.String("topic", t), zap.Int32s("partitions", fresh), zap.String("remote", r), zap.Int("total", len(ids)))
	}
	m.grownAt = time.Now()
	if len(added) > 0 {
		m.partsMu.Lock()
		m.parts = append(m.parts, added...)
		m.partsMu.Unlock()
	}
	return nil
}

// partitions returns the partitions copied so far, for use off the loop.
func (m *Mirror) partitions() []*partition {
	m.partsMu.Lock()
	defer m.partsMu.Unlock()
	return m.parts
}

// prefill writes cfg.TargetPrefill filler records to p's target partition.
func (m *Mirror) prefill(p *partition) error {
	if m.cfg.TargetPrefill == 0 {
		return nil
	}
	now := time.Now().UnixMilli()
	hdr := []*sarama.RecordHeader{{Key: []byte(FillerHeader), Value: []byte(m.cfg.TargetName)}}
	recs := make([]record, m.cfg.TargetPrefill)
	for i := range recs {
		recs[i] = record{value: fmt.Appendf(nil, "kswitch filler %d", i), ts: now, headers: hdr}
	}
	for len(recs) > 0 {
		n := chunk(recs)
		if _, err := produce(m.dst, m.cfg.Version, p.remote, p.id, recs[:n]); err != nil {
			return fmt.Errorf("mirror: prefill %s/%d on %s: %w", p.remote, p.id, m.cfg.TargetName, err)
		}
		recs = recs[n:]
	}
	return nil
}

// Stop stops copying, waits for the mirror's goroutine to return and closes
// its clients. Records fetched but not yet written are dropped (a new
// Mirror starts over from the source's oldest offsets). It returns promptly
// even while a cluster hangs: the mirror's connections are cut. Stop is
// idempotent.
func (m *Mirror) Stop() {
	m.stopOnce.Do(func() {
		m.stopAfter()
		m.cancel()
		m.dialer.closeAll()
	})
	<-m.done
}

// Hold stops copying until Release, as a replicator that falls behind
// does: records the source takes meanwhile are not on the target. It
// returns once the round under way (at most one fetch's wait, or a
// request's timeout while a cluster hangs) has ended; records fetched and
// not yet written stay unwritten until Release.
func (m *Mirror) Hold() {
	m.held.Store(true)
	m.roundMu.Lock()
	defer m.roundMu.Unlock()
}

// Release lets a held mirror copy again, from where it stopped.
func (m *Mirror) Release() {
	m.held.Store(false)
	select {
	case m.released <- struct{}{}:
	default:
	}
}

// Done is closed when the mirror has stopped, by Stop or because the
// context given to Start ended.
func (m *Mirror) Done() <-chan struct{} { return m.done }

// Copied returns how many records have been written to the target so far
// (filler records not counted).
func (m *Mirror) Copied() int64 { return m.copied.Load() }

// CaughtUp reads every source partition's high watermark now and blocks
// until everything before it has been copied (with its offset-sync, when
// configured). While the source is unreachable it keeps trying to read the
// high watermarks. It returns ctx.Err() if ctx ends first and ErrStopped if
// the mirror stops.
func (m *Mirror) CaughtUp(ctx context.Context) error {
	backoff := m.cfg.RetryBackoff
	parts := m.partitions()
	var hwms []int64
	for {
		var err error
		if hwms, err = m.highWatermarks(parts); err == nil {
			break
		}
		if errors.Is(err, ErrStopped) {
			return err
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-m.done:
			t.Stop()
			return ErrStopped
		case <-t.C:
		}
		backoff = min(2*backoff, m.cfg.RetryBackoffMax)
	}
	for {
		m.progressMu.Lock()
		progress := m.progress
		m.progressMu.Unlock()
		reached := true
		for i, p := range parts {
			if p.pos.Load() < hwms[i] {
				reached = false
				break
			}
		}
		if reached {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-m.done:
			return ErrStopped
		case <-progress:
		}
	}
}

// Lag reads every source partition's high watermark now and returns how
// many offsets, summed over partitions, lie between it and what has been
// copied (with its offset-sync, when configured). It fails when the source
// is unreachable.
func (m *Mirror) Lag() (int64, error) {
	parts := m.partitions()
	hwms, err := m.highWatermarks(parts)
	if err != nil {
		return 0, err
	}
	var lag int64
	for i, p := range parts {
		lag += max(0, hwms[i]-p.pos.Load())
	}
	return lag, nil
}

func (m *Mirror) highWatermarks(parts []*partition) ([]int64, error) {
	m.clientsMu.RLock()
	defer m.clientsMu.RUnlock()
	if m.clientsClosed {
		return nil, ErrStopped
	}
	hwms := make([]int64, len(parts))
	for i, p := range parts {
		h, err := m.src.GetOffset(p.topic, p.id, sarama.OffsetNewest)
		if err != nil {
			return nil, fmt.Errorf("mirror: high watermark of %s/%d on %s: %w", p.topic, p.id, m.cfg.SourceName, err)
		}
		hwms[i] = h
	}
	return hwms, nil
}

func (m *Mirror) closeClients() {
	m.dialer.closeAll()
	m.clientsMu.Lock()
	defer m.clientsMu.Unlock()
	m.clientsClosed = true
	for _, cl := range []sarama.Client{m.src, m.dst} {
		if cl != nil {
			_ = cl.Close() // all connections are cut already: nothing to flush
		}
	}
}

func (m *Mirror) syncsName() string {
	if m.cfg.OffsetSyncsOnTarget {
		return m.cfg.TargetName
	}
	return m.cfg.SourceName
}

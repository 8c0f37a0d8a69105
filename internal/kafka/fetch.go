package kafka

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"
)

// The fetch path of the agents (docs/RELAY.md §2): one Fetcher per cluster
// consumed (this file), one goroutine per source broker owning a
// dedicated Conn and sending multi-partition Fetch requests
// (fetch_broker.go), each response decoded into one Chunk per partition
// that a FetchPartition queues for its consumer (fetch_partition.go);
// the bounds in fetch_config.go, the byte budget in budget.go.

// Backoffs of the fetch path: after a failed request or a partition error,
// and between metadata refreshes for partitions whose leader moved.
const (
	fetchRetryMin = 100 * time.Millisecond
	fetchRetryMax = time.Second
	// heldFactor × PartitionMaxBytes of unreleased chunks leaves a
	// partition out of requests: a slow consumer stalls only its own.
	heldFactor = 2
)

// FetchStats are a Fetcher's counters since it was made.
type FetchStats struct {
	// Requests is the number of Fetch requests answered.
	Requests int64
	// Throttled is the time brokers asked the Fetcher to wait (the
	// responses' ThrottleTime), summed.
	Throttled time.Duration
	// Errors counts failed requests (transport errors, timeouts) and
	// partition errors other than leader moves.
	Errors int64
	// Moves counts partitions sent to look for their leader again.
	Moves int64
}

// Fetcher consumes partitions of one cluster with Fetch requests of its
// own: per source broker a goroutine owning a dedicated Conn sends one
// request at a time (read_committed, MinBytes 1), naming up to
// MaxPartitions of its ready partitions, in rotation. Partitions move
// between brokers as their leaders do; a hung broker stalls only its own.
//
// It uses the sarama.Client it is given for metadata only (leaders and
// their epochs, refreshes), and its Config for the connections (TLS, SASL,
// dialer or proxy, timeouts). The client must outlive the Fetcher.
type Fetcher struct {
	name    string
	client  sarama.Client
	conf    *sarama.Config
	cfg     FetchConfig
	log     *zap.Logger
	ceiling int16 // FetchVersion of the cluster's configured version

	ctx       context.Context
	cancel    context.CancelFunc
	loops     sync.WaitGroup // the broker loops, waited for by Close
	moverDone chan struct{}  // closed when the mover returned
	done      chan struct{}  // closed when every goroutine returned
	moverKick chan struct{}

	requests  atomic.Int64
	throttled atomic.Int64 // nanoseconds
	// inflation is the last response's charge per byte on the wire
	// (float64 bits, at least 1): compressed batches, and every record's
	// RecordOverhead, make the records weigh more than the response.
	inflation atomic.Uint64
	errs      atomic.Int64
	moves     atomic.Int64

	mu       sync.Mutex
	closed   bool
	brokers  map[int32]*fetchBroker
	homeless map[*FetchPartition]bool // waiting for a leader: value true when metadata must be refreshed first
	active   map[fetchTP]*FetchPartition
}

type fetchTP struct {
	topic     string
	partition int32
}

// NewFetcher returns a Fetcher of the cluster named name (for logs and
// errors) that client connects to. It starts the goroutine that finds
// partitions their leaders; broker goroutines start with their first
// partition. Close stops them.
func NewFetcher(name string, client sarama.Client, cfg FetchConfig) (*Fetcher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("kafka: cluster %s: %w", name, err)
	}
	cfg = cfg.withDefaults()
	conf := client.Config()
	if conf.Net.ReadTimeout <= cfg.MaxWait {
		return nil, fmt.Errorf("kafka: cluster %s: fetch MaxWait %v must be below Net.ReadTimeout %v, or every long poll times out", name, cfg.MaxWait, conf.Net.ReadTimeout)
	}
	ctx, cancel := context.WithCancel(context.Background())
	f := &Fetcher{name: name, client: client, conf: conf, cfg: cfg, ceiling: FetchVersion(conf.Version),
		log: cfg.Logger.With(zap.String("cluster", name)), ctx: ctx, cancel: cancel,
		moverDone: make(chan struct{}), done: make(chan struct{}), moverKick: make(chan struct{}, 1),
		brokers: map[int32]*fetchBroker{}, homeless: map[*FetchPartition]bool{}, active: map[fetchTP]*FetchPartition{}}
	go f.mover()
	go func() {
		<-f.moverDone
		f.loops.Wait()
		close(f.done)
	}()
	return f, nil
}

// ErrFetcherClosed is returned by ConsumePartition after Close.
var ErrFetcherClosed = errors.New("kafka: the fetcher is closed")

// ConsumePartition starts fetching topic/partition at offset (>= 0: the
// caller resolves OffsetOldest and OffsetNewest). It does not wait for the
// network: the partition joins its leader's requests once the leader is
// known. A partition is consumed once at a time: it fails while a previous
// FetchPartition of it is neither closed nor ended.
func (f *Fetcher) ConsumePartition(topic string, partition int32, offset int64) (*FetchPartition, error) {
	if offset < 0 {
		return nil, fmt.Errorf("kafka: cluster %s: fetch %s/%d at %d: resolve the offset first", f.name, topic, partition, offset)
	}
	p := &FetchPartition{f: f, topic: topic, partition: partition, offset: offset, maxBytes: f.cfg.PartitionMaxBytes,
		ready: make(chan struct{}, 1), done: make(chan struct{})}
	p.hwm.Store(-1)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return nil, ErrFetcherClosed
	}
	tp := fetchTP{topic, partition}
	if old := f.active[tp]; old != nil && !old.stopped.Load() {
		return nil, fmt.Errorf("kafka: cluster %s: %s/%d is already being fetched: close it first", f.name, topic, partition)
	}
	f.active[tp] = p
	f.homeless[p] = false
	kick(f.moverKick)
	return p, nil
}

// Stats returns the Fetcher's counters.
func (f *Fetcher) Stats() FetchStats {
	return FetchStats{Requests: f.requests.Load(), Throttled: time.Duration(f.throttled.Load()), Errors: f.errs.Load(), Moves: f.moves.Load()}
}

// Close stops fetching and closes every partition (their queued chunks
// released). It closes the broker connections, so it does not wait for
// responses in flight, and waits only for the broker goroutines, which
// then return at once (but for a dial through a Dialer that takes no
// context, Options.Dialer: it ends within that dialer's own timeout). A
// metadata refresh in flight is not waited for: it ends within the
// client's Metadata.Timeout, and Done is closed then. Safe to call more
// than once.
func (f *Fetcher) Close() {
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return
	}
	f.closed = true
	parts := make([]*FetchPartition, 0, len(f.active))
	for _, p := range f.active {
		parts = append(parts, p)
	}
	f.mu.Unlock()
	f.cancel()
	for _, p := range parts {
		p.Close()
	}
	f.loops.Wait()
}

// Done is closed once every goroutine of the Fetcher has returned, after
// Close.
func (f *Fetcher) Done() <-chan struct{} { return f.done }

// homeward hands p, which left its broker (or never had one), to the mover
// to find its leader; refresh asks for fresh metadata first.
func (f *Fetcher) homeward(p *FetchPartition, refresh bool) {
	f.moves.Add(1)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed || p.stopped.Load() {
		return
	}
	f.homeless[p] = f.homeless[p] || refresh
	kick(f.moverKick)
}

// mover finds the leaders of the partitions that have none: after a leader
// move or a broker failure, with a metadata refresh, coalesced and at most
// one per fetchRetryMin; new partitions from the client's cache.
func (f *Fetcher) mover() {
	defer close(f.moverDone)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	var lastRefresh time.Time
	for {
		select {
		case <-f.ctx.Done():
			return
		case <-f.moverKick:
		case <-timer.C:
		}
		f.mu.Lock()
		if f.closed {
			f.mu.Unlock()
			return
		}
		var topics []string
		seen := map[string]bool{}
		parts := make([]*FetchPartition, 0, len(f.homeless))
		var stale []*FetchPartition // waiting for a refresh
		for p, refresh := range f.homeless {
			if refresh {
				stale = append(stale, p)
				if !seen[p.topic] {
					seen[p.topic] = true
					topics = append(topics, p.topic)
				}
				continue
			}
			parts = append(parts, p)
		}
		f.mu.Unlock()
		var next time.Time
		if wait := fetchRetryMin - time.Since(lastRefresh); len(topics) > 0 && wait > 0 {
			// Refreshed less than fetchRetryMin ago: the others are
			// placed now, these at the next refresh.
			next = time.Now().Add(wait)
		} else if len(topics) > 0 {
			lastRefresh = time.Now()
			if err := f.client.RefreshMetadata(topics...); err != nil {
				f.log.Debug("metadata refresh for partitions without a leader failed", zap.Strings("topics", topics), zap.Error(err))
			}
			f.mu.Lock()
			for _, p := range stale {
				if _, ok := f.homeless[p]; ok {
					f.homeless[p] = false
				}
			}
			f.mu.Unlock()
			parts = append(parts, stale...)
		}
		for _, p := range parts {
			if wake := f.place(p); !wake.IsZero() && (next.IsZero() || wake.Before(next)) {
				next = wake
			}
		}
		if !next.IsZero() {
			timer.Reset(time.Until(next))
		}
	}
}

// place assigns homeless p to its leader's broker loop, or returns when to
// try again.
func (f *Fetcher) place(p *FetchPartition) (retryAt time.Time) {
	if p.stopped.Load() {
		f.mu.Lock()
		delete(f.homeless, p)
		f.mu.Unlock()
		return time.Time{}
	}
	now := time.Now()
	if now.Before(p.notBefore) {
		return p.notBefore
	}
	leader, epoch, err := f.client.LeaderAndEpoch(p.topic, p.partition)
	if err != nil {
		p.failures++
		p.notBefore = now.Add(backoff(p.failures))
		f.log.Debug("no leader for partition yet", zap.String("topic", p.topic), zap.Int32("partition", p.partition), zap.Error(err))
		f.mu.Lock()
		if _, ok := f.homeless[p]; ok {
			f.homeless[p] = true
		}
		f.mu.Unlock()
		return p.notBefore
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return time.Time{}
	}
	if refresh, ok := f.homeless[p]; !ok || refresh {
		// Stopped meanwhile, or failed again: the next round.
		return time.Time{}
	}
	delete(f.homeless, p)
	b := f.brokers[leader.ID()]
	if b == nil {
		b = &fetchBroker{f: f, id: leader.ID(), kick: make(chan struct{}, 1)}
		f.brokers[b.id] = b
		f.loops.Add(1)
		go b.run()
	}
	b.mu.Lock()
	b.addr = leader.Addr()
	p.epoch = epoch
	b.parts = append(b.parts, p)
	b.mu.Unlock()
	p.broker.Store(b)
	kick(b.kick)
	return time.Time{}
}

func backoff(failures int) time.Duration {
	d := fetchRetryMin
	for i := 1; i < failures && d < fetchRetryMax; i++ {
		d *= 2
	}
	return min(d, fetchRetryMax)
}

// kick wakes the owner of ch, a 1-buffered channel, unless already woken.
func kick(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

package signals

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/internal/etcdwatch"
	"github.com/kswitch/kswitch/internal/notify"
	"github.com/kswitch/kswitch/keys"
)

// Watcher follows a fleet's signal keys. Run owns its only goroutine; the
// other methods may be called from any goroutine, before, during or after
// Run.
type Watcher struct {
	client  *clientv3.Client
	keys    keys.Fleet
	timeout time.Duration
	log     *zap.Logger

	started atomic.Bool
	state   atomic.Pointer[State]
	ready   chan struct{}

	subs notify.Subscribers

	// Owned by Run's goroutine.
	fold     *fold
	runCtx   context.Context
	lookup   context.Context // bounds the history lookups of one Reset or Apply
	failures int
}

// NewWatcher returns a watcher of the signals of fleet k. timeout bounds
// each full read of the keys, and the history lookups for the refused
// values found by one read or one watch response. A nil log means no logs.
func NewWatcher(c *clientv3.Client, k keys.Fleet, timeout time.Duration, log *zap.Logger) *Watcher {
	if log == nil {
		log = zap.NewNop()
	}
	w := &Watcher{client: c, keys: k, timeout: timeout, log: log, ready: make(chan struct{})}
	w.fold = newFold(k, log, w.getAt)
	return w
}

// OnRefused sets f to be called with each value the watcher refuses (once
// per value: a re-read that finds it unchanged does not call f again), for
// a metric. f is called from Run's goroutine and must not block. Call
// OnRefused before Run.
func (w *Watcher) OnRefused(f func(Refusal)) { w.fold.onRefused = f }

// Run reads every signal key, then follows them until ctx ends, reading
// them all again whenever the watch breaks (etcd restarted, leader lost,
// compaction): changes missed meanwhile are applied by the same rules.
// It returns ctx.Err(), or an error at once if Run was called before.
func (w *Watcher) Run(ctx context.Context) error {
	if !w.started.CompareAndSwap(false, true) {
		return errors.New("signals: Watcher.Run called twice")
	}
	w.runCtx = ctx
	return etcdwatch.Follow(ctx, w.client, etcdwatch.Target{Key: w.keys.Signals(), Prefix: true, Timeout: w.timeout, OnError: func(err error) {
		w.failures++
		if w.failures == 1 {
			w.log.Warn("signals watch interrupted; reading the signals again", zap.Error(err))
		} else {
			w.log.Debug("signals watch still interrupted", zap.Int("failures", w.failures), zap.Error(err))
		}
	}}, (*follower)(w))
}

// State returns the signals in force. Before the first read completes (see
// Ready) it is the zero State: nothing paused.
func (w *Watcher) State() State {
	if s := w.state.Load(); s != nil {
		return *s
	}
	return State{}
}

// Ready is closed once Run has read every signal key for the first time,
// even when there is none. An agent waits for it (and for its own ctx)
// before it consumes, so a paused fleet stays paused across restarts. It is
// never closed if Run never reads etcd.
func (w *Watcher) Ready() <-chan struct{} { return w.ready }

// Subscribe returns a channel that receives a value after the State
// changed; notifications coalesce (the buffer holds one), so a subscriber
// reads State() after each one. Subscribe before reading State to miss no
// change. The subscription ends when ctx ends; the channel is not closed.
// Watcher never blocks on a subscriber.
func (w *Watcher) Subscribe(ctx context.Context) <-chan struct{} { return w.subs.Subscribe(ctx) }

// publish stores the fold's state and tells the subscribers.
func (w *Watcher) publish() {
	s := w.fold.state()
	w.state.Store(&s)
	w.subs.Notify()
}

// getAt reads a key's earlier version. It runs on Run's goroutine, inside
// a Reset or Apply, whose lookups together take at most the watcher's
// timeout: when etcd hangs, one batch waits for it once, not once per key.
func (w *Watcher) getAt(key string, rev int64) (*mvccpb.KeyValue, error) {
	return getAt(w.lookup, w.client, key, rev)
}

// withLookups runs fn with w.lookup set.
func (w *Watcher) withLookups(fn func()) {
	ctx, cancel := context.WithTimeout(w.runCtx, w.timeout)
	defer cancel()
	w.lookup = ctx
	defer func() { w.lookup = nil }()
	fn()
}

func getAt(ctx context.Context, c *clientv3.Client, key string, rev int64) (*mvccpb.KeyValue, error) {
	resp, err := c.Get(ctx, key, clientv3.WithRev(rev))
	if err != nil {
		return nil, err
	}
	if len(resp.Kvs) == 0 {
		return nil, nil
	}
	return resp.Kvs[0], nil
}

// follower is the Watcher as an etcdwatch.Follower; its methods run on
// Run's goroutine, one at a time.
type follower Watcher

func (f *follower) Reset(kvs []*mvccpb.KeyValue, rev int64) {
	w := (*Watcher)(f)
	if w.failures > 0 {
		w.log.Info("signals watch re-established", zap.Int("failures", w.failures), zap.Int64("revision", rev))
		w.failures = 0
	}
	w.withLookups(func() { w.fold.reset(kvs, rev) })
	w.publish()
	select {
	case <-w.ready:
	default:
		close(w.ready)
	}
}

func (f *follower) Apply(evs []*clientv3.Event) {
	w := (*Watcher)(f)
	w.withLookups(func() { w.fold.apply(evs) })
	w.publish()
}

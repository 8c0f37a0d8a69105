package election

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Leader describes the current leader as seen in etcd.
type Leader struct {
	// ID is the leader's agent id.
	ID string `json:"leader"`
	// Token is the fencing token: the creation revision of the leader key.
	Token int64 `json:"fencing_token"`
	// Key is the leader key.
	Key string `json:"key"`
}

// ErrNoLeader is returned by Current when nobody leads.
var ErrNoLeader = errors.New("election: no leader")

// Current reads the leader of the election under prefix: the key with the
// lowest creation revision, as concurrency.Election does.
func Current(ctx context.Context, c *clientv3.Client, prefix string) (Leader, error) {
	resp, err := c.Get(ctx, prefix, clientv3.WithFirstCreate()...)
	if err != nil {
		return Leader{}, fmt.Errorf("election: read leader of %s: %w", prefix, err)
	}
	if len(resp.Kvs) == 0 {
		return Leader{}, ErrNoLeader
	}
	kv := resp.Kvs[0]
	return Leader{ID: string(kv.Value), Token: kv.CreateRevision, Key: string(kv.Key)}, nil
}

// Observer follows who leads an election. Run owns its only goroutine;
// Leader and Changes may be called from any goroutine.
type Observer struct {
	client  *clientv3.Client
	prefix  string
	log     *zap.Logger
	timeout time.Duration

	mu      sync.Mutex
	cur     Leader
	known   bool // cur is valid (false: no leader, or not read yet)
	changes chan struct{}
}

// NewObserver returns an observer of the election under prefix. timeout
// bounds each read from etcd.
func NewObserver(c *clientv3.Client, prefix string, timeout time.Duration, log *zap.Logger) *Observer {
	if log == nil {
		log = zap.NewNop()
	}
	return &Observer{client: c, prefix: prefix, log: log, timeout: timeout, changes: make(chan struct{}, 1)}
}

// Leader returns the last leader observed, and false when there is none
// (or none was observed yet). While etcd is unreachable it keeps returning
// the last value read.
func (o *Observer) Leader() (Leader, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.cur, o.known
}

// Changes returns a channel that receives a value after the leader
// changed. Notifications coalesce: one value may stand for several
// changes, so a receiver reads Leader afterwards. Meant for one receiver.
func (o *Observer) Changes() <-chan struct{} { return o.changes }

// Run follows the election until ctx ends, re-establishing the watch when
// it breaks. It returns ctx.Err().
func (o *Observer) Run(ctx context.Context) error {
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := o.follow(ctx)
		if ctx.Err() != nil {
			break
		}
		o.log.Debug("leader watch interrupted; retrying", zap.Error(err), zap.Duration("backoff", backoff))
		select {
		case <-ctx.Done():
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 2*time.Second)
	}
	return ctx.Err()
}

// follow reads the leader, then re-reads it on every change under the
// prefix until the watch breaks.
func (o *Observer) follow(ctx context.Context) error {
	rev, err := o.refresh(ctx)
	if err != nil {
		return err
	}
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	wch := o.client.Watch(wctx, o.prefix, clientv3.WithPrefix(), clientv3.WithRev(rev+1))
	for wr := range wch {
		if err := wr.Err(); err != nil {
			return err
		}
		if len(wr.Events) == 0 {
			continue
		}
		if _, err := o.refresh(ctx); err != nil {
			return err
		}
	}
	return errors.New("election: leader watch closed")
}

// refresh reads the leader and returns the revision it was read at.
func (o *Observer) refresh(ctx context.Context) (int64, error) {
	rctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	resp, err := o.client.Get(rctx, o.prefix, clientv3.WithFirstCreate()...)
	if err != nil {
		return 0, err
	}
	var l Leader
	known := len(resp.Kvs) > 0
	if known {
		kv := resp.Kvs[0]
		l = Leader{ID: string(kv.Value), Token: kv.CreateRevision, Key: string(kv.Key)}
	}
	o.mu.Lock()
	changed := known != o.known || l != o.cur
	o.cur, o.known = l, known
	o.mu.Unlock()
	if changed {
		select {
		case o.changes <- struct{}{}:
		default:
		}
	}
	return resp.Header.Revision, nil
}

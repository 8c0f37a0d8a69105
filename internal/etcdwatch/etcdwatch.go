// Package etcdwatch follows a key or prefix in etcd: read it, then apply
// every change, and read it again whenever the watch breaks (compaction,
// leader loss, a closed channel), so the follower never misses a change
// and never acts on a partial view.
package etcdwatch

import (
	"context"
	"errors"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Follower receives what Follow reads. Its methods are called from
// Follow's goroutine only, one at a time.
type Follower interface {
	// Reset replaces the follower's view with kvs, read at revision rev.
	Reset(kvs []*mvccpb.KeyValue, rev int64)
	// Apply applies the events of one watch response.
	Apply(events []*clientv3.Event)
}

// Target is what Follow follows, and how.
type Target struct {
	Key string
	// Prefix: Key is a prefix, and every key under it is followed.
	Prefix bool
	// Timeout bounds each read.
	Timeout time.Duration
	// OnError, when set, is told about each break.
	OnError func(error)
}

// Follow reads t's key (or keys) and follows it until ctx ends, reading
// again after every break with a backoff up to 2 s. It returns
// ctx.Err().
func Follow(ctx context.Context, c *clientv3.Client, t Target, f Follower) error {
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		began := time.Now()
		err := follow(ctx, c, t, f)
		if ctx.Err() != nil {
			break
		}
		if t.OnError != nil {
			t.OnError(err)
		}
		if time.Since(began) > 10*time.Second {
			backoff = 100 * time.Millisecond // it had worked for a while
		}
		select {
		case <-ctx.Done():
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 2*time.Second)
	}
	return ctx.Err()
}

func follow(ctx context.Context, c *clientv3.Client, t Target, f Follower) error {
	key, timeout := t.Key, t.Timeout
	var opts []clientv3.OpOption
	if t.Prefix {
		opts = append(opts, clientv3.WithPrefix())
	}
	rctx, cancel := context.WithTimeout(ctx, timeout)
	resp, err := c.Get(rctx, key, opts...)
	cancel()
	if err != nil {
		return err
	}
	f.Reset(resp.Kvs, resp.Header.Revision)
	wctx, wcancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer wcancel()
	wch := c.Watch(wctx, key, append(opts, clientv3.WithRev(resp.Header.Revision+1))...)
	for wr := range wch {
		if err := wr.Err(); err != nil {
			return err
		}
		if len(wr.Events) > 0 {
			f.Apply(wr.Events)
		}
	}
	return errors.New("etcdwatch: watch closed")
}

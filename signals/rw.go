package signals

import (
	"context"
	"fmt"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/keys"
)

// Read reads the signals of fleet k once, by the rules a Watcher applies;
// a refused value's predecessors are looked up in etcd's history. It is
// for `kswitch status` and `kswitch signals`; ctx bounds every request.
func Read(ctx context.Context, c *clientv3.Client, k keys.Fleet) (State, error) {
	resp, err := c.Get(ctx, k.Signals(), clientv3.WithPrefix())
	if err != nil {
		return State{}, fmt.Errorf("signals: read %s: %w", k.Signals(), err)
	}
	f := newFold(k, zap.NewNop(), func(key string, rev int64) (*mvccpb.KeyValue, error) {
		return getAt(ctx, c, key, rev)
	})
	f.reset(resp.Kvs, resp.Header.Revision)
	if err := ctx.Err(); err != nil {
		return State{}, err
	}
	return f.state(), nil
}

// Write stores the signal of scope: Format(paused, note) at scope.Key(k).
func Write(ctx context.Context, c *clientv3.Client, k keys.Fleet, scope Scope, paused bool, note string) error {
	if err := scope.Validate(); err != nil {
		return err
	}
	v, err := Format(paused, note)
	if err != nil {
		return err
	}
	if _, err := c.Put(ctx, scope.Key(k), v); err != nil {
		if ctx.Err() != nil && err == ctx.Err() {
			return err
		}
		return fmt.Errorf("signals: write %s: %w", scope.Key(k), err)
	}
	return nil
}

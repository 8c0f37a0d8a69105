package fleet

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/dynconfig"
	"github.com/kswitch/kswitch/state"
)

// ConfigChange is what ApplyConfig writes under config/, the fleet's
// dynamic configuration over each agent's file: the source section (nil:
// left as it is) and clusters, each written whole (YAML, as in the file);
// the clusters it does not name are kept.
type ConfigChange struct {
	Source   []byte
	Clusters map[string][]byte
}

// ConfigCheck says what ApplyConfig checks before it writes, beyond each
// value (which it always checks, as the leader does).
type ConfigCheck struct {
	// File, when set, is an agent's configuration: the change laid over
	// it must make a valid configuration (the leader checks this too,
	// with its own file).
	File *config.Config
	// Reach asks the brokers of each cluster the change names, from
	// here, whether they answer (dynconfig's reach timeout each).
	Reach bool
}

// ApplyConfig checks change and writes it under config/ in one
// transaction that writes nothing if a key there changed since it was
// read. The leader then checks the configuration it makes and accepts it
// as the next version, or refuses it and keeps the version in force:
// AwaitConfig tells which. It returns the revision written.
func (o *Operator) ApplyConfig(ctx context.Context, change ConfigChange, check ConfigCheck) (revision int64, err error) {
	if change.Source == nil && len(change.Clusters) == 0 {
		return 0, fmt.Errorf("fleet %s: the change names no source and no cluster: nothing to write", o.name)
	}
	cur, err := dynconfig.Read(ctx, o.etcd, o.keys)
	if err != nil {
		return 0, fmt.Errorf("fleet %s: %w", o.name, err)
	}
	next := cur
	next.Clusters = maps.Clone(cur.Clusters)
	if next.Clusters == nil {
		next.Clusters = map[string][]byte{}
	}
	if change.Source != nil {
		next.Source = change.Source
	}
	maps.Copy(next.Clusters, change.Clusters)
	base := config.Default()
	if check.File != nil {
		base = *check.File
	}
	ov, err := next.Decode(o.keys, base)
	if err != nil {
		return 0, fmt.Errorf("fleet %s: the change is invalid; nothing written:\n%w", o.name, err)
	}
	if check.File != nil {
		if _, err := ov.Apply(*check.File); err != nil {
			return 0, fmt.Errorf("fleet %s: the change with the file's configuration is invalid; nothing written:\n%w", o.name, err)
		}
	}
	if check.Reach {
		for _, name := range slices.Sorted(maps.Keys(change.Clusters)) {
			cl := ov.Clusters[name]
			if err := dynconfig.Reach(ctx, name, cl, dynconfig.DefaultReachTimeout); err != nil {
				return 0, fmt.Errorf("fleet %s: cluster %s: brokers %s: %w from here: %w; nothing written",
					o.name, name, strings.Join(cl.Brokers, ","), ErrUnreachable, err)
			}
		}
	}
	k := o.keys
	var ops []clientv3.Op
	if change.Source != nil {
		ops = append(ops, clientv3.OpPut(k.ConfigSource(), string(change.Source)))
	}
	for _, name := range slices.Sorted(maps.Keys(change.Clusters)) {
		ops = append(ops, clientv3.OpPut(k.ConfigCluster(name), string(change.Clusters[name])))
	}
	// No key under config/ was written since the read (a concurrent
	// deletion is not caught; the leader checks the result anyway).
	cmp := clientv3.Compare(clientv3.ModRevision(k.Config()).WithPrefix(), "<", cur.Revision+1)
	resp, err := o.etcd.Txn(ctx).If(cmp).Then(ops...).Commit()
	if err != nil {
		return 0, fmt.Errorf("fleet %s: write under %s: %w", o.name, k.Config(), err)
	}
	if !resp.Succeeded {
		return 0, fmt.Errorf("fleet %s: %s changed while the change was checked; apply it again", o.name, k.Config())
	}
	return resp.Header.Revision, nil
}

// ErrUnreachable is ApplyConfig's error when a cluster's brokers do not
// answer the check of ConfigCheck.Reach.
var ErrUnreachable = errors.New("the brokers do not answer")

// ErrNoConfigVerdict is AwaitConfig's error when ctx ended before a
// leader said anything of the configuration.
var ErrNoConfigVerdict = errors.New("no verdict from a leader: is the fleet running? its status shows the leader")

// AwaitConfig waits until the leader accepted or refused the
// configuration written at revision, polling every 100 ms until ctx ends.
// Accepted, it returns the version's number and what changed in it;
// refused, an error with the leader's reasons (the version in force
// stays).
func (o *Operator) AwaitConfig(ctx context.Context, revision int64) (number int64, changed []string, err error) {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		s, err := state.ReadConfigState(ctx, o.etcd, o.keys)
		switch {
		case err != nil && !errors.Is(err, state.ErrMalformed):
		case s.Refusal != nil && s.Refusal.Revision >= revision:
			return 0, nil, fmt.Errorf("fleet %s: the leader refused it; version %d stays in force:\n%s", o.name, s.Refusal.InForce, s.Refusal.Reason)
		case s.Version.Revision >= revision:
			return s.Version.Number, s.Version.Changed, nil
		}
		select {
		case <-ctx.Done():
			return 0, nil, fmt.Errorf("fleet %s: %w", o.name, ErrNoConfigVerdict)
		case <-t.C:
		}
	}
}

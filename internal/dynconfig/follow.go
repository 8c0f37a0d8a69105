package dynconfig

import (
	"context"
	"encoding/json"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/etcdwatch"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// Applier is what an agent does with the versions the leader accepted.
// Its methods are called from Follow's goroutine, one at a time, in the
// order etcd holds the versions.
type Applier interface {
	// Apply puts cfg, the file with v applied, in force. v.Number is 0
	// when etcd holds no version: the file alone.
	Apply(v state.ConfigVersion, cfg config.Config)
	// Refuse reports a version this agent cannot apply: its value does not
	// decode, or it does not validate over this agent's file (the files of
	// the fleet differ). The previous version stays in force.
	Refuse(v state.ConfigVersion, err error)
}

// Follow follows state/config until ctx ends, handing each version to a,
// merged over file. The first call comes after the first read. A value
// that repeats the version in force (a watch re-read) is not handed on.
// It returns ctx.Err().
func Follow(ctx context.Context, c *clientv3.Client, file config.Config, timeout time.Duration, log *zap.Logger, a Applier) error {
	k := keys.New(file.Fleet)
	f := &follower{file: file, key: k.StateConfig(), a: a, log: log, last: -1}
	return etcdwatch.Follow(ctx, c, etcdwatch.Target{Key: k.StateConfig(), Timeout: timeout, OnError: func(err error) {
		log.Warn("watch of the configuration version interrupted; reading it again", zap.Error(err))
	}}, f)
}

type follower struct {
	file config.Config
	key  string
	a    Applier
	log  *zap.Logger
	last int64 // mod revision of the value last handed on; 0 none, -1 before the first read
}

func (f *follower) Reset(kvs []*mvccpb.KeyValue, _ int64) {
	if len(kvs) == 0 {
		f.handle(nil, 0)
		return
	}
	f.handle(kvs[0].Value, kvs[0].ModRevision)
}

func (f *follower) Apply(evs []*clientv3.Event) {
	for _, ev := range evs {
		if ev.Type == clientv3.EventTypeDelete {
			f.handle(nil, 0)
			continue
		}
		f.handle(ev.Kv.Value, ev.Kv.ModRevision)
	}
}

// handle hands on the value of state/config at mod revision rev (nil and 0
// when the key is absent).
func (f *follower) handle(val []byte, rev int64) {
	if rev == f.last {
		return
	}
	f.last = rev
	var v state.ConfigVersion
	if val != nil {
		var err error
		if v, err = state.ParseConfigVersion(val); err != nil {
			f.log.Warn("configuration version refused: the value does not decode; the previous version stays in force",
				zap.String("key", f.key), zap.Int64("mod_revision", rev), zap.Error(err))
			f.a.Refuse(state.ConfigVersion{Revision: rev}, err)
			return
		}
	}
	cfg, err := v.Overrides.Apply(f.file)
	if err != nil {
		f.log.Warn("configuration version refused: it does not validate over this agent's file; the previous version stays in force",
			zap.Int64("version", v.Number), zap.Error(err))
		f.a.Refuse(v, err)
		return
	}
	f.a.Apply(v, cfg)
}

// FollowRefusal follows state/config-refused until ctx ends and calls
// report with the refusal in etcd (nil when there is none), after the
// first read and after every change. It returns ctx.Err().
func FollowRefusal(ctx context.Context, c *clientv3.Client, k keys.Fleet, timeout time.Duration, report func(*state.ConfigRefusal)) error {
	return etcdwatch.Follow(ctx, c, etcdwatch.Target{Key: k.ConfigRefusal(), Timeout: timeout}, refusalFollower(report))
}

type refusalFollower func(*state.ConfigRefusal)

func (f refusalFollower) Reset(kvs []*mvccpb.KeyValue, _ int64) {
	if len(kvs) == 0 {
		f(nil)
		return
	}
	f(parseRefusal(kvs[0].Value))
}

func (f refusalFollower) Apply(evs []*clientv3.Event) {
	for _, ev := range evs {
		if ev.Type == clientv3.EventTypeDelete {
			f(nil)
		} else {
			f(parseRefusal(ev.Kv.Value))
		}
	}
}

// parseRefusal decodes a refusal; one that does not decode (not written
// by a leader) is reported as such rather than hidden.
func parseRefusal(b []byte) *state.ConfigRefusal {
	var r state.ConfigRefusal
	if len(b) > state.MaxConfigValueSize || json.Unmarshal(b, &r) != nil {
		return &state.ConfigRefusal{Reason: "state/config-refused holds a value that is not a refusal"}
	}
	return &r
}

package agent

import (
	"context"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/internal/etcdwatch"
	"github.com/kswitch/kswitch/internal/notify"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// registry follows agents/ in etcd. run owns its goroutine; the other
// methods may be called from any goroutine.
type registry struct {
	client  *clientv3.Client
	keys    keys.Fleet
	log     *zap.Logger
	timeout time.Duration
	onBad   func() // counts refused values; must not block

	mu   sync.Mutex
	regs map[string]state.Registration
	subs notify.Subscribers
}

func newRegistry(c *clientv3.Client, k keys.Fleet, timeout time.Duration, log *zap.Logger, onBad func()) *registry {
	return &registry{client: c, keys: k, log: log, timeout: timeout, onBad: onBad, regs: map[string]state.Registration{}}
}

// list returns the registered agents sorted by id.
func (r *registry) list() []state.Registration {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := slices.Collect(maps.Values(r.regs))
	slices.SortFunc(out, func(a, b state.Registration) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// Lease returns the session lease of agent id's registration.
func (r *registry) Lease(id string) (clientv3.LeaseID, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	reg, ok := r.regs[id]
	return reg.Lease, ok
}

// get returns agent id's registration, false when it is not registered.
func (r *registry) get(id string) (state.Registration, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	reg, ok := r.regs[id]
	return reg, ok
}

// Live returns the ids of the registered agents, sorted. An agent is
// registered exactly while its session lease lives.
func (r *registry) Live() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Sorted(maps.Keys(r.regs))
}

// Subscribe returns a channel that receives a value after the registered
// agents changed; notifications coalesce. It is unsubscribed when ctx ends.
func (r *registry) Subscribe(ctx context.Context) <-chan struct{} { return r.subscribe(ctx) }

func (r *registry) subscribe(ctx context.Context) chan struct{} { return r.subs.Subscribe(ctx) }

// run follows agents/ until ctx ends.
func (r *registry) run(ctx context.Context) {
	_ = etcdwatch.Follow(ctx, r.client, etcdwatch.Target{Key: r.keys.Agents(), Prefix: true, Timeout: r.timeout, OnError: func(err error) {
		r.log.Debug("agents watch interrupted; relisting", zap.Error(err))
	}}, r)
}

// Reset implements etcdwatch.Follower.
func (r *registry) Reset(kvs []*mvccpb.KeyValue, _ int64) {
	regs := map[string]state.Registration{}
	for _, kv := range kvs {
		if reg, ok := r.parse(kv); ok {
			regs[reg.ID] = reg
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.regs = regs
	r.subs.Notify()
}

// Apply implements etcdwatch.Follower.
func (r *registry) Apply(evs []*clientv3.Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, ev := range evs {
		id, ok := r.keys.AgentID(string(ev.Kv.Key))
		if !ok {
			continue
		}
		if ev.Type == clientv3.EventTypeDelete {
			delete(r.regs, id)
			continue
		}
		if reg, ok := r.parse(ev.Kv); ok {
			r.regs[id] = reg
		} else {
			delete(r.regs, id)
		}
	}
	r.subs.Notify()
}

func (r *registry) parse(kv *mvccpb.KeyValue) (state.Registration, bool) {
	id, ok := r.keys.AgentID(string(kv.Key))
	if !ok {
		return state.Registration{}, false
	}
	reg, err := state.ParseRegistrationKV(id, kv)
	if err != nil {
		r.log.Warn("ignoring agent registration", zap.String("key", string(kv.Key)), zap.Error(err))
		r.onBad()
		return state.Registration{}, false
	}
	return reg, true
}

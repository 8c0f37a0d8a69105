package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/keys"
)

// Registration is what an agent writes under agents/<id> on its session
// lease: the key exists exactly while the agent's session lives.
type Registration struct {
	ID      string    `json:"id"`
	HTTP    string    `json:"http"`
	Gossip  string    `json:"gossip"`
	Version string    `json:"version"`
	Started time.Time `json:"started"`
}

// maxRegistrationSize bounds what is parsed from agents/: a value written
// there by a stranger must not make an agent allocate without bound.
const maxRegistrationSize = 4 << 10

// ParseRegistration decodes and checks the value of the key agents/<id>.
func ParseRegistration(id string, val []byte) (Registration, error) {
	var r Registration
	if len(val) > maxRegistrationSize {
		return r, fmt.Errorf("agent: registration of %q is %d bytes, over the %d-byte limit", id, len(val), maxRegistrationSize)
	}
	if err := json.Unmarshal(val, &r); err != nil {
		return r, fmt.Errorf("agent: registration of %q is not valid JSON: %w", id, err)
	}
	if r.ID != id {
		return r, fmt.Errorf("agent: registration under key %q names agent %q", id, r.ID)
	}
	return r, nil
}

// ReadRegistrations lists the registered agents of a fleet, sorted by id.
// Values that do not parse are skipped and described in refused, so a
// caller can show the good ones and warn about the rest.
func ReadRegistrations(ctx context.Context, c *clientv3.Client, k keys.Fleet) (regs []Registration, refused []string, err error) {
	resp, err := c.Get(ctx, k.Agents(), clientv3.WithPrefix())
	if err != nil {
		return nil, nil, fmt.Errorf("agent: list %s: %w", k.Agents(), err)
	}
	for _, kv := range resp.Kvs {
		id, ok := k.AgentID(string(kv.Key))
		if !ok {
			continue
		}
		r, err := ParseRegistration(id, kv.Value)
		if err != nil {
			refused = append(refused, err.Error())
			continue
		}
		regs = append(regs, r)
	}
	slices.SortFunc(regs, func(a, b Registration) int { return strings.Compare(a.ID, b.ID) })
	return regs, refused, nil
}

// registry follows agents/ in etcd. run owns its goroutine; list and
// changes may be called from any goroutine.
type registry struct {
	client  *clientv3.Client
	keys    keys.Fleet
	log     *zap.Logger
	timeout time.Duration
	onBad   func() // counts refused values; must not block

	mu      sync.Mutex
	regs    map[string]Registration
	changes chan struct{}
}

func newRegistry(c *clientv3.Client, k keys.Fleet, timeout time.Duration, log *zap.Logger, onBad func()) *registry {
	return &registry{client: c, keys: k, log: log, timeout: timeout, onBad: onBad,
		regs: map[string]Registration{}, changes: make(chan struct{}, 1)}
}

// list returns the registered agents sorted by id.
func (r *registry) list() []Registration {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Registration, 0, len(r.regs))
	for _, reg := range r.regs {
		out = append(out, reg)
	}
	slices.SortFunc(out, func(a, b Registration) int { return strings.Compare(a.ID, b.ID) })
	return out
}

func (r *registry) notify() {
	select {
	case r.changes <- struct{}{}:
	default:
	}
}

// run lists and watches agents/ until ctx ends, relisting whenever the
// watch breaks.
func (r *registry) run(ctx context.Context) {
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := r.follow(ctx)
		if ctx.Err() != nil {
			return
		}
		r.log.Debug("agents watch interrupted; relisting", zap.Error(err))
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 2*time.Second)
	}
}

func (r *registry) follow(ctx context.Context) error {
	lctx, cancel := context.WithTimeout(ctx, r.timeout)
	resp, err := r.client.Get(lctx, r.keys.Agents(), clientv3.WithPrefix())
	cancel()
	if err != nil {
		return err
	}
	regs := map[string]Registration{}
	for _, kv := range resp.Kvs {
		if reg, ok := r.parse(kv.Key, kv.Value); ok {
			regs[reg.ID] = reg
		}
	}
	r.mu.Lock()
	r.regs = regs
	r.mu.Unlock()
	r.notify()

	wctx, wcancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer wcancel()
	wch := r.client.Watch(wctx, r.keys.Agents(), clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
	for wr := range wch {
		if err := wr.Err(); err != nil {
			return err
		}
		r.mu.Lock()
		for _, ev := range wr.Events {
			id, ok := r.keys.AgentID(string(ev.Kv.Key))
			if !ok {
				continue
			}
			if ev.Type == clientv3.EventTypeDelete {
				delete(r.regs, id)
				continue
			}
			if reg, ok := r.parse(ev.Kv.Key, ev.Kv.Value); ok {
				r.regs[id] = reg
			} else {
				delete(r.regs, id)
			}
		}
		r.mu.Unlock()
		r.notify()
	}
	return errors.New("agent: agents watch closed")
}

func (r *registry) parse(key, val []byte) (Registration, bool) {
	id, ok := r.keys.AgentID(string(key))
	if !ok {
		return Registration{}, false
	}
	reg, err := ParseRegistration(id, val)
	if err != nil {
		r.log.Warn("ignoring malformed agent registration", zap.String("key", string(key)), zap.Error(err))
		r.onBad()
		return Registration{}, false
	}
	return reg, true
}

// FleetView is a fleet as stored in etcd: who leads and who is registered.
// It is what `kswitch status` shows; it needs no running agent.
type FleetView struct {
	Fleet  string         `json:"fleet"`
	Leader string         `json:"leader"`
	Token  int64          `json:"fencing_token"`
	Agents []Registration `json:"agents"`
	// Refused lists registrations that could not be parsed.
	Refused []string `json:"refused,omitempty"`
}

// ReadFleet reads a fleet's leader and registrations from etcd.
func ReadFleet(ctx context.Context, c *clientv3.Client, fleet string) (FleetView, error) {
	k := keys.New(fleet)
	v := FleetView{Fleet: fleet}
	l, err := election.Current(ctx, c, k.Election())
	switch {
	case errors.Is(err, election.ErrNoLeader):
	case err != nil:
		return v, err
	default:
		v.Leader, v.Token = l.ID, l.Token
	}
	v.Agents, v.Refused, err = ReadRegistrations(ctx, c, k)
	return v, err
}

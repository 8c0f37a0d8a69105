package coordinator

import (
	"cmp"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"sync"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// The leader's followers of etcd keys besides state/: acks/ and control/pin.

// acks follows acks/: agent id → generation it has applied.
type acks struct {
	keys keys.Fleet
	log  *zap.Logger
	// leaseOf is the session lease of an agent's registration
	// (Membership.Lease): an ack counts only on it.
	leaseOf func(id string) (clientv3.LeaseID, bool)
	refused func()
	mu      sync.Mutex
	gens    map[string]ack
	// warned holds the acks on another lease already logged, so that a
	// stranger's value is logged once, not at every snapshot.
	warned  map[string]clientv3.LeaseID
	changed chan struct{}
	// synced is closed by the first read of acks/: before it, gens is
	// not what the agents applied.
	synced     chan struct{}
	syncedOnce sync.Once
}

// ack is one acks/<id> value and the lease it was written on.
type ack struct {
	gen   int64
	lease clientv3.LeaseID
}

func newAcks(k keys.Fleet, leaseOf func(string) (clientv3.LeaseID, bool), refused func(), log *zap.Logger) *acks {
	return &acks{keys: k, log: log, leaseOf: leaseOf, refused: refused, gens: map[string]ack{}, warned: map[string]clientv3.LeaseID{},
		changed: make(chan struct{}, 1), synced: make(chan struct{})}
}

func (a *acks) Reset(kvs []*mvccpb.KeyValue, _ int64) {
	m := map[string]ack{}
	for _, kv := range kvs {
		a.put(m, kv)
	}
	a.mu.Lock()
	a.gens = m
	a.mu.Unlock()
	a.syncedOnce.Do(func() { close(a.synced) })
	a.notify()
}

func (a *acks) Apply(evs []*clientv3.Event) {
	a.mu.Lock()
	for _, ev := range evs {
		if ev.Type == clientv3.EventTypeDelete {
			delete(a.gens, strings.TrimPrefix(string(ev.Kv.Key), a.keys.Acks()))
			continue
		}
		a.put(a.gens, ev.Kv)
	}
	a.mu.Unlock()
	a.notify()
}

func (a *acks) put(m map[string]ack, kv *mvccpb.KeyValue) {
	id := strings.TrimPrefix(string(kv.Key), a.keys.Acks())
	g, err := strconv.ParseInt(strings.TrimSpace(string(kv.Value)), 10, 64)
	if err != nil || g < 0 || g > state.MaxGeneration || kv.Lease == 0 {
		// An agent acknowledges a generation it applied (never above
		// state.MaxGeneration: it refuses those) on its session lease: any
		// other value was written by hand, and must not move
		// generations.
		a.log.Warn("ignoring malformed acknowledgement (a generation up to 2^53, on the agent's lease)", zap.String("key", string(kv.Key)),
			zap.ByteString("value", kv.Value), zap.Bool("lease", kv.Lease != 0))
		a.refused()
		delete(m, id)
		return
	}
	m[id] = ack{gen: g, lease: clientv3.LeaseID(kv.Lease)}
}

func (a *acks) notify() {
	select {
	case a.changed <- struct{}{}:
	default:
	}
}

// snapshot returns the generation each registered agent acknowledged on
// the lease of its registration. An ack on another lease (a stranger's,
// or one left by an earlier session of the agent) does not count: the
// agent has acknowledged nothing in its current session. An agent not
// registered (yet) has acknowledged nothing either.
func (a *acks) snapshot() map[string]int64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make(map[string]int64, len(a.gens))
	for id, v := range a.gens {
		lease, ok := a.leaseOf(id)
		if !ok {
			continue
		}
		if lease != v.lease {
			if a.warned[id] != v.lease {
				a.warned[id] = v.lease
				a.log.Warn("ignoring an acknowledgement that is not on the agent's lease", zap.String("acks", id),
					zap.Int64("generation", v.gen), zap.String("lease", fmt.Sprintf("%x", int64(v.lease))),
					zap.String("registration_lease", fmt.Sprintf("%x", int64(lease))))
				a.refused()
			}
			continue
		}
		out[id] = v.gen
	}
	return out
}

// upTo is snapshot without the acks above gen, the generation the
// leader published last: an agent acknowledges only what it applied, so
// an ack above gen was written by someone else, or is of a value someone
// else wrote (which the leader repairs); neither says the agent applied
// gen.
func (a *acks) upTo(gen int64) map[string]int64 {
	out := a.snapshot()
	for id, g := range out {
		if g > gen {
			delete(out, id)
		}
	}
	return out
}

// maxPinSize bounds a control/pin value: a cluster name, with room for
// surrounding whitespace.
const maxPinSize = 1 << 10

// pin follows control/pin.
type pin struct {
	mu      sync.Mutex
	val     string
	changed chan struct{}
	valid   func(string) bool
	log     *zap.Logger
	// refused, when set, counts each value refused.
	refused func()
}

func (p *pin) set(v string) {
	if len(v) > maxPinSize {
		p.refuse(fmt.Sprintf("%d bytes, over the %d-byte limit", len(v), maxPinSize), v)
		return
	}
	v = strings.TrimSpace(v)
	if v != "" && !p.valid(v) {
		p.refuse("not a primary or standby cluster of this configuration", v)
		return
	}
	p.mu.Lock()
	p.val = v
	p.mu.Unlock()
	select {
	case p.changed <- struct{}{}:
	default:
	}
}

// refuse logs and counts a refused value; the pin in force stays.
func (p *pin) refuse(reason, v string) {
	p.log.Warn("refusing control/pin; the pin in force stays", zap.String("reason", reason),
		zap.String("value", refused.Truncate([]byte(v), 200)), zap.String("in_force", cmp.Or(p.get(), "none (automatic)")))
	if p.refused != nil {
		p.refused()
	}
}

func (p *pin) Reset(kvs []*mvccpb.KeyValue, _ int64) {
	if len(kvs) == 0 {
		p.set("")
		return
	}
	p.set(string(kvs[0].Value))
}

func (p *pin) Apply(evs []*clientv3.Event) {
	for _, ev := range evs {
		if ev.Type == clientv3.EventTypeDelete {
			p.set("")
		} else {
			p.set(string(ev.Kv.Value))
		}
	}
}

func (p *pin) get() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.val
}

// maxTopicPins bounds how many topic pins the leader follows.
const maxTopicPins = 10000

// topicPins follows control/pin/topic/: logical topic → cluster. A value
// that names no cluster of the configuration is refused per key: the pin
// in force for that topic stays.
type topicPins struct {
	prefix  string
	mu      sync.Mutex
	vals    map[string]string
	changed chan struct{}
	valid   func(string) bool
	log     *zap.Logger
	refused func()
}

func (p *topicPins) Reset(kvs []*mvccpb.KeyValue, _ int64) {
	p.mu.Lock()
	old := p.vals
	p.vals = map[string]string{}
	for _, kv := range kvs {
		p.put(old, string(kv.Key), string(kv.Value))
	}
	p.mu.Unlock()
	p.notify()
}

func (p *topicPins) Apply(evs []*clientv3.Event) {
	p.mu.Lock()
	for _, ev := range evs {
		topic := strings.TrimPrefix(string(ev.Kv.Key), p.prefix)
		if ev.Type == clientv3.EventTypeDelete {
			delete(p.vals, topic)
			continue
		}
		p.put(p.vals, string(ev.Kv.Key), string(ev.Kv.Value))
	}
	p.mu.Unlock()
	p.notify()
}

// put sets the pin of key's topic to v in p.vals, or refuses v and keeps
// the topic's pin in prev.
func (p *topicPins) put(prev map[string]string, key, v string) {
	topic := strings.TrimPrefix(key, p.prefix)
	c := strings.TrimSpace(v)
	why := ""
	switch {
	case topic == "" || strings.Contains(topic, "/"):
		why = "the key names no topic: control/pin/topic/<logical topic>"
	case len(v) > maxPinSize:
		why = fmt.Sprintf("%d bytes, over the %d-byte limit", len(v), maxPinSize)
	case c == "" || !p.valid(c):
		why = "not a primary or standby cluster of this configuration"
	case len(p.vals) >= maxTopicPins:
		why = fmt.Sprintf("over the limit of %d topic pins", maxTopicPins)
	}
	if why == "" {
		p.vals[topic] = c
		return
	}
	if was, ok := prev[topic]; ok {
		p.vals[topic] = was
	}
	p.log.Warn("refusing a topic pin; the pin in force for the topic stays", zap.String("key", key), zap.String("reason", why),
		zap.String("value", refused.Truncate([]byte(v), 200)), zap.String("in_force", cmp.Or(prev[topic], "none (the fleet's cluster)")))
	if p.refused != nil {
		p.refused()
	}
}

func (p *topicPins) notify() {
	select {
	case p.changed <- struct{}{}:
	default:
	}
}

// get returns the pins in force, nil when there are none.
func (p *topicPins) get() map[string]string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.vals) == 0 {
		return nil
	}
	return maps.Clone(p.vals)
}

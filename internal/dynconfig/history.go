package dynconfig

import (
	"context"
	"encoding/json"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/etcdwatch"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// DefaultAckTimeout bounds how long an accepted version waits for the
// agents' acknowledgements before its history event is written.
const DefaultAckTimeout = 60 * time.Second

// Event is the history/config/<version> record of an accepted version:
// what changed and how long the fleet took to apply it.
type Event struct {
	Kind     string    `json:"kind"` // "config"
	Version  int64     `json:"version"`
	Revision int64     `json:"revision"`
	Changed  []string  `json:"changed"`
	Leader   string    `json:"leader"`
	Accepted time.Time `json:"accepted"`
	// ApplyMs is the time from acceptance until the last live agent
	// acknowledged the version (or the ack timeout, with Missing set).
	ApplyMs int64 `json:"apply_ms"`
	// AgentsMs is each agent's time from acceptance to its
	// acknowledgement, as seen by the leader.
	AgentsMs map[string]int64 `json:"agents_ms"`
	// Missing are the live agents that did not acknowledge in time.
	Missing []string `json:"missing,omitempty"`
}

// AckValue is the value of config-acks/<agent>: the version applied.
func AckValue(n int64) string { return strconv.FormatInt(n, 10) }

// ackSeen follows config-acks/: agent id → version, and when the leader
// first saw each version of each agent.
type ackSeen struct {
	k       keys.Fleet
	mu      sync.Mutex
	version map[string]int64
	seen    map[string]time.Time // when version[id] was first seen
	changed chan struct{}
}

func (a *ackSeen) Reset(kvs []*mvccpb.KeyValue, _ int64) {
	a.mu.Lock()
	now := map[string]bool{}
	for _, kv := range kvs {
		now[a.put(kv)] = true
	}
	for id := range a.version {
		if !now[id] {
			delete(a.version, id)
			delete(a.seen, id)
		}
	}
	a.mu.Unlock()
	a.notify()
}

func (a *ackSeen) Apply(evs []*clientv3.Event) {
	a.mu.Lock()
	for _, ev := range evs {
		if ev.Type == clientv3.EventTypeDelete {
			id := strings.TrimPrefix(string(ev.Kv.Key), a.k.ConfigAcks())
			delete(a.version, id)
			delete(a.seen, id)
			continue
		}
		a.put(ev.Kv)
	}
	a.mu.Unlock()
	a.notify()
}

// put records one acknowledgement; a value that does not parse counts as
// no acknowledgement. It returns the agent id.
func (a *ackSeen) put(kv *mvccpb.KeyValue) string {
	id := strings.TrimPrefix(string(kv.Key), a.k.ConfigAcks())
	n, err := strconv.ParseInt(strings.TrimSpace(string(kv.Value)), 10, 64)
	if err != nil || len(kv.Value) > 32 {
		n = -1
	}
	if old, ok := a.version[id]; !ok || old != n {
		a.version[id] = n
		a.seen[id] = time.Now()
	}
	return id
}

func (a *ackSeen) notify() {
	select {
	case a.changed <- struct{}{}:
	default:
	}
}

// acked returns, for each agent of ids, when it was first seen at version
// n or later, and the agents not there yet.
func (a *ackSeen) acked(ids []string, n int64) (map[string]time.Time, []string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	at := map[string]time.Time{}
	var missing []string
	for _, id := range ids {
		if a.version[id] >= n {
			at[id] = a.seen[id]
		} else {
			missing = append(missing, id)
		}
	}
	return at, missing
}

// record writes the history event of each accepted version once the live
// agents have acknowledged it, or the ack timeout has passed. Versions are
// recorded in order; a version superseded while it waits is recorded with
// the acknowledgements it got (its successor's count for it, since an
// agent acknowledges only the newest version it applied).
func (g *Gate) record(ctx context.Context, k keys.Fleet, term election.Term, accepted <-chan state.ConfigVersion) {
	seen := &ackSeen{k: k, version: map[string]int64{}, seen: map[string]time.Time{}, changed: make(chan struct{}, 1)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = etcdwatch.Follow(ctx, g.Etcd, etcdwatch.Target{Key: k.ConfigAcks(), Prefix: true, Timeout: g.File.Etcd.RequestTimeout}, seen)
	}()
	defer func() { <-done }()
	timeout := g.AckTimeout
	if timeout <= 0 {
		timeout = DefaultAckTimeout
	}
	tick := time.NewTicker(200 * time.Millisecond) // Live() changes are not signalled
	defer tick.Stop()
	for {
		var v state.ConfigVersion
		select {
		case <-ctx.Done():
			return
		case v = <-accepted:
		}
		deadline := time.NewTimer(timeout)
		var at map[string]time.Time
		var missing []string
		for {
			ids := []string{term.ID}
			if g.Live != nil {
				ids = g.Live()
			}
			at, missing = seen.acked(ids, v.Number)
			if len(missing) == 0 {
				break
			}
			select {
			case <-ctx.Done():
				deadline.Stop()
				return
			case <-seen.changed:
				continue
			case <-tick.C:
				continue
			case <-deadline.C:
			}
			break
		}
		deadline.Stop()
		ev := Event{Kind: "config", Version: v.Number, Revision: v.Revision, Changed: v.Changed, Leader: v.Leader,
			Accepted: v.At, AgentsMs: map[string]int64{}, Missing: missing}
		last := v.At
		for _, id := range slices.Sorted(maps.Keys(at)) {
			t := at[id]
			if t.Before(v.At) {
				t = v.At // acknowledged by a version applied before this leader saw it
			}
			ev.AgentsMs[id] = t.Sub(v.At).Milliseconds()
			if t.After(last) {
				last = t
			}
		}
		if len(missing) > 0 {
			last = time.Now()
		}
		ev.ApplyMs = last.Sub(v.At).Milliseconds()
		val, _ := json.Marshal(ev)
		if err := g.write(ctx, term, nil, clientv3.OpPut(k.ConfigEvent(v.Number), string(val))); err != nil {
			if ctx.Err() == nil {
				g.Log.Warn("cannot write the configuration history event", zap.Int64("version", v.Number), zap.Error(err))
			}
			continue
		}
		log := g.Log.Info
		if len(missing) > 0 {
			log = g.Log.Warn
		}
		log("configuration version applied across the fleet", zap.Int64("version", v.Number),
			zap.Int64("apply_ms", ev.ApplyMs), zap.Strings("missing", missing))
	}
}

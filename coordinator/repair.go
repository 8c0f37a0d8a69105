package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/state"
)

// The leader owns state/assignment and state/active: only its term's
// writes belong there. Anyone with write access to the fleet's prefix can
// still delete them or write something else (etcdctl by mistake, a
// stranger). The leader follows both keys, and when one changes under it
// (a revision it did not write, or the key gone) it writes its own view
// again at once, fenced by its term and the revision it found, with a
// generation above every one seen, so that agents (which take only a
// newer generation) follow it and their commits (fenced by the
// assignment's revision) are accepted again. Each repair is logged with
// what was found and counted in kswitch_state_repairs_total{key}.

// keyWatch follows one key: its mod revision and whether it exists.
type keyWatch struct {
	mu      sync.Mutex
	synced  bool  // read once
	present bool  // the key exists
	rev     int64 // its mod revision; absent: the revision of the read or deletion
	changed chan struct{}
}

func newKeyWatch() *keyWatch { return &keyWatch{changed: make(chan struct{}, 1)} }

// Reset implements etcdwatch.Follower.
func (w *keyWatch) Reset(kvs []*mvccpb.KeyValue, rev int64) {
	w.mu.Lock()
	w.synced, w.present, w.rev = true, len(kvs) > 0, rev
	if w.present {
		w.rev = kvs[0].ModRevision
	}
	w.mu.Unlock()
	w.notify()
}

// Apply implements etcdwatch.Follower.
func (w *keyWatch) Apply(evs []*clientv3.Event) {
	w.mu.Lock()
	for _, ev := range evs {
		w.present, w.rev = ev.Type == clientv3.EventTypePut, ev.Kv.ModRevision
	}
	w.mu.Unlock()
	w.notify()
}

func (w *keyWatch) notify() {
	select {
	case w.changed <- struct{}{}:
	default:
	}
}

// foreign reports whether the key was changed by someone else than the
// writer whose last write has revision own (0: none): since then it was
// written, or deleted.
func (w *keyWatch) foreign(own int64) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.synced && w.rev > own && (w.present || own > 0)
}

// repairState writes the leader's view of state/assignment and
// state/active again when someone else changed them. It is called from
// the leader's loop, between switches.
func (l *Leader) repairState(ctx context.Context, t *term, ak *acks, asg, act *keyWatch, log *zap.Logger) error {
	if asg.foreign(t.currentRev) {
		found, rev, err := l.readAssignment(ctx, ak)
		if err != nil {
			return err
		}
		next := t.current
		next.Generation = max(t.current.Generation, found.Generation, maxAck(ak)) + 1
		log.Warn("state/assignment was changed by someone else than the leader; writing the leader's again",
			zap.Int64("found_revision", rev), zap.Int64("found_generation", found.Generation), zap.Int64("own_revision", t.currentRev),
			zap.Int64("generation", next.Generation))
		t.currentRev = rev
		if err := l.publishTerm(ctx, t, next); err != nil {
			return fmt.Errorf("coordinator: repair state/assignment: %w", err)
		}
		l.metrics.repaired("assignment")
	}
	if t.activeUnwritten || act.foreign(t.activeRev) {
		t.activeUnwritten = false
		rctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
		resp, err := l.etcd.Get(rctx, l.keys.Active())
		cancel()
		if err != nil {
			return err
		}
		var rev int64
		found := "(deleted)"
		if len(resp.Kvs) > 0 {
			rev, found = resp.Kvs[0].ModRevision, string(resp.Kvs[0].Value)
		}
		log.Warn("state/active was changed by someone else than the leader; writing the leader's again",
			zap.String("found", found), zap.Int64("found_revision", rev), zap.String("active", t.active.Cluster), zap.Int64("epoch", t.active.Epoch))
		t.activeRev = rev
		if err := l.writeActive(ctx, t, t.active); err != nil {
			return fmt.Errorf("coordinator: repair state/active: %w", err)
		}
		l.metrics.repaired("active")
	}
	return nil
}

// maxAck is the highest generation an agent acknowledged.
func maxAck(ak *acks) int64 {
	var g int64
	for _, v := range ak.snapshot() {
		g = max(g, v)
	}
	return g
}

// stalled follows the discovered partitions that no agent consumes or
// releases: the leader's fleet-level verdict of what is not moving.
type stalled struct {
	since   map[state.ClusterPartition]time.Time
	metrics *Metrics
}

// note updates the partitions without a consumer in a (over the
// discovered ones, by cluster: not owned or released by anyone, or by an
// agent in cannot[cluster], which cannot reach that cluster) and returns
// them with how long, sorted. Partitions of a's own cluster are named
// without it.
func (s *stalled) note(now time.Time, discovered map[string][]state.TopicPartition, a state.Assignment, cannot map[string]map[string]bool) []string {
	held := map[state.ClusterPartition]bool{}
	for _, c := range a.Sections() {
		sec := a.Section(c)
		for _, m := range []map[string][]state.TopicPartition{sec.Owned, sec.Revoking} {
			for id, tps := range m {
				if cannot[c][id] {
					continue
				}
				for _, tp := range tps {
					held[state.ClusterPartition{Cluster: c, TopicPartition: tp}] = true
				}
			}
		}
	}
	var out []string
	seen := map[state.ClusterPartition]bool{}
	for _, c := range slices.Sorted(maps.Keys(discovered)) {
		for _, tp := range discovered[c] {
			cp := state.ClusterPartition{Cluster: c, TopicPartition: tp}
			if held[cp] {
				continue
			}
			seen[cp] = true
			if _, ok := s.since[cp]; !ok {
				s.since[cp] = now
			}
			out = append(out, fmt.Sprintf("%s for %s", cp.On(a.Cluster), now.Sub(s.since[cp]).Round(time.Second)))
		}
	}
	for cp := range s.since {
		if !seen[cp] {
			delete(s.since, cp)
		}
	}
	s.metrics.unassigned(len(out))
	return out
}

// over returns the partitions without a consumer for longer than
// StalledAfter at now, sorted; those of fleet's cluster without a cluster.
func (s *stalled) over(now time.Time, fleet string) []state.StalledPartition {
	var out []state.StalledPartition
	for _, cp := range slices.SortedFunc(maps.Keys(s.since), state.ClusterPartition.Compare) {
		if since := s.since[cp]; now.Sub(since) > state.StalledAfter {
			c := cp.Cluster
			if c == fleet {
				c = ""
			}
			out = append(out, state.StalledPartition{TopicPartition: cp.TopicPartition, Cluster: c, Since: since.UTC()})
		}
	}
	return out
}

// publishStalled writes state/stalled when the set of partitions without a
// consumer for longer than StalledAfter changed since the term last wrote
// it (deleting it when empty). A failed write is tried again next turn.
func (l *Leader) publishStalled(ctx context.Context, t *term, s *stalled, silent map[string]string, now time.Time, log *zap.Logger) {
	over := s.over(now, t.active.Cluster)
	names := make([]string, len(over))
	for i, p := range over {
		names[i] = p.Name()
	}
	quiet := slices.Sorted(maps.Keys(silent))
	set := strings.Join(names, ",") + ";" + strings.Join(quiet, ",")
	if t.stalled != nil && *t.stalled == set {
		return
	}
	op := clientv3.OpDelete(l.keys.Stalled())
	if len(over) > 0 || len(silent) > 0 {
		val, err := json.Marshal(state.Stalled{Leader: t.ID, Noted: now.UTC(), Partitions: over, Silent: silent})
		if err != nil {
			return
		}
		op = clientv3.OpPut(l.keys.Stalled(), string(val))
		if len(over) > 0 {
			log.Warn("partitions have no consumer", zap.Strings("partitions", names), zap.Duration("over", state.StalledAfter))
		}
	}
	wctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
	defer cancel()
	if _, err := t.Txn(wctx, nil, op); err != nil {
		log.Debug("cannot record state/stalled", zap.Error(err))
		return
	}
	t.stalled = &set
}

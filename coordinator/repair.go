package coordinator

import (
	"context"
	"fmt"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
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
		l.Metrics.repaired("assignment")
	}
	if t.active.unwritten || act.foreign(t.activeRev) {
		t.active.unwritten = false
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
		l.Metrics.repaired("active")
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
	since   map[TopicPartition]time.Time
	metrics *Metrics
}

// note updates the partitions without a consumer in a (over the
// discovered ones) and returns them with how long, sorted.
func (s *stalled) note(now time.Time, discovered []TopicPartition, a Assignment) []string {
	held := map[TopicPartition]bool{}
	for _, m := range []map[string][]TopicPartition{a.Owned, a.Revoking} {
		for _, tps := range m {
			for _, tp := range tps {
				held[tp] = true
			}
		}
	}
	var out []string
	seen := map[TopicPartition]bool{}
	for _, tp := range discovered {
		if held[tp] {
			continue
		}
		seen[tp] = true
		if _, ok := s.since[tp]; !ok {
			s.since[tp] = now
		}
		out = append(out, fmt.Sprintf("%s for %s", tp, now.Sub(s.since[tp]).Round(time.Second)))
	}
	for tp := range s.since {
		if !seen[tp] {
			delete(s.since, tp)
		}
	}
	s.metrics.unassigned(len(out))
	return out
}

package agent

import (
	"context"
	"errors"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/state"
)

// applyNewest applies the newest value of state/assignment among evs that
// is not refused. The generations published while this worker applied the
// last one are superseded by the newest: a revoke stands in every later
// generation until this agent acknowledges one, so nothing is skipped
// that must be released, and one start of partitions waits for a fetch
// (about 500 ms on an idle partition), which made a join to a fleet of 30
// take one of those waits for each of the 20 generations the leader
// published while its releases came in.
func (w *worker) applyNewest(ctx context.Context, evs []*clientv3.Event) {
	if n := len(evs); n > 0 && evs[n-1].Type == clientv3.EventTypeDelete {
		w.log.Warn("state/assignment was deleted; waiting for the leader to publish one")
	}
	for i := len(evs) - 1; i >= 0; i-- {
		if ev := evs[i]; ev.Type != clientv3.EventTypeDelete && w.applyValue(ctx, ev.Kv.Value, ev.Kv.ModRevision, true) {
			return
		}
	}
}

// applyValue applies a state/assignment value at revision rev. A value
// that changed while this worker watched (changed) must come from the
// current leader's term: one that carries an older term's fencing token
// was not written by the leader (an old value put back by hand) and is
// ignored; one that carries a later token than the leader this agent has
// seen elected is applied if etcd holds that term's leader key (termHeld:
// this agent's view of the election lags), else it waits (pending) until
// the agent sees that leader, and is dropped if it never does (no term
// holds it: written by someone else). The leader repairs such values
// within a loop turn. Values of one term
// are ordered by generation; a value of the leader's term supersedes one
// of another term whatever their generations (a term may start its
// generations again: coordinator's generationsSpent). The value read at
// start is taken whatever its term: a leader does not republish an
// assignment it keeps. It reports whether it applied the value.
func (w *worker) applyValue(ctx context.Context, val []byte, rev int64, changed bool) bool {
	a, err := state.ParseAssignment(val)
	if err != nil {
		w.log.Warn("refusing malformed state/assignment; keeping the last good one", zap.Error(err),
			zap.Int64("applied_generation", w.applied.Generation))
		w.metrics.badValues.WithLabelValues("assignment").Inc()
		return false
	}
	if changed {
		tok, ok := w.leaderToken()
		switch {
		case ok && a.Token < tok:
			w.log.Warn("ignoring a state/assignment from an older leader term; the leader will repair it",
				zap.Int64("token", a.Token), zap.Int64("leader_token", tok), zap.Int64("generation", a.Generation))
			w.metrics.badValues.WithLabelValues("assignment").Inc()
			return false
		case (!ok || a.Token > tok) && !w.termHeld(ctx, a.Token):
			// Not a term etcd holds (the election's own watch may
			// only lag this one): wait for it.
			if p := w.pendingAsg; p == nil || rev > p.rev {
				w.pendingAsg = &pendingValue{val: val, rev: rev, token: a.Token, since: time.Now()}
			}
			w.log.Debug("state/assignment from a term this agent has not seen elected yet; waiting for it",
				zap.Int64("token", a.Token), zap.Int64("leader_token", tok), zap.Int64("generation", a.Generation))
			return false
		}
	}
	if a.Token == w.applied.Token && a.Generation < w.applied.Generation {
		w.log.Warn("ignoring an older assignment generation", zap.Int64("generation", a.Generation), zap.Int64("applied", w.applied.Generation))
		return false
	}
	if p := w.pendingAsg; p != nil && p.rev <= rev {
		w.pendingAsg = nil
	}
	w.apply(ctx, a, rev)
	return true
}

// termHeld reports whether a leader key of the fleet's election has the
// fencing token token: the value's term exists, and this agent's view of
// the election has not caught up with it yet (the two are separate
// watches). False when it cannot tell.
func (w *worker) termHeld(ctx context.Context, token int64) bool {
	rctx, cancel := context.WithTimeout(ctx, w.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := w.etcd.Get(rctx, w.keys.Election(), clientv3.WithPrefix(), clientv3.WithKeysOnly(),
		clientv3.WithMinCreateRev(token), clientv3.WithMaxCreateRev(token))
	return err == nil && len(resp.Kvs) > 0
}

// pendingValue is a state/assignment value of a term the agent has not
// seen elected when it arrived.
type pendingValue struct {
	val   []byte
	rev   int64
	token int64
	since time.Time
}

// applyPending applies the pending value once the agent sees its term's
// leader elected, drops it when a later term leads or it waited longer
// than a session TTL (no leader holds that term: someone else wrote it).
func (w *worker) applyPending(ctx context.Context, now time.Time) {
	p := w.pendingAsg
	if p == nil {
		return
	}
	tok, ok := w.leaderToken()
	switch {
	case ok && p.token == tok:
		w.pendingAsg = nil
		w.applyValue(ctx, p.val, p.rev, true)
	case ok && p.token < tok, now.Sub(p.since) > w.cfg.Etcd.SessionTTL:
		w.pendingAsg = nil
		w.log.Warn("ignoring a state/assignment of a term no leader holds; the leader will repair it",
			zap.Int64("token", p.token), zap.Int64("leader_token", tok))
		w.metrics.badValues.WithLabelValues("assignment").Inc()
	}
}

// apply makes the running partitions match a: revoked partitions are
// stopped, drained and committed under a (which allows it), new ones are
// started at their committed offsets, then the generation is
// acknowledged.
func (w *worker) apply(ctx context.Context, a state.Assignment, rev int64) {
	log := w.log.With(zap.Int64("generation", a.Generation), zap.String("cluster", a.Cluster))
	want := map[cpart]bool{}
	for c, tps := range a.OwnedBy(w.id) {
		for _, tp := range tps {
			want[cpart{Cluster: c, TopicPartition: tp}] = true
		}
	}
	w.sharePacer(a, len(want))
	var release []cpart
	for cp := range w.parts {
		if !want[cp] {
			release = append(release, cp)
		}
	}
	slices.SortFunc(release, cpart.Compare)
	// The final commits of released partitions are fenced by the new
	// generation, in which they are ours to release.
	w.applied, w.appliedRev = a, rev
	if len(release) > 0 {
		w.release(ctx, release, a)
		log.Info("released partitions", zap.Stringers("partitions", release))
	}
	uses := map[string]bool{}
	for cp := range want {
		uses[cp.Cluster] = true
	}
	for name, k := range w.conns {
		if uses[name] {
			continue
		}
		// Closing the client may wait for a broker's answer: not on the
		// way to the acknowledgement the switch waits for.
		delete(w.conns, name)
		w.bg.Add(1)
		go func() {
			defer w.bg.Done()
			k.close()
		}()
	}
	deferAck := w.followWarm(ctx, a)
	w.pending = w.pending[:0]
	for cp := range want {
		if w.parts[cp] == nil {
			w.pending = append(w.pending, cp)
		}
	}
	slices.SortFunc(w.pending, cpart.Compare)
	started := slices.Clone(w.pending)
	w.startPending(ctx)
	if len(started) > 0 {
		log.Info("assigned partitions", zap.Stringers("partitions", started), zap.Int("owned", len(w.parts)))
	}
	w.publishOwned()
	cluster := a.Cluster
	w.active.Store(&cluster)
	w.metrics.generation.Set(float64(a.Generation))
	if deferAck {
		// The leader waits for this acknowledgement to know the agent
		// is warm; it is sent when the warm-up ends (warmDone).
		w.warmAck = a.Generation
	} else {
		w.ack(ctx, a.Generation)
	}
}

// followWarm makes the warm connection follow a: a connection to a's
// cluster becomes the one consumed from; one to a cluster that a neither
// consumes nor warms is closed; a warm-up of a.Warm starts if none is
// open or in flight. It reports whether a's acknowledgement waits for
// that warm-up.
func (w *worker) followWarm(ctx context.Context, a state.Assignment) bool {
	if w.warm != nil && w.conns[w.warm.name] == nil && w.wants(a, w.warm.name) {
		w.conns[w.warm.name] = w.warm
		w.log.Info("consuming through the connection warmed ahead of the switch", zap.String("cluster", w.warm.name))
		w.warm = nil
	}
	if w.warm != nil && w.warm.name != a.Warm {
		w.dropWarm()
	}
	if a.Warm == "" || a.Warm == a.Cluster || w.warm != nil || w.conns[a.Warm] != nil {
		return false
	}
	w.dial(a.Warm)
	return w.warming == a.Warm
}

// dial connects to cluster in the background, unless a dial is in flight
// (one at a time: the next is asked for again once it ends); its outcome
// reaches the loop as a warmResult (warmDone). A connection is made in the
// background whether the assignment warms the cluster ahead of a switch
// or consumes it: a cluster that hung after this agent's probe last
// reached it answers no metadata, and sarama's client retries it for
// 20 s and more, which would hold the loop while the next assignment (a
// switch away, as a rule) waits.
func (w *worker) dial(cluster string) {
	if w.warming != "" {
		return
	}
	c, ok := w.clusters[cluster]
	if !ok {
		w.log.Error("assignment names a cluster this agent has no configuration for", zap.String("cluster", cluster))
		return
	}
	w.warming = cluster
	d := w.dialerFor(cluster)
	w.bg.Go(func() {
		k, err := dialKafka(cluster, c, w.cfg.Source.Group, w.cfg.Etcd.RequestTimeout, d, w.fetchConfig(cluster))
		if err == nil {
			k.openBrokers()
		}
		w.warmed <- warmResult{cluster: cluster, conn: k, err: err}
	})
}

// warmDone takes the outcome of a dial: the connection is kept if the
// applied assignment consumes its cluster (its partitions start now) or
// still warms it, and the generation waiting for a warm-up is
// acknowledged, warm or not (warming is an optimization: the leader must
// not wait for a cluster this agent cannot reach yet). Partitions of
// another cluster that waited for this dial to end start now too; after a
// failed dial they are tried again on the next commit tick.
func (w *worker) warmDone(ctx context.Context, res warmResult) {
	w.warming = ""
	switch {
	case res.err != nil && w.wants(w.applied, res.cluster):
		w.log.Warn("cannot connect to the assigned cluster; retrying", zap.String("cluster", res.cluster), zap.Error(res.err))
	case res.err != nil:
		w.log.Info("cannot warm a connection ahead of the switch; connecting when assigned", zap.String("cluster", res.cluster), zap.Error(res.err))
	case w.conns[res.cluster] == nil && w.wants(w.applied, res.cluster):
		w.conns[res.cluster] = res.conn
	case w.applied.Warm == res.cluster && w.warm == nil && w.conns[res.cluster] == nil:
		w.warm = res.conn
		w.log.Info("warmed a connection ahead of the switch", zap.String("cluster", res.cluster))
	default:
		res.conn.close()
	}
	if res.err == nil {
		w.startPending(ctx)
	}
	if w.warmAck > 0 && w.warmAck == w.applied.Generation {
		w.ack(ctx, w.warmAck)
	}
	w.warmAck = 0
}

// wants reports whether a gives this agent partitions of cluster.
func (w *worker) wants(a state.Assignment, cluster string) bool {
	return len(a.Section(cluster).Owned[w.id]) > 0
}

// dropWarm closes the warm connection, if any.
func (w *worker) dropWarm() {
	if w.warm != nil {
		w.warm.close()
		w.warm = nil
	}
}

// readAssignment reads state/assignment and its revision.
func (w *worker) readAssignment(ctx context.Context) (state.Assignment, int64, error) {
	rctx, cancel := context.WithTimeout(ctx, w.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := w.etcd.Get(rctx, w.keys.Assignment())
	if err != nil {
		return state.Assignment{}, 0, err
	}
	if len(resp.Kvs) == 0 {
		return state.Assignment{}, 0, errors.New("state/assignment is absent")
	}
	a, err := state.ParseAssignment(resp.Kvs[0].Value)
	return a, resp.Kvs[0].ModRevision, err
}

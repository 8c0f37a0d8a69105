package agent

import (
	"context"
	"errors"
	"maps"
	"slices"
	"sync"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/state"
)

// release stops tps, waits for their records to be acknowledged, commits
// their final positions and tells the handler (Options.Released). The
// partitions stop concurrently: each waits for its own records'
// acknowledgements.
func (w *worker) release(ctx context.Context, tps []cpart, a state.Assignment) {
	var wg sync.WaitGroup
	for _, tp := range tps {
		r := w.parts[tp]
		wg.Add(1)
		go func() {
			defer wg.Done()
			if !r.stop(w.drain) {
				w.log.Warn("handler did not acknowledge every record before the drain timeout; the next owner consumes them again",
					zap.Stringer("partition", tp), zap.Int("unacked", r.t.unacked()), zap.Duration("drain", w.drain))
			}
		}()
	}
	wg.Wait()
	var allowed []cpart
	for _, cp := range tps {
		if a.MayCommit(w.id, cp.Cluster, cp.TopicPartition) {
			allowed = append(allowed, cp)
		}
	}
	err := w.commit(ctx, allowed)
	// The leader may publish the next generation while these partitions
	// drain (it plans whenever anything else changes: another agent's
	// release acknowledged, an agent joining or cut off), keeping this
	// agent's releases, which it has not acknowledged yet. The commit
	// fenced by a is then refused as stale, and the partitions are gone
	// from w.parts once this returns: their final positions must be
	// committed now, under the generation that is current, or their next
	// owners consume again what was handled since the last periodic
	// commit. The watch delivers that generation only after this apply,
	// so it is read here (and applied as usual afterwards).
	for attempt := 0; errors.Is(err, offsets.ErrStaleGeneration) && attempt < maxReleaseRetries; attempt++ {
		cur, rev, rerr := w.readAssignment(ctx)
		if rerr != nil {
			w.log.Warn("cannot read state/assignment to commit released partitions; the next owners consume again what was not committed",
				zap.Stringers("partitions", allowed), zap.Error(rerr))
			break
		}
		still := slices.DeleteFunc(slices.Clone(allowed), func(cp cpart) bool { return !cur.MayCommit(w.id, cp.Cluster, cp.TopicPartition) })
		if cur.Generation < a.Generation || len(still) == 0 {
			w.log.Warn("released partitions could not be committed under the current generation; the next owners consume again what was not committed",
				zap.Stringers("partitions", allowed), zap.Int64("generation", a.Generation), zap.Int64("current_generation", cur.Generation))
			break
		}
		w.log.Info("committing released partitions under the generation published while they drained",
			zap.Stringers("partitions", still), zap.Int64("generation", a.Generation), zap.Int64("current_generation", cur.Generation))
		err = w.commitUnder(ctx, still, cur, rev)
	}
	// The handler lets go of what it still holds of them before the
	// revoke is acknowledged; after the commit, whose time its wait must
	// not take.
	runs := make([]*partitionRun, 0, len(tps))
	for _, tp := range tps {
		runs = append(runs, w.parts[tp])
	}
	w.tellReleased(runs)
	for _, tp := range tps {
		delete(w.parts, tp)
		delete(w.committed, tp)
	}
	w.publishOwned()
}

// maxReleaseRetries bounds how often release commits again under a newer
// generation when the generations keep changing under it.
const maxReleaseRetries = 5

// startPending starts the owned partitions not yet running, cluster by
// cluster. A partition that cannot start (its cluster unreachable) stays
// pending and is retried on the next commit tick.
func (w *worker) startPending(ctx context.Context) {
	if len(w.pending) == 0 {
		return
	}
	byCluster := map[string][]state.TopicPartition{}
	for _, cp := range w.pending {
		byCluster[cp.Cluster] = append(byCluster[cp.Cluster], cp.TopicPartition)
	}
	var still []cpart
	for _, c := range slices.Sorted(maps.Keys(byCluster)) {
		for _, tp := range w.startOn(ctx, c, byCluster[c]) {
			still = append(still, cpart{Cluster: c, TopicPartition: tp})
		}
	}
	slices.SortFunc(still, cpart.Compare)
	w.pending = still
	w.publishOwned()
}

// startOn starts partitions tps of cluster, and returns those that could
// not start.
func (w *worker) startOn(ctx context.Context, cluster string, tps []state.TopicPartition) (still []state.TopicPartition) {
	k := w.connFor(cluster, tps)
	if k == nil {
		return tps
	}
	positions, fromGroup, ok := w.startPositions(ctx, k, cluster, tps)
	if !ok {
		return tps
	}
	// Partitions start concurrently: each may need a ListOffsets round
	// trip (a start out of range), which one by one would add up.
	type started struct {
		tp  state.TopicPartition
		r   *partitionRun
		err error
	}
	results := make(chan started, len(tps))
	// Signals hold across rebalances and switches: a partition starts
	// paused when a signal in force pauses it.
	sigs := w.signals.State()
	// The topics' ids tell a position of a topic deleted and created
	// again since (lifecycle.go).
	ids := k.topicIDs(w.log, tps)
	var startAt []offsets.Commit
	for _, tp := range tps {
		p, ok := positions[tp]
		if ok {
			w.committed[cpart{Cluster: cluster, TopicPartition: tp}] = p.Offset
			startAt = append(startAt, p.Commit)
		}
		paused, _ := sigs.Paused(w.naming.Logical(cluster, tp.Topic), w.id)
		from := startFrom{tp: tp, pos: p, hasPos: ok, topicID: ids[tp.Topic], paused: paused}
		from.group, from.hasGroup = fromGroup[tp]
		from.dead, from.restarting = w.life.dead[cpart{Cluster: cluster, TopicPartition: tp}]
		go func() {
			r, err := w.startOne(ctx, k, cluster, from)
			results <- started{tp, r, err}
		}()
	}
	for range tps {
		s := <-results
		if s.err != nil {
			w.log.Warn("cannot consume partition; retrying", zap.String("cluster", cluster), zap.Stringer("partition", s.tp), zap.Error(s.err))
			still = append(still, s.tp)
			continue
		}
		w.parts[cpart{Cluster: cluster, TopicPartition: s.tp}] = s.r
	}
	// The group on this cluster shows where the fleet starts (after a
	// switch: the translated positions), before anything is consumed.
	if len(startAt) > 0 {
		w.enqueueMirror(mirrorJob{cluster: {mirror: k.mirror, commits: startAt}}, false)
	}
	return still
}

// connFor returns the connection to cluster, dialled if need be, with
// metadata that knows tps; nil (logged) when partitions of cluster cannot
// start now.
func (w *worker) connFor(cluster string, tps []state.TopicPartition) *kafkaConn {
	// A cluster this agent's probe cannot reach would hold the loop for a
	// client's whole retry budget per attempt, while the next assignment
	// (a switch away from that cluster, often) waits to be applied: the
	// partitions start once the probe reaches it again.
	if w.reachable != nil && !w.reachable(cluster) {
		w.log.Debug("not starting partitions: this agent's probe cannot reach the cluster", zap.String("cluster", cluster),
			zap.Int("partitions", len(tps)))
		return nil
	}
	k := w.conns[cluster]
	if k == nil {
		// Connected in the background (dial): the partitions start
		// when the connection is up (warmDone).
		w.dial(cluster)
		return nil
	}
	// New partitions or topics are not in the client's metadata yet: one
	// refresh up front instead of a failed lookup and a retry per
	// partition. (A client just opened, or warmed ahead of a switch,
	// knows them all.)
	if !k.knows(tps) {
		topics := map[string]bool{}
		for _, tp := range tps {
			topics[tp.Topic] = true
		}
		if err := k.refresh(slices.Sorted(maps.Keys(topics))); err != nil {
			w.log.Warn("cannot refresh metadata of the assigned topics; retrying", zap.String("cluster", cluster), zap.Error(err))
			return nil
		}
	}
	return k
}

// startPositions reads the committed positions of tps in etcd and, for
// those without one, where the Kafka group's consumers left them
// (startoffset.go). ok is false (logged) when either read failed.
func (w *worker) startPositions(ctx context.Context, k *kafkaConn, cluster string, tps []state.TopicPartition) (
	positions map[state.TopicPartition]offsets.Position, fromGroup map[state.TopicPartition]int64, ok bool) {
	lctx, cancel := context.WithTimeout(ctx, w.cfg.Etcd.RequestTimeout)
	positions, bad, err := w.store.LoadMany(lctx, cluster, tps)
	cancel()
	if err != nil {
		w.log.Warn("cannot read committed offsets; retrying", zap.String("cluster", cluster), zap.Error(err))
		return nil, nil, false
	}
	for _, b := range bad {
		// Treated as "no committed offset": the partition starts at the
		// group's offset in Kafka, else the initial offset, and the next
		// commit replaces the bad value.
		w.log.Warn("refusing malformed committed offset; the partition starts at the group's committed offset in Kafka, else the initial offset, and the next commit replaces it", zap.Error(b), zap.String("initial_offset", w.cfg.Source.InitialOffset))
		w.metrics.badValues.WithLabelValues("offset").Inc()
	}
	fromGroup, err = w.groupStarts(ctx, k, cluster, tps, positions)
	if err != nil {
		w.log.Warn("cannot read the group's committed offsets of the partitions without a position; retrying",
			zap.String("cluster", cluster), zap.String("group", w.cfg.Source.Group), zap.Error(err))
		return nil, nil, false
	}
	return positions, fromGroup, true
}

// startFrom is what startOne knows of a partition it starts.
type startFrom struct {
	tp       state.TopicPartition
	pos      offsets.Position // the committed position in etcd, if hasPos
	hasPos   bool
	group    int64 // the Kafka group's committed offset, if hasGroup
	hasGroup bool
	topicID  string
	paused   bool
	// dead is why its consumer ended, if restarting (lifecycle.go).
	dead       deadPart
	restarting bool
}

// startOne starts one partition of cluster at the offset its position says
// (else the group's, else the initial offset; its topic's start when the
// topic was created again since). It runs on a goroutine of its own.
func (w *worker) startOne(ctx context.Context, k *kafkaConn, cluster string, f startFrom) (*partitionRun, error) {
	if f.restarting && w.restartFails != nil {
		if err := w.restartFails(cluster, f.tp); err != nil {
			return nil, err
		}
	}
	start := f.pos.Offset
	if f.hasGroup {
		start = f.group
	} else if !f.hasPos {
		var err error
		if start, err = k.resolve(f.tp, w.initialOffset(cluster, f.tp)); err != nil {
			return nil, err
		}
	}
	if w.life.fromStart(cluster, f.tp, f.pos, f.hasPos, f.topicID) {
		var err error
		if start, err = w.recreatedStart(k, f.tp, f.pos, f.hasPos, f.topicID); err != nil {
			return nil, err
		}
	}
	return w.startPartition(ctx, k, partitionStart{tp: f.tp, gen: w.applied.Generation, token: w.applied.Token,
		offset: start, topicID: f.topicID, paused: f.paused, ended: f.dead.cause})
}

// publishOwned makes the running partitions visible to Agent.Owned and
// the metrics.
func (w *worker) publishOwned() {
	on := map[string][]state.TopicPartition{}
	for cp := range w.parts {
		on[cp.Cluster] = append(on[cp.Cluster], cp.TopicPartition)
	}
	for _, tps := range on {
		slices.SortFunc(tps, state.TopicPartition.Compare)
	}
	w.owned.Store(&on)
	w.metrics.ownedPartitions.Set(float64(len(w.parts)))
}

// stopAll stops every partition; with commit, drains and commits them.
func (w *worker) stopAll(commit bool) {
	tps := slices.Collect(maps.Keys(w.parts))
	if commit {
		// The run ctx has ended; the final commit gets a bounded one of
		// its own.
		ctx, cancel := context.WithTimeout(context.Background(), w.drain+w.cfg.Etcd.RequestTimeout)
		defer cancel()
		w.release(ctx, tps, w.applied)
		return
	}
	runs := make([]*partitionRun, 0, len(tps))
	for _, tp := range tps {
		r := w.parts[tp]
		r.stop(0)
		runs = append(runs, r)
		delete(w.parts, tp)
	}
	w.tellReleased(runs)
	w.publishOwned()
}

// tellReleased tells the handler (Options.Released) that runs were given
// up, concurrently: each call may wait for the handler's producers.
func (w *worker) tellReleased(runs []*partitionRun) {
	if w.released == nil {
		return
	}
	var wg sync.WaitGroup
	for _, r := range runs {
		wg.Go(func() {
			w.released(record.Owned{Cluster: r.cluster, Topic: r.tp.Topic, SourceTopic: r.logical, Origin: r.origin, Partition: r.tp.Partition,
				Generation: r.generation, Session: int64(w.lease), Token: r.token})
		})
	}
	wg.Wait()
}

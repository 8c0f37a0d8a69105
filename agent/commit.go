package agent

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/state"
)

// commit writes the positions of tps that moved since their last commit,
// fenced by the applied generation and the agent's lease, then mirrors
// them to the Kafka group. It returns errLeaseLost when etcd says the
// lease is gone, and an error matching offsets.ErrStaleGeneration when
// state/assignment changed since the applied revision (nothing was
// written; a running partition is committed again at the next tick).
func (w *worker) commit(ctx context.Context, tps []cpart) error {
	return w.commitUnder(ctx, tps, w.applied, w.appliedRev)
}

// commitDue is a tick's commit: the positions that changed since their
// last commit, within the agent's share of the fleet's etcd budget
// (commitPacer), the longest uncommitted first.
func (w *worker) commitDue(ctx context.Context, now time.Time) error {
	var due []dueCommit
	for cp, r := range w.parts {
		next, _ := r.t.progress()
		if last, ok := w.committed[cp]; ok && last == next {
			continue
		}
		due = append(due, dueCommit{part: cp, last: r.committedAt})
	}
	each := 320.0 // bytes of a position with 8 fingerprints, until measured
	if n, bytes := w.store.Written(); n > 0 {
		each = float64(bytes) / float64(n)
	}
	tps, waiting := pick(due, w.pacer.refill(now), each)
	w.metrics.commitsWaiting.Set(float64(waiting))
	if len(tps) == 0 && waiting > 0 {
		// Not a commit that succeeded: a hold (commitHold) in the
		// making stays.
		return nil
	}
	return w.commit(ctx, tps)
}

// sharePacer gives the pacer the agent's share of the fleet's commit
// budget under a: that of the mine partitions it owns among all that a
// assigns.
func (w *worker) sharePacer(a state.Assignment, mine int) {
	total := 0
	for _, c := range a.Sections() {
		for _, tps := range a.Section(c).Owned {
			total += len(tps)
		}
	}
	w.pacer.share(float64(w.cfg.Source.CommitBudgetKiB)*1024, mine, total)
	w.metrics.commitShare.Set(w.pacer.rate)
}

// commitUnder is commit fenced by assignment a at revision rev, which
// must let this agent commit tps (Assignment.MayCommit).
func (w *worker) commitUnder(ctx context.Context, tps []cpart, a state.Assignment, rev int64) error {
	var commits []offsets.Commit
	for _, tp := range tps {
		r := w.parts[tp]
		if r == nil {
			continue
		}
		next, ts, fps := r.t.position()
		if last, ok := w.committed[tp]; ok && last == next {
			continue
		}
		commits = append(commits, offsets.Commit{Cluster: r.cluster, Topic: tp.Topic, Partition: tp.Partition, Offset: next, Timestamp: ts, Fingerprints: fps, TopicID: r.topicID})
	}
	if len(commits) == 0 {
		w.committedAll()
		return nil
	}
	w.hold.attempt(time.Now())
	fence := offsets.Fence{
		AgentKey: w.keys.Agent(w.id), Lease: w.lease,
		AssignmentKey: w.keys.Assignment(), AssignmentRev: rev,
		Agent: w.id, Generation: a.Generation,
	}
	cctx, cancel := context.WithTimeout(ctx, w.cfg.Etcd.RequestTimeout)
	_, before := w.store.Written()
	err := w.store.Commit(cctx, fence, commits)
	cancel()
	// What a fence stopped mid-way was written all the same.
	_, after := w.store.Written()
	w.pacer.charge(after - before)
	w.metrics.commitBytes.Add(float64(after - before))
	switch {
	case errors.Is(err, offsets.ErrLeaseLost):
		w.log.Error("commit refused: this agent's lease is gone; stopping consumption", zap.Error(err))
		w.metrics.commitErrors.WithLabelValues("lease_lost").Inc()
		return errLeaseLost
	case errors.Is(err, offsets.ErrStaleGeneration):
		// A new generation is on its way through the watch; commit
		// under it (release does not wait for it: see there).
		w.log.Debug("commit deferred: newer assignment", zap.Error(err))
		w.metrics.commitErrors.WithLabelValues("stale_generation").Inc()
		return err
	case err != nil:
		w.log.Warn("commit failed; retrying next interval", zap.Error(err))
		w.metrics.commitErrors.WithLabelValues("etcd").Inc()
		return nil
	}
	job := mirrorJob{}
	now := time.Now()
	for _, c := range commits {
		cp := cpart{Cluster: c.Cluster, TopicPartition: c.TopicPartition()}
		w.committed[cp] = c.Offset
		if r := w.parts[cp]; r != nil {
			r.committedAt = now
		}
		if k := w.conns[c.Cluster]; k != nil {
			b := job[c.Cluster]
			b.mirror, b.commits = k.mirror, append(b.commits, c)
			job[c.Cluster] = b
		}
	}
	w.committedAll()
	w.metrics.commits.Add(float64(len(commits)))
	if len(job) > 0 {
		w.enqueueMirror(job, false)
	}
	return nil
}

// committedAll notes that every position is committed, which releases a
// hold of delivery.
func (w *worker) committedAll() {
	if held := w.hold.succeeded(time.Now()); held > 0 {
		w.log.Info("commits succeed again: delivery resumes", zap.Duration("held", held))
		w.metrics.deliveryHeld.Set(0)
	}
}

// watchCommits holds delivery once commits have gone without success for
// longer than the hold's bound (commitHold), until ctx ends.
func (w *worker) watchCommits(ctx context.Context) {
	t := time.NewTicker(min(max(w.hold.bound/4, 10*time.Millisecond), 50*time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			if held, since := w.hold.check(now); held {
				w.log.Warn("commits to etcd have not succeeded: holding delivery until one does, so that no more records are delivered again after a crash",
					zap.Duration("failing_for", now.Sub(since)), zap.Duration("bound", w.hold.bound))
				w.metrics.deliveryHeld.Set(1)
			}
		}
	}
}

package agent

import (
	"context"
	"errors"
	"maps"
	"slices"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/state"
)

// enqueueMirror queues job for mirrorLoop, merged with the job already
// queued, if any. It never blocks: the queue holds one job, and both the
// worker and the mirror goroutine call it. A fresh job is newer than the
// queued one; a failed job put back (retry) is older. Per cluster, the
// newer side's positions win per partition; an older batch through
// another connection to the cluster (reconnected since) is dropped, never
// sent through a closed client.
func (w *worker) enqueueMirror(job mirrorJob, retry bool) {
	for {
		select {
		case w.mirrorq <- job:
			return
		default:
		}
		select {
		case queued := <-w.mirrorq:
			older, newer := queued, job
			if retry {
				older, newer = job, queued
			}
			job = mergeJobs(older, newer)
		default:
		}
	}
}

// mirrorJob is the positions to mirror, by cluster.
type mirrorJob map[string]mirrorBatch

// mirrorBatch is one batch of positions to mirror to a cluster's group.
type mirrorBatch struct {
	mirror  *offsets.KafkaMirror
	commits []offsets.Commit
}

// mergeJobs merges two jobs, newer's positions winning.
func mergeJobs(older, newer mirrorJob) mirrorJob {
	out := mirrorJob{}
	for c, b := range older {
		out[c] = b
	}
	for c, b := range newer {
		o, ok := out[c]
		if !ok || o.mirror != b.mirror {
			out[c] = b
			continue
		}
		out[c] = mirrorBatch{mirror: b.mirror, commits: mergeCommits(o.commits, b.commits)}
	}
	return out
}

// mergeCommits keeps, per partition, the newest position.
func mergeCommits(old, newer []offsets.Commit) []offsets.Commit {
	byTP := map[state.TopicPartition]offsets.Commit{}
	for _, c := range old {
		byTP[c.TopicPartition()] = c
	}
	for _, c := range newer {
		byTP[c.TopicPartition()] = c
	}
	return slices.Collect(maps.Values(byTP))
}

// mirrorLoop mirrors committed positions to the Kafka groups until ctx
// ends. Best effort: etcd holds the positions.
func (w *worker) mirrorLoop(ctx context.Context) {
	backoff := time.Second
	for {
		select {
		case <-ctx.Done():
			return
		case job := <-w.mirrorq:
			failed := mirrorJob{}
			var errs []error
			for c, b := range job {
				mctx, cancel := context.WithTimeout(ctx, w.cfg.Etcd.RequestTimeout)
				err := b.mirror.Commit(mctx, b.commits)
				cancel()
				// A connection closed since (its partitions moved
				// away): nothing to retry through it.
				if err != nil && ctx.Err() == nil && !errors.Is(err, sarama.ErrClosedClient) {
					failed[c] = b
					errs = append(errs, err)
				}
			}
			if len(failed) == 0 {
				backoff = time.Second
				continue
			}
			w.log.Debug("mirroring offsets to the Kafka group failed; retrying (etcd holds them)", zap.Error(errors.Join(errs...)), zap.Duration("backoff", backoff))
			w.metrics.commitErrors.WithLabelValues("kafka_mirror").Inc()
			// Try again later with whatever is newest then: the group
			// must not stay behind because one attempt failed.
			select {
			case <-ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 30*time.Second)
			w.enqueueMirror(failed, true)
		}
	}
}

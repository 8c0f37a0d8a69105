package agent

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/state"
)

// checkStuck notes, for readiness and kswitch_stuck_partitions /
// kswitch_stalled_partitions, the partitions that do not move: their
// committable position has stood still for stuckAfter while records
// handed on wait for the handler's acknowledgement (stuck), or while
// nothing was handed on although the cluster holds records past it
// (stalled: its end offset is asked for then, at most once per half
// stuckAfter, and only while this agent's probe reaches the cluster).
// Paused partitions are neither.
func (w *worker) checkStuck(ctx context.Context, now time.Time) {
	var stuck, stalled []string
	due := map[string][]kafka.TopicPartition{} // by cluster: still partitions whose end is due to be asked
	home := w.applied.Cluster
	for _, cp := range slices.SortedFunc(maps.Keys(w.parts), cpart.Compare) {
		r, tp := w.parts[cp], cp.On(home)
		next, unacked := r.t.progress()
		if r.movedAt.IsZero() || next != r.next || r.gate.isPaused() {
			r.next, r.movedAt, r.end = next, now, -1
			continue
		}
		d := now.Sub(r.movedAt)
		switch {
		case d <= w.stuckAfter:
		case unacked > 0:
			stuck = append(stuck, fmt.Sprintf("%s (offset %d, %d records handed on, not acknowledged for %s)", tp, next, unacked, d.Round(time.Second)))
		case now.Sub(r.endAt) > w.stuckAfter/2 && w.conns[cp.Cluster] != nil && (w.reachable == nil || w.reachable(r.cluster)):
			due[cp.Cluster] = append(due[cp.Cluster], kafka.TopicPartition{Topic: cp.Topic, Partition: cp.Partition})
			r.endAt = now
		}
	}
	for c, tps := range due {
		// One request per broker for all of them (an idle agent's
		// partitions all stand still), given up on when the cluster
		// does not answer (ask): it may have hung since the probe last
		// reached it.
		k := w.conns[c]
		ends, _ := ask(k, "end offsets", func() (map[kafka.TopicPartition]int64, error) {
			return kafka.EndOffsets(k.client, tps)
		})
		for tp, end := range ends {
			if r := w.parts[cpart{Cluster: c, TopicPartition: state.TopicPartition{Topic: tp.Topic, Partition: tp.Partition}}]; r != nil {
				r.end = end
			}
		}
	}
	for _, cp := range slices.SortedFunc(maps.Keys(w.parts), cpart.Compare) {
		r, tp := w.parts[cp], cp.On(home)
		if d := now.Sub(r.movedAt); d > w.stuckAfter && r.end > r.next && !r.gate.isPaused() {
			if _, unacked := r.t.progress(); unacked == 0 {
				stalled = append(stalled, fmt.Sprintf("%s (offset %d, end %d, no progress for %s)", tp, r.next, r.end, d.Round(time.Second)))
			}
		}
	}
	var reasons []string
	if len(stuck) > 0 {
		reasons = append(reasons, fmt.Sprintf("the handler acknowledges nothing on %d partitions: %s", len(stuck), strings.Join(stuck, ", ")))
	}
	if len(stalled) > 0 {
		reasons = append(reasons, fmt.Sprintf("%d partitions make no progress while records wait on the cluster: %s", len(stalled), strings.Join(stalled, ", ")))
	}
	if r := w.checkIdle(ctx, now); r != "" {
		reasons = append(reasons, r)
	}
	if r := w.life.deadReason(now); r != "" {
		reasons = append(reasons, r)
	}
	reason := strings.Join(reasons, "; ")
	w.stuck.Store(&reason)
	if len(stuck) != w.stuckCount || len(stalled) != w.stalledCount {
		w.stuckCount, w.stalledCount = len(stuck), len(stalled)
		w.metrics.stuckPartitions.Set(float64(len(stuck)))
		w.metrics.stalledPartitions.Set(float64(len(stalled)))
		if reason != "" {
			w.log.Warn("partitions do not move", zap.String("reason", reason), zap.Duration("after", w.stuckAfter))
		}
	}
}

// idleCheckEvery is how often an agent that owns nothing reads
// state/stalled.
const idleCheckEvery = 2 * time.Second

// checkIdle returns, for readiness, why an agent that owns no partition is
// not doing its share: the leader's state/stalled lists partitions nobody
// consumes. "" when it owns partitions or none are stalled. It reads the
// key at most every idleCheckEvery and keeps the last finding.
func (w *worker) checkIdle(ctx context.Context, now time.Time) string {
	if len(w.parts) > 0 || len(w.pending) > 0 {
		w.idleReason = ""
		return ""
	}
	if now.Sub(w.idleAt) < idleCheckEvery {
		return w.idleReason
	}
	w.idleAt = now
	rctx, cancel := context.WithTimeout(ctx, w.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := w.etcd.Get(rctx, w.keys.Stalled())
	if err != nil || len(resp.Kvs) == 0 {
		w.idleReason = ""
		return ""
	}
	st, err := state.ParseStalled(resp.Kvs[0].Value)
	if err != nil {
		w.idleReason = ""
		return ""
	}
	if why := st.Silent[w.id]; why != "" {
		w.idleReason = fmt.Sprintf("the leader (%s) plans without this agent: %s", st.Leader, why)
		return w.idleReason
	}
	if len(st.Partitions) == 0 {
		w.idleReason = ""
		return ""
	}
	w.idleReason = fmt.Sprintf("this agent owns no partition while %d have had no consumer for over %s (state/stalled, by %s): %s",
		len(st.Partitions), state.StalledAfter, st.Leader, st.String(now))
	return w.idleReason
}

// countFetchStats adds what the Fetchers counted since the last call:
// their errors (failed requests, partition errors other than leader
// moves: they are the Fetcher's to retry, and no partition loop sees
// them) to kswitch_consume_errors_total, and the time brokers throttled
// their fetches to kswitch_kafka_throttle_seconds_total.
func (w *worker) countFetchStats() {
	for _, k := range w.conns {
		st := k.fetcher.Stats()
		w.metrics.consumeErrors.Add(float64(st.Errors - k.fetched.Errors))
		if d := st.Throttled - k.fetched.Throttled; d > 0 {
			w.metrics.throttle.WithLabelValues(k.name, "fetch").Add(d.Seconds())
		}
		k.fetched = st
	}
}

// observeLag sets kswitch_consumer_lag_records: by cluster and logical
// topic, the records past the acknowledged position of each partition
// this agent owns, up to the high watermark of its last fetch.
func (w *worker) observeLag() {
	type key struct{ cluster, topic string }
	lag := map[key]int64{}
	for _, r := range w.parts {
		next, _, _ := r.t.position()
		lag[key{r.cluster, r.logical}] += max(0, r.fp.HighWaterMark()-next)
	}
	w.metrics.lag.Reset()
	for k, n := range lag {
		w.metrics.lag.WithLabelValues(k.cluster, k.topic).Set(float64(n))
	}
}

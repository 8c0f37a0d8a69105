package agent

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/coordinator"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/state"
)

// A source topic's life goes on under its consumers: it can be deleted and
// created again under the same name (a new topic id, offsets from 0
// again), grow partitions, or lose the records a position points at. The
// worker's part (the leader's is coordinator/discovery.go):
//
//   - A partition's FetchPartition ends on an offset out of range (or
//     another error it does not retry). Such a partition is never left
//     dead: on the next commit tick it is stopped (its handed records
//     drained) and started again from its committed position, which
//     startPartition moves into the partition's range (intoRange) or
//     startOn to the start of a re-created topic (recreatedStart). Until
//     it runs again /readyz says why.
//   - A position carries the id of the topic it was committed for
//     (offsets.Commit.TopicID). A position of another id than the
//     topic's now is of a topic that no longer exists, and the partition
//     starts at the new topic's start: an old position that the new topic
//     has already grown past would skip its records otherwise.
//   - Every topicCheckEvery the worker compares the ids of the topics it
//     consumes with those its partitions started with (one Metadata
//     request per cluster, for those topics alone, in a goroutine of its
//     own: the loop never waits on a cluster that hangs): a topic re-created
//     while its consumer fetched on (its old offset already inside the new
//     log) is started again from its start too. What the old consumer
//     handed on from the new topic meanwhile is delivered again: never
//     lost.

// topicCheckEvery bounds how often a worker asks for the ids of the
// topics it consumes.
const topicCheckEvery = time.Second

// lifecycle is the worker's state of its partitions' lifecycle; owned by
// the worker's goroutine.
type lifecycle struct {
	// dead are the owned partitions whose consumer ended and that do not
	// run again yet: why, and since when.
	dead map[cpart]deadPart
	// recreated are the partitions to start at their topic's start
	// whatever their position (their topic's id changed under them).
	recreated map[cpart]bool
	// checked is when the topics' ids were last compared, checking set
	// while a comparison runs (off the worker's loop: a Metadata request
	// to a hung cluster waits out the client's timeouts), and found
	// receives its result.
	checked  time.Time
	checking bool
	found    chan recreatedFound
}

// recreatedFound is the result of a comparison of topic ids: the
// partitions whose topic has another id than the one they started with
// (that id, to tell a partition started again since).
type recreatedFound map[cpart]recreatedTopic

type recreatedTopic struct {
	startedWith string
	err         error
}

type deadPart struct {
	cause error
	since time.Time
}

// fromStart reports whether partition tp of cluster, whose committed
// position is p (ok: there is one) and whose topic's id is id now, starts
// at the topic's start: its position is of an earlier topic of the same
// name, or the worker found its topic re-created under its consumer.
func (l *lifecycle) fromStart(cluster string, tp state.TopicPartition, p offsets.Position, ok bool, id string) bool {
	return l.recreated[cpart{Cluster: cluster, TopicPartition: tp}] || (ok && !record.SameTopic(p.TopicID, id))
}

// deadReason is the readiness reason of the partitions whose consumer
// ended and does not run again ("" none).
func (l *lifecycle) deadReason(now time.Time) string {
	if len(l.dead) == 0 {
		return ""
	}
	var each []string
	for _, cp := range slices.SortedFunc(maps.Keys(l.dead), cpart.Compare) {
		d := l.dead[cp]
		each = append(each, fmt.Sprintf("%s (%v, for %s)", cp, d.cause, now.Sub(d.since).Round(time.Second)))
	}
	return fmt.Sprintf("%d partition consumers ended and do not run again yet: %s", len(each), strings.Join(each, ", "))
}

// topicIDs returns the ids of the topics of tps on k's cluster ("" or
// absent: unknown), asked in one Metadata request (ask); nil when it
// fails or is given up on, and the ids are checked again later. One
// request, without DescribeTopics' refresh and second try, so that a
// request given up on ends within its read timeout (Net.ReadTimeout, 5 s).
func (k *kafkaConn) topicIDs(log *zap.Logger, tps []state.TopicPartition) map[string]string {
	topics := map[string]bool{}
	for _, tp := range tps {
		topics[tp.Topic] = true
	}
	if len(topics) == 0 {
		return nil
	}
	meta, err := ask(k, "topic ids", func() (map[string]coordinator.TopicMeta, error) {
		return coordinator.DescribeTopicsOnce(k.client, slices.Sorted(maps.Keys(topics)))
	})
	if err != nil {
		log.Debug("cannot ask for the topics' ids; checked again later", zap.String("cluster", k.name), zap.Error(err))
		return nil
	}
	ids := make(map[string]string, len(meta))
	for t, m := range meta {
		ids[t] = m.ID
	}
	return ids
}

// recreatedStart is the start of partition tp of a topic deleted and
// created again since its position p (ok: there is one) was committed:
// the new topic's log start, whatever source.initial_offset says, since
// all of its records are new.
func (w *worker) recreatedStart(k *kafkaConn, tp state.TopicPartition, p offsets.Position, ok bool, id string) (int64, error) {
	start, err := k.resolve(tp, sarama.OffsetOldest)
	if err != nil {
		return 0, err
	}
	committed := int64(-1)
	if ok {
		committed = p.Offset
	}
	w.log.Warn("the partition's topic was deleted and created again: starting at the new topic's start",
		zap.String("cluster", k.name), zap.Stringer("partition", tp), zap.Int64("committed", committed),
		zap.String("committed_topic_id", p.TopicID), zap.String("topic_id", id), zap.Int64("start", start))
	w.metrics.restarts.WithLabelValues(k.name, "recreated").Inc()
	return start, nil
}

// intoRange returns start if it is within tp's log, else where the
// partition starts instead (the log's bounds asked once each). Past its
// end, the log was truncated or the topic re-created without a topic id
// to say so (Kafka before 2.8): every record in it is new to the fleet
// (or, truncated, was delivered already: delivered again rather than
// lost), so it starts at the log start. Before its log start, retention
// deleted records never consumed: source.initial_offset decides, with a
// warning.
func (w *worker) intoRange(k *kafkaConn, tp state.TopicPartition, start int64) (int64, error) {
	oldest, err := k.resolve(tp, sarama.OffsetOldest)
	if err != nil {
		return 0, err
	}
	end, err := k.resolve(tp, sarama.OffsetNewest)
	if err != nil {
		return 0, err
	}
	switch {
	case start >= oldest && start <= end:
		return start, nil
	case start > end:
		w.log.Warn("committed offset is past the partition's end (the topic was created again, or its log truncated): starting at its log start",
			zap.String("cluster", k.name), zap.Stringer("partition", tp), zap.Int64("committed", start), zap.Int64("end", end), zap.Int64("start", oldest))
		w.metrics.restarts.WithLabelValues(k.name, "beyond_end").Inc()
		return oldest, nil
	}
	initial := oldest
	if w.initialOffset(k.name, tp) == sarama.OffsetNewest {
		initial = end
	}
	w.log.Warn("committed offset is before the partition's log start (retention deleted records never consumed): starting at the initial offset",
		zap.String("cluster", k.name), zap.Stringer("partition", tp), zap.Int64("committed", start), zap.Int64("start", initial),
		zap.String("initial_offset", w.initial))
	w.metrics.restarts.WithLabelValues(k.name, "before_start").Inc()
	return initial, nil
}

// restartEnded starts again, on a commit tick, the partitions whose
// consumer ended on its own, and those whose topic the worker finds
// re-created (at most every topicCheckEvery). Each is stopped as a
// release stops it (what was handed on drains, up to DrainTimeout, so
// its acknowledgements are not lost), not committed (its position may
// be of the old topic), and started through startPending.
func (w *worker) restartEnded(ctx context.Context, now time.Time) {
	w.life.init()
	restart := map[cpart]error{}
	for cp, r := range w.parts {
		select {
		case <-r.done:
			if r.cause != nil {
				restart[cp] = r.cause
			}
		default:
		}
	}
	w.restart(ctx, now, restart)
	if !w.life.checking && now.Sub(w.life.checked) >= topicCheckEvery {
		w.life.checked, w.life.checking = now, true
		w.checkTopicIDs()
	}
}

// restartRecreated starts again the partitions a comparison of topic ids
// found re-created, unless they were started again since it began.
func (w *worker) restartRecreated(ctx context.Context, found recreatedFound) {
	w.life.init()
	w.life.checking = false
	restart := map[cpart]error{}
	for cp, f := range found {
		if r := w.parts[cp]; r != nil && r.topicID == f.startedWith {
			restart[cp] = f.err
			w.life.recreated[cp] = true
		}
	}
	w.restart(ctx, time.Now(), restart)
}

func (l *lifecycle) init() {
	if l.dead == nil {
		l.dead, l.recreated = map[cpart]deadPart{}, map[cpart]bool{}
	}
}

// restart stops the partitions of restart (partition → why) as a release
// stops them and starts them again through startPending.
func (w *worker) restart(ctx context.Context, now time.Time, restart map[cpart]error) {
	if len(restart) > 0 {
		var wg sync.WaitGroup
		for cp, cause := range restart {
			r := w.parts[cp]
			if _, dead := w.life.dead[cp]; !dead {
				w.life.dead[cp] = deadPart{cause: cause, since: now}
			}
			wg.Go(func() { r.stop(w.drain) })
			delete(w.parts, cp)
			delete(w.committed, cp)
			w.pending = append(w.pending, cp)
		}
		wg.Wait()
		slices.SortFunc(w.pending, cpart.Compare)
		w.pending = slices.Compact(w.pending)
		w.log.Info("starting partitions again", zap.Stringers("partitions", slices.SortedFunc(maps.Keys(restart), cpart.Compare)))
		w.startPending(ctx)
	}
	for cp := range w.life.dead {
		if w.parts[cp] != nil || !slices.Contains(w.pending, cp) {
			delete(w.life.dead, cp)
			delete(w.life.recreated, cp)
		}
	}
}

// checkTopicIDs compares, in a goroutine of w.bg, the ids of the topics
// the running partitions consume with those they started with, one
// Metadata request per reachable cluster, and sends the partitions whose
// topic has another id now to w.life.found.
func (w *worker) checkTopicIDs() {
	type check struct {
		k       *kafkaConn
		tps     []state.TopicPartition
		started map[cpart]string
	}
	checks := map[string]*check{}
	for cp, r := range w.parts {
		k := w.conns[cp.Cluster]
		if r.topicID == "" || k == nil || (w.reachable != nil && !w.reachable(cp.Cluster)) {
			continue
		}
		c := checks[cp.Cluster]
		if c == nil {
			c = &check{k: k, started: map[cpart]string{}}
			checks[cp.Cluster] = c
		}
		c.tps = append(c.tps, cp.TopicPartition)
		c.started[cp] = r.topicID
	}
	w.bg.Add(1)
	go func() {
		defer w.bg.Done()
		found := recreatedFound{}
		for c, ch := range checks {
			ids := ch.k.topicIDs(w.log, ch.tps)
			for cp, was := range ch.started {
				if id := ids[cp.Topic]; !record.SameTopic(was, id) {
					found[cp] = recreatedTopic{startedWith: was,
						err: fmt.Errorf("topic %s of cluster %s was deleted and created again (id %s, now %s)", cp.Topic, c, was, id)}
				}
			}
		}
		w.life.found <- found // buffered: one comparison runs at a time
	}()
}

package coordinator

import (
	"context"
	"slices"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/state"
	"github.com/kswitch/kswitch/translate"
)

// In a real data-centre outage the primary dies holding records that
// MirrorMaker 2 had not copied to the standby yet: its unmirrored tail. The
// fleet on the standby cannot see them; they are delivered late, never
// lost: once the primary returns, either the replicator copies them to the
// standby while the fleet still consumes there, or the failback's
// translation (by the fingerprints of the last records consumed on the
// standby) continues on the primary just before them. A failback counts
// them, so that operators know how many records came late and how late.

// lateLimit bounds the records read per partition to count the tail; a
// larger tail is reported as at least this.
const lateLimit = 1 << 20

// lateTimeout bounds the count. It runs beside the leader's loop, after
// the failback is active (the fleet consumes meanwhile), and then writes
// the failback's history entry again with the count.
const lateTimeout = 30 * time.Second

// countLate counts ev's unmirrored tail when ev is a failback (standby →
// primary) that ends the failover recorded just before it, in a goroutine
// of l.bg that ends with the term; when done it writes history/<epoch>
// again with the count and LateCounted set.
func (l *Leader) countLate(ctx context.Context, term election.Term, ev state.SwitchEvent, log *zap.Logger) {
	if conf := l.conf(); ev.To != conf.primary || ev.From == "" || ev.From == ev.To {
		return
	}
	ev.Partitions = slices.Clone(ev.Partitions) // the caller keeps its own
	l.bg.Add(1)
	go func() {
		defer l.bg.Done()
		if !l.late(ctx, &ev, log) {
			return
		}
		ev.LateCounted = true
		l.record(ctx, term, ev, log)
		l.metrics.lateRecords(ev)
	}()
}

// atFailover is, for one partition of the standby's copy at the failover:
// its end, how many records the fleet had consumed on the primary past it
// (lagged: delivered before the failover, not late) and the primary's
// position (the lagged records are just before it).
type atFailover struct{ end, lagged, from int64 }

// counted returns how many of the lagged records the failback's counts
// hold: those copied to the standby after the failover and consumed there
// (the first copied past its end, before standbyPos), and those at or
// after the failback's position on the primary (primaryPos: a failback
// translated by the fingerprints consumed there resumes after them).
func (a atFailover) counted(standbyPos, primaryPos int64) int64 {
	onStandby := min(a.lagged, max(0, standbyPos-a.end))
	onPrimary := max(0, a.from-max(primaryPos, a.from-a.lagged))
	return onStandby + onPrimary
}

// late fills in ev's unmirrored tail, and reports whether ev ends a
// failover: for each of the primary's own partitions, the records written
// before that failover began that the standby did not hold at it,
// consumed after the primary returned. They are the records of the
// standby's copy past its end at the failover (copied late) up to where
// the fleet stopped there, and those of the primary's topic from the
// failback's position on, both while their timestamps are before the
// failover's start, less the records consumed on the primary before the
// failover that the standby lacked (lagged: delivered, not late;
// atFailover.counted).
func (l *Leader) late(ctx context.Context, ev *state.SwitchEvent, log *zap.Logger) bool {
	conf := l.conf()
	ctx, cancel := context.WithTimeout(ctx, lateTimeout)
	defer cancel()
	prev, ok := l.readEvent(ctx, ev.Epoch-1)
	if !ok || prev.From != ev.To || prev.To != ev.From || prev.Abandoned != "" || len(prev.Topics) > 0 {
		return false
	}
	failover := map[state.TopicPartition]atFailover{}
	for _, ps := range prev.Partitions {
		if ps.Origin == ev.To && ps.Method != "none" {
			failover[state.TopicPartition{Topic: ps.ToTopic, Partition: ps.Partition}] = atFailover{ps.ToEnd, ps.Lagged, ps.FromOffset}
		}
	}
	open := func(cluster string) sarama.Client {
		c, err := kafka.NewClientWith(cluster, conf.clusters[cluster], kafka.Options{Dialer: l.dialer(cluster)})
		if err != nil {
			log.Warn("cannot count the unmirrored tail", zap.String("cluster", cluster), zap.Error(err))
			return nil
		}
		return c
	}
	primary, standby := open(ev.To), open(ev.From)
	for _, c := range []sarama.Client{primary, standby} {
		if c != nil {
			defer c.Close()
		}
	}
	before := prev.Started
	var oldest time.Time
	for i := range ev.Partitions {
		ps := &ev.Partitions[i]
		if ps.Origin != ev.To || ps.Method == "none" {
			continue
		}
		var n int64
		count := func(c sarama.Client, topic string, from, stop int64) {
			if c == nil || from < 0 {
				return
			}
			k, first, cut, err := translate.CountBefore(ctx, c, translate.Span{Topic: topic, Partition: ps.Partition, From: from, Stop: stop, Limit: lateLimit}, before)
			if err != nil {
				log.Warn("cannot count the unmirrored tail", zap.String("topic", topic), zap.Int32("partition", ps.Partition), zap.Error(err))
			}
			if cut {
				log.Warn("unmirrored tail larger than counted", zap.String("topic", topic), zap.Int32("partition", ps.Partition), zap.Int64("counted", k))
			}
			if k > 0 {
				n += k
				if ps.LateOldest.IsZero() || first.Before(ps.LateOldest) {
					ps.LateOldest = first
				}
			}
		}
		at, ok := failover[state.TopicPartition{Topic: ps.FromTopic, Partition: ps.Partition}]
		if ok {
			count(standby, ps.FromTopic, at.end, ps.FromOffset) // copied after the failover, consumed on the standby
		}
		count(primary, ps.ToTopic, ps.ToOffset, -1) // consumed from the primary after this switch
		ps.Late = max(0, n-at.counted(ps.FromOffset, ps.ToOffset))
		if ps.Late == 0 {
			ps.LateOldest = time.Time{}
		}
		ev.Late += ps.Late
		if ps.Late > 0 && (oldest.IsZero() || ps.LateOldest.Before(oldest)) {
			oldest = ps.LateOldest
		}
	}
	if ev.Late > 0 {
		ev.LateBySeconds = ev.Finished.Sub(oldest).Seconds()
	}
	log.Info("the primary's unmirrored tail: records written before the failover that the standby did not hold, consumed after the primary returned",
		zap.Int64("epoch", ev.Epoch), zap.Int64("late_records", ev.Late), zap.Time("oldest", oldest), zap.Float64("late_by_seconds_at_most", ev.LateBySeconds))
	return ctx.Err() == nil
}

// readEvent reads history/<epoch>.
func (l *Leader) readEvent(ctx context.Context, epoch int64) (state.SwitchEvent, bool) {
	rctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := l.etcd.Get(rctx, l.keys.HistoryEvent(epoch))
	if err != nil || len(resp.Kvs) == 0 {
		return state.SwitchEvent{}, false
	}
	ev, err := state.ParseSwitchEvent(resp.Kvs[0].Value)
	if err == nil {
		err = state.LoadPartitions(rctx, l.etcd, l.keys, &ev)
	}
	return ev, err == nil
}

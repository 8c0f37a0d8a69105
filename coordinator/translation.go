package coordinator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/IBM/sarama"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/state"
	"github.com/kswitch/kswitch/translate"
)

// translation is what a switch translates positions with: a client of the
// target, one Translator per MirrorMaker 2 flow between the two clusters
// (and one without MirrorMaker 2's data, for streams no flow between them
// copies directly), and the source partitions found on the target. A
// planned switch opens it before it revokes anything, so that the
// translation after the revoke runs on connected clients with loaded
// metadata.
//
// A stream whose copy on `to` is made from its copy on `from` (A's orders,
// going to B's A.orders) is translated forward along the flow from → to;
// one whose copy on `from` is made from its copy on `to` (A's B.orders,
// going back to B's orders) backward along the flow to → from (Naming.Flow).
type translation struct {
	from, to string
	naming   Naming
	target   sarama.Client
	// byFlow are the translators of the flows from → to and to → from, by
	// their ends; bare translates by the records alone.
	byFlow map[[2]string]*translate.Translator
	bare   *translate.Translator
	// source is a client of `from`, opened only when a flow's
	// offset-syncs live there (in a failover `from` is down, and opening
	// it costs a connection timeout): at most once, on first use.
	source *lazyClient
	// all are the source partitions on `to`, sorted; tps those of them
	// to translate (restrict).
	all, tps []state.TopicPartition
	// unconsumed is source.initial_offset: where a partition nothing was
	// consumed from yet continues (translate.Request.Unconsumed).
	unconsumed string
}

// lazyClient opens a client on first use and keeps it (or the failure).
// The opening is given up after within: sarama's NewClient bounds each
// seed broker's dial and metadata request by the timeout, not the whole,
// so a cluster whose brokers accept connections and answer nothing (a
// hung or blackholed data centre) costs the timeout once per broker. A
// given-up opening runs on in bg and closes its client when it ends.
type lazyClient struct {
	once   sync.Once
	open   func() (sarama.Client, error)
	within time.Duration
	bg     *sync.WaitGroup
	client sarama.Client
}

func (c *lazyClient) get() sarama.Client {
	c.once.Do(func() {
		type opened struct {
			client sarama.Client
			err    error
		}
		done := make(chan opened, 1)
		c.bg.Add(1)
		go func() {
			defer c.bg.Done()
			cl, err := c.open()
			done <- opened{cl, err}
		}()
		timer := time.NewTimer(c.within)
		defer timer.Stop()
		select {
		case o := <-done:
			if o.err == nil {
				c.client = o.client
			}
		case <-timer.C:
			c.bg.Add(1)
			go func() {
				defer c.bg.Done()
				if o := <-done; o.err == nil {
					_ = o.client.Close()
				}
			}()
		}
	})
	return c.client
}

func (c *lazyClient) close() {
	c.once.Do(func() {}) // no open after close
	if c.client != nil {
		_ = c.client.Close()
	}
}

// openTranslation connects to `to` and lists the source partitions there.
// fromDown says a quorum of agents does not reach `from` (a failover):
// translation then never connects to it, and the offset-syncs kept there
// are not read. Fingerprints and timestamps on `to` still translate every
// position; trying a cluster the fleet has just declared down would cost
// the switch a probe timeout when its brokers hang, and nothing when they
// refuse, so a switch from a hung cluster is as fast as from a stopped one.
func (l *Leader) openTranslation(ctx context.Context, from, to string, fromDown bool, log *zap.Logger) (*translation, error) {
	conf := l.conf()
	target, err := kafka.NewClientWith(to, conf.clusters[to], kafka.Options{Dialer: l.dialer(to)})
	if err != nil {
		return nil, err
	}
	x := &translation{from: from, to: to, naming: conf.naming, target: target, unconsumed: conf.source.InitialOffset}
	x.source = &lazyClient{open: func() (sarama.Client, error) {
		if fromDown {
			return nil, fmt.Errorf("coordinator: %s is down: its offset-syncs are not read", from)
		}
		return kafka.NewClientWith(from, conf.clusters[from],
			kafka.Options{Dialer: l.dialer(from), Timeout: l.cfg.Failover.ProbeTimeout})
	}, within: l.cfg.Failover.ProbeTimeout, bg: l.bg}
	d := &discovery{leader: l, cluster: to, log: log, client: target, def: conf.clusters[to], missing: map[string]bool{}}
	if x.all, err = d.partitions(ctx, conf); err != nil {
		x.close()
		return nil, err
	}
	x.tps = x.all
	margin := l.cfg.Failover.TimestampMargin
	x.bare = &translate.Translator{Target: target, TimestampMargin: margin}
	x.byFlow = map[[2]string]*translate.Translator{}
	for _, ends := range [][2]string{{from, to}, {to, from}} {
		rep, ok := conf.cfg.Flow(ends[0], ends[1])
		if !ok {
			continue
		}
		tr := &translate.Translator{Target: target, Replication: rep, TimestampMargin: margin, SyncsCache: new(translate.SyncsCache)}
		switch rep.OffsetSyncsCluster {
		case to:
			tr.Syncs = target
		case from:
			tr.OpenSyncs = x.source.get
		}
		x.byFlow[ends] = tr
	}
	return x, nil
}

// restrict makes x translate the partitions of the logical topics only
// accepts (all when nil).
func (x *translation) restrict(only func(logical string) bool) {
	x.tps = x.all
	if only != nil {
		x.tps = slices.DeleteFunc(slices.Clone(x.all), func(tp state.TopicPartition) bool { return !only(x.naming.Logical(x.to, tp.Topic)) })
	}
}

func (x *translation) close() {
	if x == nil {
		return
	}
	x.source.close()
	_ = x.target.Close()
}

// request returns the translator and the request that translate position
// pos of stream s from x.from to x.to, where the stream's partition is
// tp on x.to.
func (x *translation) request(s Stream, tp state.TopicPartition, pos offsets.Commit, group string, hint *translate.Hint) (*translate.Translator, translate.Request) {
	req := translate.Request{From: x.from, To: x.to, Topic: tp.Topic, SourceTopic: x.naming.TopicOn(x.from, s),
		Partition: tp.Partition, Position: pos, Hint: hint, Unconsumed: x.unconsumed}
	if x.naming.FromStandby(s) {
		// Records written on the standby are never skipped.
		req.Unconsumed = "oldest"
	}
	rep, dir, ok := x.naming.Flow(x.from, x.to, s)
	switch {
	case !ok:
		req.Direction = translate.Forward
		return x.bare, req
	case dir == translate.Backward:
		req.Direction = translate.Backward
		return x.byFlow[[2]string{rep.From, rep.To}], req
	}
	// Checkpoints are the group's on the flow's target: only forward.
	req.Direction, req.Group = translate.Forward, group
	return x.byFlow[[2]string{rep.From, rep.To}], req
}

// committed returns the positions committed on cluster, by physical
// partition there.
func (l *Leader) committed(ctx context.Context, cluster string, log *zap.Logger) (map[state.TopicPartition]offsets.Position, error) {
	lctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
	positions, bad, err := l.store.List(lctx, cluster)
	cancel()
	if err != nil {
		return nil, err
	}
	for _, b := range bad {
		log.Warn("ignoring malformed committed offset", zap.Error(b))
	}
	byPartition := make(map[state.TopicPartition]offsets.Position, len(positions))
	for _, p := range positions {
		byPartition[state.TopicPartition{Topic: p.Topic, Partition: p.Partition}] = p
	}
	return byPartition, nil
}

// translate translates every partition of x.tps from the position of the
// same stream's partition on x.from in positions, starting each
// fingerprint scan from its hint (by partition on x.to) when there is one.
// It returns each partition's outcome and the commits to write on x.to;
// the error joins every partition's failure.
func (l *Leader) translate(ctx context.Context, x *translation, positions map[state.TopicPartition]offsets.Position,
	hints map[state.TopicPartition]*translate.Hint) ([]state.PartitionSwitch, []offsets.Commit, error) {
	type result struct {
		ps     state.PartitionSwitch
		commit *offsets.Commit
		err    error
	}
	results := make([]result, len(x.tps))
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for i, tp := range x.tps {
		s := x.naming.Stream(x.to, tp.Topic)
		fromTP := state.TopicPartition{Topic: x.naming.TopicOn(x.from, s), Partition: tp.Partition}
		ps := state.PartitionSwitch{Topic: s.Logical, Origin: s.Origin, FromTopic: fromTP.Topic, ToTopic: tp.Topic, Partition: tp.Partition}
		pos, ok := positions[fromTP]
		if !ok {
			start := "source.initial_offset"
			if x.naming.FromStandby(s) {
				start = "its oldest offset (a topic written on the standby)"
			}
			ps.FromOffset, ps.ToOffset, ps.Method, ps.Rewound = -1, -1, "none", -1
			ps.Detail = "no committed position on " + x.from + ": starts at its committed position on " + x.to + " if any, else at " + start
			results[i] = result{ps: ps}
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			tr, req := x.request(s, tp, pos.Commit, l.cfg.Source.Group, hints[tp])
			res, err := tr.Translate(ctx, req)
			if err != nil {
				results[i] = result{err: err}
				return
			}
			c := offsets.Commit{Cluster: x.to, Topic: tp.Topic, Partition: tp.Partition, Offset: res.Offset,
				Timestamp: pos.Timestamp, Fingerprints: pos.Fingerprints}
			if int64(len(c.Fingerprints)) > c.Offset {
				c.Fingerprints = c.Fingerprints[int64(len(c.Fingerprints))-c.Offset:]
			}
			ps.FromOffset, ps.ToOffset, ps.ToEnd = pos.Offset, res.Offset, res.End
			ps.Method, ps.Rewound, ps.Lagged, ps.Detail = string(res.Method), res.Rewound, res.Lagged, res.Detail
			results[i] = result{commit: &c, ps: ps}
		}()
	}
	wg.Wait()
	var commits []offsets.Commit
	var parts []state.PartitionSwitch
	var errs []error
	for _, r := range results {
		if r.err != nil {
			errs = append(errs, r.err)
			continue
		}
		parts = append(parts, r.ps)
		if r.commit != nil {
			commits = append(commits, *r.commit)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return parts, commits, fmt.Errorf("coordinator: translate positions %s → %s: %w", x.from, x.to, err)
	}
	return parts, commits, nil
}

// translateAll translates every partition on ev.To of the source topics
// only accepts (all when nil) from its committed position on ev.From,
// records the outcomes and the phase's durations (translate, and of it
// replica_wait: the wait for the replica to hold what the fleet consumed)
// in ev, and returns the operations that write the translated positions.
// It uses prep's clients and hints when a planned switch prepared them.
//
// In a planned switch the replica may be a little behind the fleet (the
// replicator copies what the fleet has just consumed): records consumed on
// `from` but not yet on `to` would be delivered again once copied. So a
// planned switch translates again, every lagPoll, until the target holds
// every consumed record, for at most prepareTimeout; a failover cannot
// wait for a replicator whose source is gone, and reports the lag.
func (l *Leader) translateAll(ctx context.Context, t *term, ev *state.SwitchEvent, job translateJob) ([]clientv3.Op, error) {
	began := time.Now()
	parts, ops, waited, err := l.translateFrom(ctx, t, job)
	ev.Partitions = parts
	ev.Phases["translate"] = time.Since(began).Seconds()
	if waited > 0 {
		ev.Phases["replica_wait"] = waited.Seconds()
	}
	return ops, err
}

// translateJob is what a switch translates: the positions committed on
// from, of the logical topics only accepts, to their places on to.
type translateJob struct {
	from, to string
	// prep is the switch's preparation, if it made one: its translation
	// already open, and hints.
	prep *prepared
	// planned: the cluster left is healthy, so translate again while the
	// target lags behind what the fleet consumed (translateAll).
	planned bool
	only    func(logical string) bool
	log     *zap.Logger
}

// translateFrom is translateAll's work.
func (l *Leader) translateFrom(ctx context.Context, t *term, job translateJob) (
	parts []state.PartitionSwitch, ops []clientv3.Op, replicaWait time.Duration, err error) {
	from, to, planned, log := job.from, job.to, job.planned, job.log
	x, hints := job.prep.use(from, to)
	if x == nil {
		if x, err = l.openTranslation(ctx, from, to, !planned, log); err != nil {
			return nil, nil, 0, err
		}
		defer x.close()
	}
	x.restrict(job.only)
	positions, err := l.committed(ctx, from, log)
	if err != nil {
		return nil, nil, 0, err
	}
	parts, commits, err := l.translate(ctx, x, positions, hints)
	if err == nil && planned && lagging(parts) > 0 {
		began := time.Now()
		for deadline := began.Add(l.prepareTimeout()); err == nil && lagging(parts) > 0 && time.Now().Before(deadline); {
			select {
			case <-ctx.Done():
				return parts, nil, 0, ctx.Err()
			case <-time.After(lagPoll):
			}
			parts, commits, err = l.translate(ctx, x, positions, hints)
		}
		replicaWait = time.Since(began)
	}
	if err != nil {
		return parts, nil, 0, err
	}
	if n := lagging(parts); n > 0 {
		log.Warn("the target lacks records the fleet consumed; if the replicator copies them later they are delivered again",
			zap.Int64("lagged", n), zap.Bool("planned", planned))
	}
	for _, ps := range parts {
		if ps.Method != "none" {
			l.translated(ps.Method)
		}
	}
	if ops, err = l.store.PutOps("leader:"+t.ID, t.current.Generation, commits); err != nil {
		return parts, nil, 0, err
	}
	t.found = x.all
	return parts, ops, replicaWait, nil
}

// lagPoll is how often a planned switch translates again while the target
// lags behind what the fleet consumed.
const lagPoll = 20 * time.Millisecond

// lagging returns how many consumed records the targets lacked in all.
func lagging(parts []state.PartitionSwitch) int64 {
	var n int64
	for _, ps := range parts {
		n += ps.Lagged
	}
	return n
}

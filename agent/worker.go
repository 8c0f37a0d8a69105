package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/IBM/sarama"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/coordinator"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/signals"
)

// cpart names a partition of one cluster: the worker's partitions are
// keyed so, as A's orders/0 and B's orders/0 are different streams.
type cpart = coordinator.ClusterPartition

// kafkaConn is the worker's connection to a cluster it consumes: a
// sarama Client for metadata, offsets and the group mirror, and a
// kafka.Fetcher that reads its partitions.
type kafkaConn struct {
	name    string
	client  sarama.Client
	fetcher *kafka.Fetcher
	mirror  *offsets.KafkaMirror
	// fetched are the fetcher's figures already exported
	// (countFetchStats); owned by the worker's run.
	fetched kafka.FetchStats
}

// dialKafka connects to cluster name, its partitions read by a Fetcher of
// configuration fetch.
func dialKafka(name string, c config.Cluster, group string, timeout time.Duration, d kafka.Dialer, fetch kafka.FetchConfig) (*kafkaConn, error) {
	client, err := kafka.NewClientWith(name, c, kafka.Options{Dialer: d})
	if err != nil {
		return nil, err
	}
	k := &kafkaConn{name: name, client: client, mirror: offsets.NewKafkaMirror(client, group, timeout)}
	if k.fetcher, err = kafka.NewFetcher(name, client, fetch); err != nil {
		client.Close()
		return nil, fmt.Errorf("kafka: consumer on cluster %s: %w", name, err)
	}
	return k, nil
}

// recordOverhead is what the agent's budget charges per record beyond its
// key, value and headers: the Fetcher's share, the record's delivery (the
// record.Record handed on and the tracker's state) and what the handler
// keeps (record.KeptPerRecord: the routing sink's produce message, or
// nothing for a handler that acknowledges at once).
func recordOverhead(h record.Handler) int {
	return kafka.DefaultFetchRecordOverhead + int(unsafe.Sizeof(delivery{})) + record.KeptPerRecord(h)
}

// fetchConfig is the configuration of the worker's Fetchers. The agent's
// byte budget is theirs: it is charged per response (the records are
// slices of it) and given back as the chunks are acknowledged, so the
// tracker charges nothing more. The fetch sizes follow the budget
// (default 32 MiB: Kafka's 1 MiB per partition, 8 MiB per request): no
// request is sent with less than budget/8 free, and a request asks for
// at most what is free (kafka.Fetcher: on the wire, divided by how much
// the last response weighed more decoded), so the bytes held stay about
// the budget with one broker (plus a batch: KIP-74), and at most a
// quarter of it more for each other broker fetching at the same moment.
//
// Each record is charged recordOverhead beyond its bytes: with small
// records, what the agent and its handler keep per record in flight
// outweighs the record (150 B records charged 64 B each held four times
// the budget, and the garbage collector, held to agent.memory_limit_mib,
// never paused).
func (w *worker) fetchConfig(cluster string) kafka.FetchConfig {
	return kafka.FetchConfig{
		Budget:            w.budget,
		RecordOverhead:    recordOverhead(w.handler),
		PartitionMaxBytes: int32(min(w.budget.max/8, kafka.DefaultFetchPartitionMaxBytes)),
		MaxBytes:          int32(min(w.budget.max/4, kafka.DefaultFetchMaxBytes)),
		Logger:            w.log.With(zap.String("cluster", cluster)),
	}
}

// resolve turns sarama.OffsetOldest or OffsetNewest into an offset.
func (k *kafkaConn) resolve(tp coordinator.TopicPartition, which int64) (int64, error) {
	off, err := k.client.GetOffset(tp.Topic, tp.Partition, which)
	if err != nil {
		return 0, fmt.Errorf("kafka: list offsets of %s on cluster %s: %w", tp, k.name, err)
	}
	return off, nil
}

func (k *kafkaConn) close() {
	k.fetcher.Close()
	_ = k.client.Close()
}

// knows reports whether the client's metadata holds every partition of
// tps, without asking the cluster.
func (k *kafkaConn) knows(tps []coordinator.TopicPartition) bool {
	topics, err := k.client.Topics() // the cached list
	if err != nil {
		return false
	}
	parts := map[string][]int32{}
	for _, t := range topics {
		parts[t] = nil
	}
	for _, tp := range tps {
		ps, known := parts[tp.Topic]
		if !known {
			return false
		}
		if ps == nil {
			// Known topic: Partitions answers from the cache.
			if ps, err = k.client.Partitions(tp.Topic); err != nil {
				return false
			}
			parts[tp.Topic] = ps
		}
		if !slices.Contains(ps, tp.Partition) {
			return false
		}
	}
	return true
}

// openBrokers connects the client to every broker of the cluster and
// waits until each connection is up or has failed, so that the offset
// look-ups and group commits of the partitions started later find them
// open. The Fetcher dials connections of its own, when it first fetches
// from a broker: those it does not open (docs/RELAY.md §7 step 3).
func (k *kafkaConn) openBrokers() {
	for _, b := range k.client.Brokers() {
		_ = b.Open(k.client.Config()) // ErrAlreadyConnected: fine
		_, _ = b.Connected()          // waits for the connection attempt
	}
}

// warmResult is the outcome of warming a connection to a cluster.
type warmResult struct {
	cluster string
	conn    *kafkaConn
	err     error
}

// worker applies the fleet's assignment to this agent: it consumes the
// partitions the agent owns, commits their positions (fenced) and
// acknowledges each generation. One worker runs per etcd session; its
// run goroutine owns every field below the line, so they need no lock.
type worker struct {
	cfg     config.Config
	id      string
	keys    keys.Fleet
	log     *zap.Logger
	etcd    *clientv3.Client
	store   *offsets.Store
	handler record.Handler
	// released, when not nil, is told of each partition given up
	// (Options.Released).
	released func(record.Owned)
	// rate counts the records handed to the handler (the agent's
	// records/s).
	rate *rateMeter
	// deadLetters, when not nil, returns the handler's dead-letter
	// counts by logical topic (Options.DeadLetters).
	deadLetters func() map[string]int64
	metrics     *metrics
	// drain bounds how long a revoked partition waits for the handler to
	// acknowledge what it was given before its final commit.
	drain time.Duration
	lease clientv3.LeaseID
	// sessionAlive tells a clean stop (commit, then release) from a lost
	// session (nothing can be committed).
	sessionAlive func() bool
	// owned is where the worker publishes the partitions it runs, by
	// cluster.
	owned  *atomic.Pointer[map[string][]coordinator.TopicPartition]
	naming coordinator.Naming
	// active publishes the cluster of the applied assignment, for
	// readiness.
	active *atomic.Pointer[string]
	// bg owns the worker's short-lived helper goroutines; run waits for
	// them.
	bg sync.WaitGroup
	// signals are the pause/start signals in force.
	signals *signals.Watcher
	// signalsApplied is the signals revision every running partition obeys
	// (paused ones parked): Agent.SignalsApplied.
	signalsApplied *atomic.Int64
	// dialer, when set, opens this agent's connections to a cluster.
	dialer func(cluster string) kafka.Dialer
	// restartFails is hooks.RestartFails.
	restartFails func(cluster string, tp coordinator.TopicPartition) error
	// ackFails is hooks.AckFails.
	ackFails func(gen int64) error
	// pendingAsg is a state/assignment value of a term this agent has
	// not seen elected yet (applyValue); owned by the loop.
	pendingAsg *pendingValue
	// ackDue is the generation whose acknowledgement failed (0: none): it
	// is written again on every commit tick until it lands or a later
	// one replaces it. The leader plans without an agent that does not
	// acknowledge for long (coordinator's silence).
	ackDue int64
	// mirrorq hands committed positions to the goroutine that mirrors
	// them to the Kafka groups, so a slow or dead cluster never delays a
	// commit, a release or an acknowledgement. It holds the latest
	// positions, by cluster.
	mirrorq chan mirrorJob

	// reachable reports whether this agent's last probe reached a
	// cluster (true when it has not probed it).
	reachable func(cluster string) bool
	// budget bounds the bytes of the fetch responses whose records are
	// not all acknowledged (source.max_in_flight_mib).
	budget *byteBudget
	// leaderToken returns the current leader's fencing token as this
	// agent's observer sees it (false: none known).
	leaderToken func() (int64, bool)
	// hold stops delivery while commits do not succeed (commitHold).
	hold *commitHold
	// stuck is the reason of checkStuck's last finding ("": none), for
	// readiness; stuckAfter its bound.
	stuck      *atomic.Pointer[string]
	stuckAfter time.Duration
	// stuckCount and stalledCount are checkStuck's last counts, to log
	// and set the gauges when they change.
	stuckCount, stalledCount int
	// idleReason is checkIdle's last finding, read at idleAt.
	idleReason string
	idleAt     time.Time

	// warmed receives the outcome of the warm-up in flight (at most one).
	warmed chan warmResult

	// reconf delivers the dynamic configuration versions the agent
	// applies (the latest one; see dynConfig).
	reconf chan configUpdate

	// ---- owned by run
	// configVersion is the dynamic configuration version applied;
	// clusters and initial are the parts of it the worker uses (the rest
	// of cfg is the file's and never changes).
	configVersion int64
	clusters      map[string]config.Cluster
	initial       string
	// conns are the connections to the clusters this agent consumes:
	// the fleet's, and those topics are placed on.
	conns map[string]*kafkaConn
	// warm is a connection opened ahead of a planned switch to its
	// cluster (Assignment.Warm); it joins conns when the switch assigns
	// partitions there.
	warm *kafkaConn
	// warming names the cluster of the warm-up in flight, "" if none;
	// warmAck is the generation to acknowledge when it ends (0: none).
	warming    string
	warmAck    int64
	parts      map[cpart]*partitionRun
	committed  map[cpart]int64
	pending    []cpart // owned but not started (Kafka trouble): retried
	applied    coordinator.Assignment
	appliedRev int64
	// pacer keeps the periodic commits within the agent's share of the
	// fleet's etcd budget.
	pacer commitPacer
	// life restarts partition consumers that ended and checks the
	// owned topics' ids (lifecycle.go).
	life lifecycle
}

// initialOffset is where partition tp of cluster starts without a
// committed position, in etcd or in the Kafka group (groupStarts):
// source.initial_offset, except for the topics
// producers write on the standby (an outage's records, and their copies
// on the primary), which start at their oldest offset: a copy that
// appears in the middle of a run is consumed from its start.
func (w *worker) initialOffset(cluster string, tp coordinator.TopicPartition) int64 {
	if w.initial == "newest" && !w.naming.FromStandby(w.naming.Stream(cluster, tp.Topic)) {
		return sarama.OffsetNewest
	}
	return sarama.OffsetOldest
}

// errLeaseLost ends a worker whose commits etcd refused for its lease.
var errLeaseLost = errors.New("agent: session lease lost; stopped consuming")

// run follows state/assignment until ctx ends or the lease is lost. On a
// clean stop it drains and commits every partition before returning; after
// losing the lease it stops them without committing.
func (w *worker) run(ctx context.Context) error {
	w.parts = map[cpart]*partitionRun{}
	w.life.found = make(chan recreatedFound, 1)
	w.committed = map[cpart]int64{}
	w.pacer = commitPacer{interval: w.cfg.Source.CommitInterval}
	w.conns = map[string]*kafkaConn{}
	w.mirrorq = make(chan mirrorJob, 1)
	w.warmed = make(chan warmResult, 1)
	mctx, mcancel := context.WithCancel(context.WithoutCancel(ctx))
	mdone := make(chan struct{})
	go func() {
		defer close(mdone)
		w.mirrorLoop(mctx)
	}()
	// The commit watchdog lives exactly as long as run: run may return
	// (the lease lost) before ctx ends.
	hctx, hcancel := context.WithCancel(ctx)
	defer func() {
		// The mirror goroutine ends before the Kafka client it uses is
		// closed.
		mcancel()
		<-mdone
		hcancel()
		w.bg.Wait()
		for _, k := range w.conns {
			k.close()
		}
		w.dropWarm()
		select {
		case res := <-w.warmed:
			if res.conn != nil {
				res.conn.close()
			}
		default:
		}
		w.publishOwned()
	}()
	w.metrics.deliveryHeld.Set(0) // a new session: nothing held, nothing stuck yet
	w.metrics.stuckPartitions.Set(0)
	w.metrics.stalledPartitions.Set(0)
	w.bg.Add(1)
	go func() {
		defer w.bg.Done()
		w.watchCommits(hctx)
	}()
	if w.deadLetters != nil {
		w.bg.Add(1)
		go func() {
			defer w.bg.Done()
			w.publishDeadLetters(hctx, w.deadLetters)
		}()
	}
	// Signals are read before anything is consumed: an agent that
	// restarts during a pause must not deliver a record.
	select {
	case <-w.signals.Ready():
	case <-ctx.Done():
		return ctx.Err()
	}
	sig := w.signals.Subscribe(ctx)
	w.applySignals(ctx)
	w.ackConfig(ctx)
	tick := time.NewTicker(w.cfg.Source.CommitInterval)
	defer tick.Stop()
	for {
		err := w.follow(ctx, tick.C, sig)
		if errors.Is(err, errLeaseLost) || !w.sessionAlive() {
			w.stopAll(false)
			return errLeaseLost
		}
		if ctx.Err() != nil {
			w.stopAll(true)
			return ctx.Err()
		}
		w.log.Debug("assignment watch interrupted; re-reading", zap.Error(err))
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// follow reads state/assignment, applies it, then applies every change
// until the watch breaks, committing on every tick.
func (w *worker) follow(ctx context.Context, tick <-chan time.Time, sig <-chan struct{}) error {
	rctx, cancel := context.WithTimeout(ctx, w.cfg.Etcd.RequestTimeout)
	resp, err := w.etcd.Get(rctx, w.keys.Assignment())
	cancel()
	if err != nil {
		return err
	}
	if len(resp.Kvs) > 0 {
		w.applyValue(ctx, resp.Kvs[0].Value, resp.Kvs[0].ModRevision, false)
	}
	wctx, wcancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer wcancel()
	wch := w.etcd.Watch(wctx, w.keys.Assignment(), clientv3.WithRev(resp.Header.Revision+1))
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-sig:
			w.applySignals(ctx)
		case res := <-w.warmed:
			w.warmDone(ctx, res)
		case u := <-w.reconf:
			w.reconfigure(ctx, u)
		case found := <-w.life.found:
			w.restartRecreated(ctx, found)
		case now := <-tick:
			if err := w.commitDue(ctx, now); errors.Is(err, errLeaseLost) {
				return err
			}
			if w.ackDue > 0 {
				w.ack(ctx, w.ackDue)
			}
			w.applyPending(ctx, now)
			w.restartEnded(ctx, now)
			w.checkStuck(ctx, now)
			w.observeLag()
			w.countFetchStats()
			w.startPending(ctx)
		case wr, ok := <-wch:
			if !ok {
				return errors.New("assignment watch closed")
			}
			if err := wr.Err(); err != nil {
				return err
			}
			evs, err := waiting(wch, wr.Events)
			w.applyNewest(ctx, evs)
			if err != nil {
				return err
			}
		}
	}
}

// waiting adds to evs the events of the watch responses already waiting on
// wch, without blocking, and returns the error that ended the watch, if
// one did.
func waiting(wch clientv3.WatchChan, evs []*clientv3.Event) ([]*clientv3.Event, error) {
	for {
		select {
		case wr, ok := <-wch:
			if !ok {
				return evs, errors.New("assignment watch closed")
			}
			if err := wr.Err(); err != nil {
				return evs, err
			}
			evs = append(evs, wr.Events...)
		default:
			return evs, nil
		}
	}
}

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
	a, err := coordinator.ParseAssignment(val)
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
func (w *worker) apply(ctx context.Context, a coordinator.Assignment, rev int64) {
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
func (w *worker) followWarm(ctx context.Context, a coordinator.Assignment) bool {
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
	if w.warming == "" {
		c, ok := w.clusters[a.Warm]
		if !ok {
			w.log.Warn("assignment warms a cluster this agent has no configuration for", zap.String("cluster", a.Warm))
			return false
		}
		w.warming = a.Warm
		d := w.dialerFor(a.Warm)
		w.bg.Add(1)
		go func() {
			defer w.bg.Done()
			k, err := dialKafka(a.Warm, c, w.cfg.Source.Group, w.cfg.Etcd.RequestTimeout, d, w.fetchConfig(a.Warm))
			if err == nil {
				k.openBrokers()
			}
			w.warmed <- warmResult{cluster: a.Warm, conn: k, err: err}
		}()
	}
	return w.warming == a.Warm
}

// warmDone takes the outcome of a warm-up: the connection is kept if the
// applied assignment still warms or consumes its cluster, and the
// generation waiting for it is acknowledged, warm or not (warming is an
// optimization: the leader must not wait for a cluster this agent cannot
// reach yet).
func (w *worker) warmDone(ctx context.Context, res warmResult) {
	w.warming = ""
	switch {
	case res.err != nil:
		w.log.Info("cannot warm a connection ahead of the switch; connecting when assigned", zap.String("cluster", res.cluster), zap.Error(res.err))
	case w.conns[res.cluster] == nil && w.wants(w.applied, res.cluster):
		w.conns[res.cluster] = res.conn
		w.startPending(ctx)
	case w.applied.Warm == res.cluster && w.warm == nil && w.conns[res.cluster] == nil:
		w.warm = res.conn
		w.log.Info("warmed a connection ahead of the switch", zap.String("cluster", res.cluster))
	default:
		res.conn.close()
	}
	if w.warmAck > 0 && w.warmAck == w.applied.Generation {
		w.ack(ctx, w.warmAck)
	}
	w.warmAck = 0
}

// wants reports whether a gives this agent partitions of cluster.
func (w *worker) wants(a coordinator.Assignment, cluster string) bool {
	return len(a.Section(cluster).Owned[w.id]) > 0
}

// dropWarm closes the warm connection, if any.
func (w *worker) dropWarm() {
	if w.warm != nil {
		w.warm.close()
		w.warm = nil
	}
}

func (w *worker) dialerFor(cluster string) kafka.Dialer {
	if w.dialer == nil {
		return nil
	}
	return w.dialer(cluster)
}

// release stops tps, waits for their records to be acknowledged, commits
// their final positions and tells the handler (Options.Released). The
// partitions stop concurrently: each waits for its own records'
// acknowledgements.
func (w *worker) release(ctx context.Context, tps []cpart, a coordinator.Assignment) {
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

// readAssignment reads state/assignment and its revision.
func (w *worker) readAssignment(ctx context.Context) (coordinator.Assignment, int64, error) {
	rctx, cancel := context.WithTimeout(ctx, w.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := w.etcd.Get(rctx, w.keys.Assignment())
	if err != nil {
		return coordinator.Assignment{}, 0, err
	}
	if len(resp.Kvs) == 0 {
		return coordinator.Assignment{}, 0, errors.New("state/assignment is absent")
	}
	a, err := coordinator.ParseAssignment(resp.Kvs[0].Value)
	return a, resp.Kvs[0].ModRevision, err
}

// startPending starts the owned partitions not yet running, cluster by
// cluster. A partition that cannot start (its cluster unreachable) stays
// pending and is retried on the next commit tick.
func (w *worker) startPending(ctx context.Context) {
	if len(w.pending) == 0 {
		return
	}
	byCluster := map[string][]coordinator.TopicPartition{}
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
func (w *worker) startOn(ctx context.Context, cluster string, tps []coordinator.TopicPartition) (still []coordinator.TopicPartition) {
	// A cluster this agent's probe cannot reach would hold the loop for a
	// client's whole retry budget per attempt, while the next assignment
	// (a switch away from that cluster, often) waits to be applied: the
	// partitions start once the probe reaches it again.
	if w.reachable != nil && !w.reachable(cluster) {
		w.log.Debug("not starting partitions: this agent's probe cannot reach the cluster", zap.String("cluster", cluster),
			zap.Int("partitions", len(tps)))
		return tps
	}
	k := w.conns[cluster]
	if k == nil {
		c, ok := w.clusters[cluster]
		if !ok {
			w.log.Error("assignment names a cluster this agent has no configuration for", zap.String("cluster", cluster))
			return tps
		}
		var err error
		if k, err = dialKafka(cluster, c, w.cfg.Source.Group, w.cfg.Etcd.RequestTimeout, w.dialerFor(cluster), w.fetchConfig(cluster)); err != nil {
			w.log.Warn("cannot connect to the assigned cluster; retrying", zap.String("cluster", cluster), zap.Error(err))
			return tps
		}
		w.conns[cluster] = k
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
		if err := k.client.RefreshMetadata(slices.Sorted(maps.Keys(topics))...); err != nil {
			w.log.Warn("cannot refresh metadata of the assigned topics; retrying", zap.String("cluster", cluster), zap.Error(err))
			return tps
		}
	}
	lctx, cancel := context.WithTimeout(ctx, w.cfg.Etcd.RequestTimeout)
	positions, bad, err := w.store.LoadMany(lctx, cluster, tps)
	cancel()
	if err != nil {
		w.log.Warn("cannot read committed offsets; retrying", zap.String("cluster", cluster), zap.Error(err))
		return tps
	}
	for _, b := range bad {
		// Treated as "no committed offset": the partition starts at the
		// group's offset in Kafka, else the initial offset, and the next
		// commit replaces the bad value.
		w.log.Warn("refusing malformed committed offset; the partition starts at the group's committed offset in Kafka, else the initial offset, and the next commit replaces it", zap.Error(b), zap.String("initial_offset", w.cfg.Source.InitialOffset))
		w.metrics.badValues.WithLabelValues("offset").Inc()
	}
	// Partitions without a position start where the Kafka group's
	// consumers left them, if anywhere (startoffset.go).
	fromGroup, err := w.groupStarts(ctx, k, cluster, tps, positions)
	if err != nil {
		w.log.Warn("cannot read the group's committed offsets of the partitions without a position; retrying",
			zap.String("cluster", cluster), zap.String("group", w.cfg.Source.Group), zap.Error(err))
		return tps
	}
	// Partitions start concurrently: each may need a ListOffsets round
	// trip (a start out of range), which one by one would add up.
	type started struct {
		tp  coordinator.TopicPartition
		r   *partitionRun
		err error
	}
	results := make(chan started, len(tps))
	// Signals hold across rebalances and switches: a partition starts
	// paused when a signal in force pauses it.
	state := w.signals.State()
	paused := map[coordinator.TopicPartition]bool{}
	for _, tp := range tps {
		paused[tp], _ = state.Paused(w.naming.Logical(cluster, tp.Topic), w.id)
	}
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
		dead, restarting := w.life.dead[cpart{Cluster: cluster, TopicPartition: tp}]
		go func() {
			if restarting && w.restartFails != nil {
				if err := w.restartFails(cluster, tp); err != nil {
					results <- started{tp: tp, err: err}
					return
				}
			}
			start := p.Offset
			if g, found := fromGroup[tp]; found {
				start = g
			} else if !ok {
				var err error
				if start, err = k.resolve(tp, w.initialOffset(cluster, tp)); err != nil {
					results <- started{tp: tp, err: err}
					return
				}
			}
			if w.life.fromStart(cluster, tp, p, ok, ids[tp.Topic]) {
				var err error
				if start, err = w.recreatedStart(k, tp, p, ok, ids[tp.Topic]); err != nil {
					results <- started{tp: tp, err: err}
					return
				}
			}
			r, err := w.startPartition(ctx, k, w.applied.Token, w.applied.Generation, tp, start, paused[tp], ids[tp.Topic], dead.cause)
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

// publishOwned makes the running partitions visible to Agent.Owned and
// the metrics.
func (w *worker) publishOwned() {
	on := map[string][]coordinator.TopicPartition{}
	for cp := range w.parts {
		on[cp.Cluster] = append(on[cp.Cluster], cp.TopicPartition)
	}
	for _, tps := range on {
		slices.SortFunc(tps, coordinator.TopicPartition.Compare)
	}
	w.owned.Store(&on)
	w.metrics.ownedPartitions.Set(float64(len(w.parts)))
}

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
func (w *worker) sharePacer(a coordinator.Assignment, mine int) {
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
func (w *worker) commitUnder(ctx context.Context, tps []cpart, a coordinator.Assignment, rev int64) error {
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
	ask := map[string][]kafka.TopicPartition{} // by cluster: still partitions whose end is due to be asked
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
			ask[cp.Cluster] = append(ask[cp.Cluster], kafka.TopicPartition{Topic: cp.Topic, Partition: cp.Partition})
			r.endAt = now
		}
	}
	for c, tps := range ask {
		// One request per broker for all of them (an idle agent's
		// partitions all stand still).
		ends, _ := kafka.EndOffsets(w.conns[c].client, tps)
		for tp, end := range ends {
			if r := w.parts[cpart{Cluster: c, TopicPartition: coordinator.TopicPartition{Topic: tp.Topic, Partition: tp.Partition}}]; r != nil {
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
	st, err := coordinator.ParseStalled(resp.Kvs[0].Value)
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
		len(st.Partitions), coordinator.StalledAfter, st.Leader, st.String(now))
	return w.idleReason
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
	byTP := map[coordinator.TopicPartition]offsets.Commit{}
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

// applySignals pauses and resumes the running partitions to match the
// signals in force, and measures how long after the watcher saw a pause
// every affected partition had stopped delivering.
func (w *worker) applySignals(ctx context.Context) {
	state := w.signals.State()
	seen := time.Time{}
	for _, s := range state.Signals() {
		if s.Seen.After(seen) {
			seen = s.Seen
		}
	}
	var parked []<-chan struct{}
	for tp, r := range w.parts {
		paused, scope := state.Paused(r.logical, w.id)
		if paused == r.gate.isPaused() {
			continue
		}
		parked = append(parked, r.gate.set(paused))
		if paused {
			r.fp.Pause()
			w.log.Info("partition paused", zap.Stringer("partition", tp), zap.Stringer("scope", scope))
		} else {
			r.fp.Resume()
			w.log.Info("partition resumed", zap.Stringer("partition", tp))
		}
	}
	w.metrics.setPaused(state)
	rev := state.Revision()
	if len(parked) == 0 || seen.IsZero() {
		w.signalsApplied.Store(rev)
		return
	}
	// The partitions park when their loops next reach the gate: at once,
	// or after the record being handed to the handler. Measure it without
	// holding up the worker.
	w.bg.Add(1)
	go func() {
		defer w.bg.Done()
		for _, ch := range parked {
			select {
			case <-ch:
			case <-ctx.Done():
				return
			}
		}
		w.metrics.signalApply.Observe(time.Since(seen).Seconds())
		// Later revisions may have been applied meanwhile: never go back.
		for {
			cur := w.signalsApplied.Load()
			if cur >= rev || w.signalsApplied.CompareAndSwap(cur, rev) {
				break
			}
		}
	}()
}

// ack tells the leader this agent has applied gen. A failed write is
// tried again on the next commit ticks (ackDue).
func (w *worker) ack(ctx context.Context, gen int64) {
	var err error
	if w.ackFails != nil {
		err = w.ackFails(gen)
	}
	if err == nil {
		actx, cancel := context.WithTimeout(ctx, w.cfg.Etcd.RequestTimeout)
		_, err = w.etcd.Put(actx, w.keys.Ack(w.id), strconv.FormatInt(gen, 10), clientv3.WithLease(w.lease))
		cancel()
	}
	if err != nil {
		if w.ackDue != gen {
			w.log.Warn("cannot acknowledge generation; trying again at the next commit tick", zap.Int64("generation", gen), zap.Error(err))
		}
		w.ackDue = gen
		return
	}
	if w.ackDue != 0 {
		w.log.Info("acknowledged generation", zap.Int64("generation", gen))
	}
	w.ackDue = 0
}

// deadLetterInterval is how often the worker publishes its handler's
// dead-letter counts when they changed.
const deadLetterInterval = time.Second

// publishDeadLetters writes the handler's dead-letter counts to
// deadletters/<id> on the session lease whenever they changed, at most
// every deadLetterInterval, until ctx ends: a staged move's check reads
// them (coordinator.ParseDeadLetters).
func (w *worker) publishDeadLetters(ctx context.Context, counts func() map[string]int64) {
	tick := time.NewTicker(deadLetterInterval)
	defer tick.Stop()
	var last map[string]int64
	for {
		if counts := counts(); !maps.Equal(counts, last) {
			val, err := json.Marshal(counts)
			if err == nil {
				pctx, cancel := context.WithTimeout(ctx, w.cfg.Etcd.RequestTimeout)
				_, err = w.etcd.Put(pctx, w.keys.DeadLetterCount(w.id), string(val), clientv3.WithLease(w.lease))
				cancel()
			}
			if err == nil {
				last = counts
			} else if ctx.Err() == nil {
				w.log.Debug("cannot publish the dead-letter counts; trying again", zap.Error(err))
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
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

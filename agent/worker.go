package agent

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

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
	"github.com/kswitch/kswitch/state"
)

// cpart names a partition of one cluster: the worker's partitions are
// keyed so, as A's orders/0 and B's orders/0 are different streams.
type cpart = state.ClusterPartition

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
	owned  *atomic.Pointer[map[string][]state.TopicPartition]
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
	restartFails func(cluster string, tp state.TopicPartition) error
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

	// warmed receives the outcome of the dial in flight (at most one:
	// dial).
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
	// warming names the cluster of the dial in flight (a warm-up or a
	// connection to consume from), "" if none; warmAck is the generation
	// to acknowledge when a warm-up ends (0: none).
	warming    string
	warmAck    int64
	parts      map[cpart]*partitionRun
	committed  map[cpart]int64
	pending    []cpart // owned but not started (Kafka trouble): retried
	applied    state.Assignment
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
func (w *worker) initialOffset(cluster string, tp state.TopicPartition) int64 {
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
		w.closeConns()
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

// closeConns closes the session's Kafka connections, those warmed ahead of
// a switch included, once nothing uses them, and shows nothing owned.
func (w *worker) closeConns() {
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

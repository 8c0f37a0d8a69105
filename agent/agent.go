package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/coordinator"
	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/etcdclient"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/internal/testhooks"
	"github.com/kswitch/kswitch/internal/version"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/signals"
	"github.com/kswitch/kswitch/state"
)

// Options are the parts of an agent that are not configuration.
type Options struct {
	// Logger receives the agent's logs; every line carries the agent id.
	// Default: no logging.
	Logger *zap.Logger
	// Handler receives the records of the partitions this agent owns.
	// Default: a CountingHandler that logs at debug level.
	Handler record.Handler
	// DrainTimeout bounds how long a revoked partition waits for the
	// handler to acknowledge the records it was given before the
	// partition's final commit. Default 5s.
	DrainTimeout time.Duration
	// HandlerStatus, when set, is shown as "handler" in /status: the
	// routing sink reports its rules version and channels through it. It
	// must be safe to call from any goroutine and must not block.
	HandlerStatus func() any
	// DeadLetters, when set, returns the records the handler sent to a
	// dead-letter channel by logical topic (the routing sink's); when nil
	// and Handler is a record.DeadLetterCounter, its counts. The agent
	// publishes them for a staged move's health check.
	DeadLetters func() map[string]int64
	// Released, when set, is called once the agent has given a partition
	// up (revoked, or its session lost) and stopped handing its records
	// on: after they were all acknowledged, or its drain timed out, and
	// after its final position was committed (revoked). The
	// records not acknowledged by then are consumed again by the
	// partition's next owner, so a handler that still holds some must
	// drop them and never deliver them (the routing sink's exactly_once
	// transactions). The next owner may start once it returns.
	Released func(p record.Owned)
	// DeliveryProblem, when set, says why the handler's records do not
	// reach where they go, or "" when they do (routing.Router's
	// DeliveryProblem, with StuckAfter as after): readiness reports it.
	// Default: the Handler's own DeliveryProblem method, if it has one.
	DeliveryProblem func(after time.Duration) string
	// StuckAfter is how long a partition's committable position may stand
	// still while records handed to the handler wait for their
	// acknowledgement before the agent reports the handler stuck
	// (/readyz 503, kswitch_stuck_partitions). Default: 30 s or ten
	// commit intervals, whichever is longer.
	StuckAfter time.Duration
	// OnConfig, when set, is called with the configuration in force each
	// time a dynamic configuration version (source and clusters from etcd,
	// accepted by the leader) is applied: the routing sink takes the new
	// cluster definitions from it. It must not block.
	OnConfig func(config.Config)
	// Etcd, when set, is the etcd client the agent uses instead of one of
	// its own from cfg.Etcd, so that a program sharing the process (the
	// routing sink of kswitch agent) needs no second one. The caller
	// closes it after Stop; Abort closes it, as a crash ends every
	// connection of the process.
	Etcd *clientv3.Client

	// hooks are set by the agent's own tests and benchmarks
	// (export_test.go).
	hooks hooks
}

// hooks are what the agent's tests and benchmarks change in an agent.
type hooks struct {
	// KafkaDialer, when set, returns the dialer for the connections of
	// this agent to a cluster (probes, consumers, discovery): a test cuts
	// one agent off one cluster with it.
	KafkaDialer func(cluster string) kafka.Dialer
	// BreakBeforeMake, on the agent that leads, turns off the preparation
	// of planned switches (coordinator.LeaderOptions.BreakBeforeMake): the
	// baseline of the planned-switch benchmark.
	BreakBeforeMake bool
	// NoCommitHold turns off the hold of delivery while commits fail
	// (commitHold): the baseline of BenchmarkEtcdOutage.
	NoCommitHold bool
	// HTTPIdleTimeout and HTTPMaxConns, when set, replace
	// httpIdleTimeout and httpMaxConns.
	HTTPIdleTimeout time.Duration
	HTTPMaxConns    int
	// RestartFails, when set, is asked before a partition whose consumer
	// ended (or whose topic was created again) starts again: an error
	// fails that start as a failed ListOffsets would, so the partition
	// stays dead and its start is tried again at the next commit tick.
	RestartFails func(cluster string, tp state.TopicPartition) error
	// AckFails, when set, is asked before each write of an
	// acknowledgement: an error fails that write as etcd would.
	AckFails func(gen int64) error
	// EtcdProbed, when set, is called by the etcd probe after each read
	// of the agent's registration returns (found: the read saw it) and
	// before it is judged; Registering before each registration is
	// written. A test orders a read before a registration and its
	// judgement after.
	EtcdProbed  func(found bool)
	Registering func()
}

// Agent is one member of a fleet. Its exported methods are safe for
// concurrent use.
type Agent struct {
	cfg  config.Config
	id   string
	keys keys.Fleet
	log  *zap.Logger
	opts Options

	reg           *prometheus.Registry
	metrics       *metrics
	leaderMetrics *coordinator.Metrics
	// digest is what the registration says of the configuration;
	// configDisagree the leader's count of agents whose digest differs.
	digest         state.ConfigDigest
	configDisagree prometheus.Gauge

	started time.Time

	// Set by Start.
	client   *clientv3.Client
	cand     *election.Candidate
	observer *election.Observer
	registry *registry
	// vouch checks the registrations' proofs while this agent leads.
	vouch   *vouchers
	store   *offsets.Store
	signals *signals.Watcher
	leader  *coordinator.Leader
	ml      *memberlist.Memberlist
	mlog    *memberlistLog
	// gossipAddr is set once by Start.
	gossipAddr string
	gossip     *gossipState
	prober     *prober
	httpLn     net.Listener
	httpSrv    *http.Server
	cancel     context.CancelFunc
	wg         sync.WaitGroup
	aborted    atomic.Bool
	stopOnce   sync.Once
	// sessionDone closes when the session loop has returned: on a clean
	// stop, partitions are committed and the lease released by then.
	sessionDone chan struct{}

	// gossipKeyed is closed once gossip has its keys (at once from a key
	// file or without encryption; from etcd by gossipKeyLoop); the agent
	// joins gossip only then. gossipKeyErr is why the fleet's key could
	// not be read, "" or nil when it could.
	gossipKeyed  chan struct{}
	gossipKeyErr atomic.Pointer[string]
	// viewRefusals are the gossip views the leader's last turn refused.
	viewRefusals viewRefusals

	// Readiness inputs, written by their loops.
	etcdErr    atomic.Pointer[string] // last etcd probe error; nil or "" = reachable
	session    atomic.Pointer[sessionState]
	lastLeader election.Leader
	owned      atomic.Pointer[map[string][]state.TopicPartition] // by cluster; set by the worker
	budget     atomic.Pointer[byteBudget]                        // the current worker's bytes in flight
	current    atomic.Pointer[concurrency.Session]               // while registered
	active     atomic.Pointer[string]                            // cluster of the applied assignment
	hold       atomic.Pointer[commitHold]                        // the current worker's
	stuck      atomic.Pointer[string]                            // the current worker's stuck partitions, "" if none
	// dyn is the dynamic configuration version in force.
	dyn dynConfig
	// rate measures the records handed to the handler per second.
	rate rateMeter
	// signalsApplied is the etcd revision of the signals every running
	// partition of this agent obeys.
	signalsApplied atomic.Int64
}

// New checks cfg and returns an agent that is not started. cfg is copied.
func New(cfg config.Config, opts Options) (*Agent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := opts.Logger
	if log == nil {
		log = zap.NewNop()
	}
	log = log.With(zap.String("agent", cfg.Agent.ID), zap.String("fleet", cfg.Fleet))
	if opts.Handler == nil {
		opts.Handler = &CountingHandler{Log: log}
	}
	if opts.StuckAfter <= 0 {
		opts.StuckAfter = max(30*time.Second, 10*cfg.Source.CommitInterval)
	}
	if opts.DrainTimeout <= 0 {
		opts.DrainTimeout = 5 * time.Second
	}
	reg := prometheus.NewRegistry()
	a := &Agent{
		cfg:     cfg,
		id:      cfg.Agent.ID,
		keys:    keys.New(cfg.Fleet),
		log:     log,
		opts:    opts,
		reg:     reg,
		metrics: newMetrics(reg),
	}
	a.leaderMetrics = coordinator.NewMetrics(reg)
	a.digest, a.configDisagree = state.DigestConfig(cfg), newConfigDisagreeGauge(reg)
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kswitch_in_flight_bytes",
		Help: "Bytes (keys, values, headers) of the records handed to the handler and not yet acknowledged; bounded by source.max_in_flight_mib.",
	}, func() float64 { return float64(a.budget.Load().inUse()) }))
	a.dyn.cfg = cfg
	a.session.Store(&sessionState{reason: "starting: not yet registered in etcd"})
	unknown := "not yet checked"
	a.etcdErr.Store(&unknown)
	return a, nil
}

// ID returns the agent id.
func (a *Agent) ID() string { return a.id }

// Start binds the HTTP and gossip listeners, creates the etcd client and
// starts the agent's loops. It does not wait for etcd: an agent whose etcd
// is unreachable runs, reports itself unready, and keeps retrying. ctx
// only bounds Start itself; use Stop or Abort to end the agent.
func (a *Agent) Start(ctx context.Context) (err error) {
	if a.cancel != nil {
		return errors.New("agent: already started")
	}
	a.started = time.Now()
	// undo holds what Start has opened, closed in reverse if a later step
	// fails: one cleanup path for every error.
	var undo []func()
	defer func() {
		if err != nil {
			for _, f := range slices.Backward(undo) {
				f()
			}
		}
	}()
	ln, err := a.listenHTTP()
	if err != nil {
		return err
	}
	undo = append(undo, func() { ln.Close() })
	// The client's own logs are errors only: it logs every retry at warn,
	// and the agent reports etcd trouble itself, once, through readiness.
	client := a.opts.Etcd
	if client == nil {
		if client, err = etcdclient.New(context.WithoutCancel(ctx), a.cfg.Etcd, a.log); err != nil {
			return fmt.Errorf("agent: %w", err)
		}
	}
	undo = append(undo, func() { a.closeOwnClient(client) })
	a.mlog = &memberlistLog{log: a.log.Named("gossip")}
	a.gossip = &gossipState{dead: make(chan string, 64), dropped: func() { a.metrics.gossipDropped.Inc() }}
	healthChanged := make(chan struct{}, 1)
	a.prober = newProber(a.cfg, a.log, a.opts.hooks.KafkaDialer, func() {
		select {
		case healthChanged <- struct{}{}:
		default:
		}
	})
	keys, fromEtcd, err := a.startingGossipKeys()
	if err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	ml, keyring, err := newMemberlist(gossipOptions{id: a.id, bind: a.cfg.Agent.Gossip, advertise: a.cfg.Agent.GossipAdvertise,
		label: "kswitch/" + a.cfg.Fleet, keys: keys}, a.mlog, a.gossip, &healthMeta{views: a.prober.view})
	if err != nil {
		return err
	}
	undo = append(undo, func() { _ = ml.Shutdown() })
	cand, err := election.NewCandidate(election.Config{Prefix: a.keys.Election(), ID: a.id, Logger: a.log})
	if err != nil {
		return err
	}
	a.client, a.ml, a.httpLn, a.cand = client, ml, ln, cand
	// memberlist rewrites its local node on every metadata update, so
	// the address is read once, before anything runs concurrently.
	n := ml.LocalNode()
	a.gossipAddr = net.JoinHostPort(n.Addr.String(), fmt.Sprint(n.Port))
	if err := a.build(client); err != nil {
		return err
	}
	a.runAll(ctx, keyring, fromEtcd, healthChanged)
	a.log.Info("agent started", zap.String("http", a.HTTPAddr()), zap.String("gossip", a.GossipAddr()),
		zap.Strings("etcd", a.cfg.Etcd.Endpoints), zap.String("version", version.Version))
	return nil
}

// build makes the parts of the agent that read and write etcd through
// client: membership, positions, signals, the leader's side.
func (a *Agent) build(client *clientv3.Client) (err error) {
	a.observer = election.NewObserver(client, a.keys.Election(), a.cfg.Etcd.RequestTimeout, a.log)
	a.registry = newRegistry(client, a.keys, a.cfg.Etcd.RequestTimeout, a.log, func() { a.metrics.badValues.WithLabelValues("registration").Inc() })
	a.vouch = &vouchers{self: a.selfLease, ask: a.askProof, log: a.log.Named("members"), results: map[vouchKey]vouchResult{}}
	a.store = offsets.NewStore(client, a.keys)
	a.signals = signals.NewWatcher(client, a.keys, a.cfg.Etcd.RequestTimeout, a.log)
	a.signals.OnRefused(func(signals.Refusal) { a.metrics.badValues.WithLabelValues(refused.Signal).Inc() })
	if a.leader, err = coordinator.NewLeader(a.cfg, client, fleetView{a}, coordinator.LeaderOptions{Logger: a.log,
		Metrics: a.leaderMetrics, Hooks: &testhooks.Leader{Dialer: a.opts.hooks.KafkaDialer, BreakBeforeMake: a.opts.hooks.BreakBeforeMake}}); err != nil {
		return err
	}
	a.httpSrv = a.newHTTPServer()
	return nil
}

// runAll starts the agent's goroutines, ended by Stop through a.cancel.
func (a *Agent) runAll(ctx context.Context, keyring *memberlist.Keyring, fromEtcd bool, healthChanged chan struct{}) {
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	a.cancel = cancel
	a.goRun(func() {
		if err := a.httpSrv.Serve(a.httpLn); err != nil && !errors.Is(err, http.ErrServerClosed) {
			a.log.Error("http server failed", zap.Error(err))
		}
	})
	a.sessionDone = make(chan struct{})
	a.goRun(func() {
		defer close(a.sessionDone)
		a.sessionLoop(runCtx)
	})
	a.goRun(func() { _ = a.observer.Run(runCtx) })
	a.goRun(func() { a.registry.run(runCtx) })
	if fromEtcd {
		a.goRun(func() { a.gossipKeyLoop(runCtx, keyring) })
	}
	a.goRun(func() { a.gossipJoinLoop(runCtx, 5*time.Second) })
	a.goRun(func() { a.probeEtcdLoop(runCtx) })
	a.goRun(func() { a.leaderChangeLoop(runCtx) })
	a.goRun(func() { a.prober.run(runCtx) })
	a.goRun(func() { a.followConfig(runCtx) })
	a.goRun(func() { _ = a.signals.Run(runCtx) })
	a.goRun(func() { a.gossipHealthLoop(runCtx, healthChanged, 5*time.Second) })
	a.goRun(func() { a.rate.run(runCtx) })
}

func (a *Agent) goRun(f func()) {
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		f()
	}()
}

// Run starts the agent, runs it until ctx ends, then stops it cleanly
// within stopTimeout.
func (a *Agent) Run(ctx context.Context, stopTimeout time.Duration) error {
	if err := a.Start(ctx); err != nil {
		return err
	}
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), stopTimeout)
	defer cancel()
	return a.Stop(sctx)
}

// Stop ends the agent cleanly: leader work ends and it resigns (a
// successor is elected at once), the registration and session lease are
// released, the agent leaves the gossip cluster, HTTP stops. It waits for
// every goroutine of the agent, or until ctx ends. Safe to call twice and
// after Abort.
func (a *Agent) Stop(ctx context.Context) error {
	return a.stop(ctx, false)
}

// Abort ends the agent as a crash would: the etcd client (also one given
// in Options.Etcd) is closed first,
// so nothing is resigned or revoked (the lease expires after its TTL) and
// the gossip cluster is not told (its failure detector notices). It waits
// for the agent's goroutines. For tests and fault drills.
func (a *Agent) Abort() {
	_ = a.stop(context.Background(), true)
}

func (a *Agent) stop(ctx context.Context, abort bool) error {
	if a.cancel == nil {
		return nil
	}
	var err error
	a.stopOnce.Do(func() {
		if abort {
			a.aborted.Store(true)
			a.client.Close() // in-flight and future requests fail at once
			_ = a.ml.Shutdown()
			a.httpSrv.Close()
		}
		a.cancel() // the session loop resigns and releases its lease
		done := make(chan struct{})
		go func() {
			a.wg.Wait()
			a.leader.Wait() // its calls to Kafka and evictions outlive a term by one bounded call
			close(done)
		}()
		// Leave gossip only once the session loop has committed and
		// released the lease: the leader evicts agents that leave gossip
		// while still registered.
		if !abort {
			select {
			case <-a.sessionDone:
			case <-ctx.Done():
			}
			if lerr := a.ml.Leave(time.Second); lerr != nil {
				a.log.Debug("gossip leave", zap.Error(lerr))
			}
			_ = a.ml.Shutdown()
			sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			_ = a.httpSrv.Shutdown(sctx)
			cancel()
		}
		select {
		case <-done:
		case <-ctx.Done():
			err = fmt.Errorf("agent: stop: %w (goroutines still running)", ctx.Err())
			return
		}
		if !abort {
			a.closeOwnClient(a.client)
		}
		a.mlog.close()
		a.log.Info("agent stopped", zap.Bool("aborted", abort))
	})
	return err
}

// closeOwnClient closes c unless it was given in Options.Etcd.
func (a *Agent) closeOwnClient(c *clientv3.Client) {
	if a.opts.Etcd == nil {
		c.Close()
	}
}

// Package agent runs one kswitch agent: it registers in etcd on its
// session lease, campaigns for leadership, joins the fleet's gossip
// cluster using the registered agents as seeds, and serves its health,
// status and metrics over HTTP.
//
// An agent is embeddable: New, then Start (binds its listeners and
// returns), then Stop (clean: resigns, deregisters, leaves gossip) or
// Abort (as a crash would: nothing is released, etcd's lease TTL and
// gossip's failure detection clean up). Run combines them for cmd/.
package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"runtime/pprof"
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
	"github.com/kswitch/kswitch/internal/dynconfig"
	"github.com/kswitch/kswitch/internal/etcdclient"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/internal/version"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/signals"
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
	RestartFails func(cluster string, tp coordinator.TopicPartition) error
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
	digest         ConfigDigest
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
	owned      atomic.Pointer[map[string][]coordinator.TopicPartition] // by cluster; set by the worker
	budget     atomic.Pointer[byteBudget]                              // the current worker's bytes in flight
	current    atomic.Pointer[concurrency.Session]                     // while registered
	active     atomic.Pointer[string]                                  // cluster of the applied assignment
	hold       atomic.Pointer[commitHold]                              // the current worker's
	stuck      atomic.Pointer[string]                                  // the current worker's stuck partitions, "" if none
	// dyn is the dynamic configuration version in force.
	dyn dynConfig
	// rate measures the records handed to the handler per second.
	rate rateMeter
	// signalsApplied is the etcd revision of the signals every running
	// partition of this agent obeys.
	signalsApplied atomic.Int64
}

// sessionState is the agent's standing in etcd.
type sessionState struct {
	registered bool
	lease      clientv3.LeaseID
	revision   int64  // etcd revision of the registration's write
	reason     string // why not registered
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
	a.digest, a.configDisagree = DigestConfig(cfg), newConfigDisagreeGauge(reg)
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
func (a *Agent) Start(ctx context.Context) error {
	if a.cancel != nil {
		return errors.New("agent: already started")
	}
	a.started = time.Now()
	ln, err := a.listenHTTP()
	if err != nil {
		return err
	}
	// The client's own logs are errors only: it logs every retry at warn,
	// and the agent reports etcd trouble itself, once, through readiness.
	client := a.opts.Etcd
	if client == nil {
		if client, err = etcdclient.New(context.WithoutCancel(ctx), a.cfg.Etcd, a.log); err != nil {
			ln.Close()
			return fmt.Errorf("agent: %w", err)
		}
	}
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
		a.closeOwnClient(client)
		ln.Close()
		return fmt.Errorf("agent: %w", err)
	}
	ml, keyring, err := newMemberlist(gossipOptions{id: a.id, bind: a.cfg.Agent.Gossip, advertise: a.cfg.Agent.GossipAdvertise,
		label: "kswitch/" + a.cfg.Fleet, keys: keys}, a.mlog, a.gossip, &healthMeta{views: a.prober.view})
	if err != nil {
		a.closeOwnClient(client)
		ln.Close()
		return err
	}
	cand, err := election.NewCandidate(election.Config{Prefix: a.keys.Election(), ID: a.id, Logger: a.log})
	if err != nil {
		ml.Shutdown()
		a.closeOwnClient(client)
		ln.Close()
		return err
	}
	a.client, a.ml, a.httpLn, a.cand = client, ml, ln, cand
	// memberlist rewrites its local node on every metadata update, so
	// the address is read once, before anything runs concurrently.
	n := ml.LocalNode()
	a.gossipAddr = net.JoinHostPort(n.Addr.String(), fmt.Sprint(n.Port))
	a.observer = election.NewObserver(client, a.keys.Election(), a.cfg.Etcd.RequestTimeout, a.log)
	a.registry = newRegistry(client, a.keys, a.cfg.Etcd.RequestTimeout, a.log, func() { a.metrics.badValues.WithLabelValues("registration").Inc() })
	a.vouch = &vouchers{self: a.selfLease, ask: a.askProof, log: a.log.Named("members"), results: map[vouchKey]vouchResult{}}
	a.store = offsets.NewStore(client, a.keys)
	a.signals = signals.NewWatcher(client, a.keys, a.cfg.Etcd.RequestTimeout, a.log)
	a.signals.OnRefused(func(signals.Refusal) { a.metrics.badValues.WithLabelValues(refused.Signal).Inc() })
	if a.leader, err = coordinator.NewLeader(a.cfg, client, fleetView{a}, coordinator.LeaderOptions{Background: &a.wg, Logger: a.log,
		Dialer: a.opts.hooks.KafkaDialer, Metrics: a.leaderMetrics, BreakBeforeMake: a.opts.hooks.BreakBeforeMake}); err != nil {
		ml.Shutdown()
		a.closeOwnClient(client)
		ln.Close()
		return err
	}
	a.httpSrv = a.newHTTPServer()

	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	a.cancel = cancel
	a.goRun(func() {
		if err := a.httpSrv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
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
	a.log.Info("agent started", zap.String("http", a.HTTPAddr()), zap.String("gossip", a.GossipAddr()),
		zap.Strings("etcd", a.cfg.Etcd.Endpoints), zap.String("version", version.Version))
	return nil
}

// startingGossipKeys returns the keys gossip starts with: the key file's;
// none with agent.gossip_encryption off; else (fromEtcd) a placeholder
// alone, a key nobody else has, until gossipKeyLoop puts the fleet's key
// from etcd in its place. It makes a.gossipKeyed, closed unless the
// fleet's key is still to be read.
func (a *Agent) startingGossipKeys() (keys [][]byte, fromEtcd bool, err error) {
	a.gossipKeyed = make(chan struct{})
	switch keys, err = a.cfg.Agent.GossipKeys(); {
	case err != nil:
		return nil, false, err
	case keys != nil:
	case a.cfg.Agent.GossipEncryption == "off":
		a.log.Warn("gossip is not encrypted (agent.gossip_encryption: off): whoever reaches the gossip port can forge views and deaths")
	default:
		placeholder, err := newGossipKey()
		if err != nil {
			return nil, false, err
		}
		return [][]byte{placeholder}, true, nil
	}
	close(a.gossipKeyed)
	return keys, false, nil
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

// Signals returns the signals in force as this agent has read them from
// etcd: what the routing sink pauses channels by. Call it from the
// handler or after Start returned; before Start no signal is in force.
func (a *Agent) Signals() signals.State {
	if a.signals == nil {
		return signals.State{}
	}
	return a.signals.State()
}

// HTTPAddr returns the address the HTTP listener is bound to (useful when
// agent.http has port 0). Valid after Start.
func (a *Agent) HTTPAddr() string { return a.httpLn.Addr().String() }

// httpAdvertised is the HTTP address other agents use to reach this one,
// written in its registration: the bound address, or, when it is bound to
// every interface (0.0.0.0:8080, the usual setting in a container), the
// same port on the host gossip advertises (agent.gossip_advertise, else
// the private address memberlist picked). A wildcard address in the
// registration would make the leader, asking an agent who it is, ask
// itself.
func (a *Agent) httpAdvertised() string {
	bound := a.HTTPAddr()
	host, port, err := net.SplitHostPort(bound)
	if err != nil {
		return bound
	}
	if ip := net.ParseIP(host); host != "" && (ip == nil || !ip.IsUnspecified()) {
		return bound
	}
	ghost, _, err := net.SplitHostPort(a.GossipAddr())
	if err != nil || ghost == "" {
		return bound
	}
	return net.JoinHostPort(ghost, port)
}

// GossipAddr returns the host:port other agents use to reach this agent's
// gossip. Valid after Start.
func (a *Agent) GossipAddr() string { return a.gossipAddr }

// Ready reports whether the agent is connected to etcd and registered, and
// why not otherwise.
func (a *Agent) Ready() (bool, string) {
	s := a.session.Load()
	if e := *a.etcdErr.Load(); e != "" {
		return false, e
	}
	if !s.registered {
		return false, s.reason
	}
	if e := a.gossipKeyErr.Load(); e != nil && *e != "" {
		return false, *e
	}
	if r := a.stuck.Load(); r != nil && *r != "" {
		return false, *r
	}
	if p := a.deliveryProblem(); p != "" {
		return false, p
	}
	if h := a.hold.Load(); h != nil {
		if since := h.failingSince(); !since.IsZero() {
			return false, fmt.Sprintf("commits to etcd have not succeeded for %s: delivery held, so that a crash now delivers no more records again",
				time.Since(since).Round(time.Millisecond))
		}
	}
	if p := a.active.Load(); p != nil && a.prober != nil {
		view := a.prober.view()
		if v, ok := view[*p]; ok && !v.Reachable {
			return false, fmt.Sprintf("cannot reach the active cluster %s: %s", *p, v.Error)
		}
		for _, c := range slices.Sorted(maps.Keys(a.OwnedByCluster())) {
			if v, ok := view[c]; ok && !v.Reachable && c != *p {
				return false, fmt.Sprintf("cannot reach cluster %s, where topics this agent consumes are placed: %s", c, v.Error)
			}
		}
	}
	return true, ""
}

// deliveryProblem is why the handler's records do not reach where they
// go, or "".
func (a *Agent) deliveryProblem() string {
	f := a.opts.DeliveryProblem
	if f == nil {
		dr, ok := a.opts.Handler.(interface{ DeliveryProblem(time.Duration) string })
		if !ok {
			return ""
		}
		f = dr.DeliveryProblem
	}
	if p := f(a.opts.StuckAfter); p != "" {
		return "records do not reach their channels: " + p
	}
	return ""
}

// Leading reports whether this agent leads the fleet now.
func (a *Agent) Leading() bool { return a.cand != nil && a.cand.Leading() }

// LeaderView returns who leads, as this agent sees it.
func (a *Agent) LeaderView() LeaderView {
	l, ok := a.observer.Leader()
	return leaderView(a.id, a.Leading(), l, ok)
}

// leaderView is LeaderView of agent id, whose leader work runs (leading)
// or not, when etcd's election names l (ok) or nobody. An agent leads when
// its leader work runs and etcd does not name another: a leader whose term
// etcd has ended (its lease expired while it was stopped or cut off) can
// see its successor's election key before its own work notices the end,
// and must not claim the successor's term meanwhile (its writes are
// fenced already).
func leaderView(id string, leading bool, l election.Leader, ok bool) LeaderView {
	v := LeaderView{Agent: id, Self: leading && (!ok || l.ID == id)}
	if ok {
		v.Leader, v.FencingToken = l.ID, l.Token
	}
	return v
}

// Status returns the agent's view of the fleet.
func (a *Agent) Status() Status {
	ok, reason := a.Ready()
	s := a.session.Load()
	st := Status{
		Agent: a.id, Fleet: a.cfg.Fleet, Version: version.Version, Started: a.started,
		Ready: ok, ReadyReason: reason,
		Leader: a.LeaderView(),
		Agents: a.registry.list(),
		Gossip: a.gossip.members(),
		Etcd: EtcdStatus{
			Endpoints: a.cfg.Etcd.Endpoints, Reachable: *a.etcdErr.Load() == "",
			LastError: *a.etcdErr.Load(), LeaseID: int64(s.lease),
		},
		Clusters:       a.gossip.views(),
		Signals:        a.signals.State(),
		SignalsApplied: a.SignalsApplied(),
		Active:         deref(a.active.Load()),
		Config:         a.dyn.status(),
		ConfigDigest:   a.digest,
	}
	st.ConfigDisagree = CompareConfigs(st.Agents, st.Leader.Leader)
	for c, tps := range a.OwnedByCluster() {
		if c == st.Active {
			st.Owned = tps
			continue
		}
		if st.OwnedOn == nil {
			st.OwnedOn = map[string][]coordinator.TopicPartition{}
		}
		st.OwnedOn[c] = tps
	}
	if a.Leading() {
		st.Coordinator = a.leader.Status()
	}
	if a.opts.HandlerStatus != nil {
		st.Handler = a.opts.HandlerStatus()
	}
	return st
}

func deref(p *string) string {
	if p == nil {
		return ""
	}
	return *p
}

// GossipMembers returns the live and suspect gossip members.
func (a *Agent) GossipMembers() []GossipMember { return a.gossip.members() }

// Registered returns the agents registered in etcd, as this agent sees them.
func (a *Agent) Registered() []Registration { return a.registry.list() }

// SignalsApplied returns the etcd revision of the pause/start signals that
// every partition this agent runs obeys: once it is at least the revision
// of a pause's write, no record of the paused scope is handed to the
// handler any more.
func (a *Agent) SignalsApplied() int64 { return a.signalsApplied.Load() }

// Owned returns the partitions this agent consumes now, on every cluster,
// sorted (OwnedByCluster tells them apart).
func (a *Agent) Owned() []coordinator.TopicPartition {
	var out []coordinator.TopicPartition
	for _, tps := range a.OwnedByCluster() {
		out = append(out, tps...)
	}
	slices.SortFunc(out, coordinator.TopicPartition.Compare)
	return out
}

// OwnedByCluster returns the partitions this agent consumes now, by
// cluster, each list sorted.
func (a *Agent) OwnedByCluster() map[string][]coordinator.TopicPartition {
	if p := a.owned.Load(); p != nil {
		return maps.Clone(*p)
	}
	return nil
}

// Metrics returns the agent's metrics registry.
func (a *Agent) Metrics() *prometheus.Registry { return a.reg }

func (a *Agent) setSession(s sessionState) {
	a.session.Store(&s)
	a.updateReady()
}

func (a *Agent) updateReady() {
	ok, _ := a.Ready()
	if ok {
		a.metrics.ready.Set(1)
	} else {
		a.metrics.ready.Set(0)
	}
}

// sessionLoop keeps the agent registered and campaigning: one etcd session
// at a time; when it ends (lease expired or revoked, etcd unreachable past
// the TTL) the agent is unready until a new session is registered.
func (a *Agent) sessionLoop(ctx context.Context) {
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		began := time.Now()
		err := a.runSession(ctx)
		if ctx.Err() != nil {
			return
		}
		a.setSession(sessionState{reason: err.Error()})
		a.log.Warn("etcd session ended; re-registering", zap.Error(err), zap.Duration("backoff", backoff))
		if time.Since(began) > a.cfg.Etcd.SessionTTL {
			backoff = 100 * time.Millisecond // the session had worked
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, a.cfg.Etcd.SessionTTL/2)
	}
}

// runSession grants a lease, registers on it and campaigns until the
// session or ctx ends. On a clean stop it resigns, deregisters and revokes
// the lease; after Abort it leaves them to expire.
func (a *Agent) runSession(ctx context.Context) error {
	ttl := int64(a.cfg.Etcd.SessionTTL / time.Second)
	gctx, cancel := context.WithTimeout(ctx, a.cfg.Etcd.RequestTimeout)
	grant, err := a.client.Grant(gctx, ttl)
	cancel()
	if err != nil {
		a.metrics.etcdErrors.WithLabelValues("grant").Inc()
		return fmt.Errorf("etcd: grant session lease: %w", err)
	}
	// Granting the lease ourselves keeps the grant under our timeout; the
	// session then only keeps it alive.
	s, err := concurrency.NewSession(a.client, concurrency.WithTTL(int(ttl)), concurrency.WithLease(grant.ID))
	if err != nil {
		return fmt.Errorf("etcd: session on lease %x: %w", grant.ID, err)
	}
	defer func() {
		if a.aborted.Load() {
			s.Orphan()
			return
		}
		// Revoking the lease deletes the registration and any leader key.
		if err := s.Close(); err != nil {
			a.log.Debug("revoke session lease", zap.Error(err))
		}
	}()
	if a.opts.hooks.Registering != nil {
		a.opts.hooks.Registering()
	}
	regRev, err := a.register(ctx, s.Lease())
	if err != nil {
		return err
	}
	a.current.Store(s)
	defer a.current.Store(nil)
	a.setSession(sessionState{registered: true, lease: s.Lease(), revision: regRev})
	a.log.Info("registered", zap.String("key", a.keys.Agent(a.id)), zap.String("lease", fmt.Sprintf("%x", s.Lease())))

	// The worker consumes while the session lives. On a clean stop it
	// drains and commits before the deferred lease revocation above; when
	// etcd refuses its commits for the lease, it ends the session.
	wctx, wcancel := context.WithCancel(ctx)
	stopW := context.AfterFunc(s.Ctx(), wcancel)
	defer stopW()
	w := a.newWorker(s)
	wdone := make(chan struct{})
	go func() {
		defer close(wdone)
		defer a.dyn.detach(w.reconf)
		if err := w.run(wctx); errors.Is(err, errLeaseLost) {
			s.Orphan()
		}
	}()
	defer func() {
		wcancel()
		<-wdone
	}()

	for {
		err := a.cand.Campaign(ctx, s, a.runLeader)
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case errors.Is(err, election.ErrSessionDone) || s.Ctx().Err() != nil:
			return errors.New("etcd session lease expired or was revoked")
		case err != nil:
			a.log.Warn("campaign failed; retrying", zap.Error(err))
			select {
			case <-ctx.Done():
			case <-s.Done():
			case <-time.After(time.Second):
			}
		}
	}
}

// register writes agents/<id> on the lease and returns the etcd revision
// of that write. It refuses to take over a registration held by another
// live lease: two agents with one id would fight over partitions.
func (a *Agent) register(ctx context.Context, lease clientv3.LeaseID) (int64, error) {
	digest := a.digest
	reg := Registration{ID: a.id, HTTP: a.httpAdvertised(), Gossip: a.GossipAddr(), Version: version.Version, Started: a.started, Config: &digest}
	val, err := json.Marshal(reg)
	if err != nil {
		return 0, fmt.Errorf("agent: encode registration: %w", err)
	}
	key := a.keys.Agent(a.id)
	rctx, cancel := context.WithTimeout(ctx, a.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := a.client.Txn(rctx).
		If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
		Then(clientv3.OpPut(key, string(val), clientv3.WithLease(lease))).
		Else(clientv3.OpGet(key)).Commit()
	if err != nil {
		a.metrics.etcdErrors.WithLabelValues("register").Inc()
		return 0, fmt.Errorf("etcd: register %s: %w", key, etcdclient.Explain(err, a.cfg.Etcd, "write "+key))
	}
	if !resp.Succeeded {
		kvs := resp.Responses[0].GetResponseRange().Kvs
		if len(kvs) > 0 {
			return 0, fmt.Errorf("agent id %q is already registered by another process (lease %x); "+
				"give every agent a unique agent.id, or wait up to etcd.session_ttl (%s) after a crash",
				a.id, kvs[0].Lease, a.cfg.Etcd.SessionTTL)
		}
		return 0, fmt.Errorf("etcd: register %s: raced with a delete; retrying", key)
	}
	return resp.Header.Revision, nil
}

// runLeader is the leader work of one term. Its goroutines, and those
// they start, carry the profiler labels kswitch_agent=<id> and
// kswitch_role=leader, so that a CPU profile of a process shows what
// leading costs.
func (a *Agent) runLeader(ctx context.Context, term election.Term) {
	pprof.Do(ctx, pprof.Labels("kswitch_agent", a.id, "kswitch_role", "leader"), func(ctx context.Context) {
		a.lead(ctx, term)
	})
}

func (a *Agent) lead(ctx context.Context, term election.Term) {
	a.metrics.isLeader.Set(1)
	defer a.metrics.isLeader.Set(0)
	log := a.log.With(zap.Int64("fencing_token", term.Rev))
	log.Info("leading the fleet")
	// The gate validates the dynamic configuration for the length of the
	// term, beside the leader's work.
	gctx, gcancel := context.WithCancel(ctx)
	gate := &dynconfig.Gate{File: a.cfg, Etcd: a.client, Log: log.Named("config"), Live: a.registry.Live, Check: a.leader.CheckConfig,
		OnRefused: func(dynconfig.Refusal) { a.metrics.badValues.WithLabelValues(refused.Config).Inc() }}
	gateDone := make(chan struct{})
	go func() {
		defer close(gateDone)
		if err := gate.Run(gctx, term); err != nil && gctx.Err() == nil {
			log.Warn("configuration gate ended", zap.Error(err))
		}
	}()
	// Agents whose files differ from the fleet's are flagged while this
	// agent leads.
	agreeDone := make(chan struct{})
	go func() {
		defer close(agreeDone)
		a.flagConfigDisagreement(gctx, log)
	}()
	// The registrations are asked for their proofs while this agent
	// leads (coordinator's silence plans only on members).
	vouchDone := make(chan struct{})
	go func() {
		defer close(vouchDone)
		a.vouch.run(gctx, a.registry.list, a.registry.subscribe(gctx))
	}()
	defer func() { gcancel(); <-gateDone; <-agreeDone; <-vouchDone }()
	if err := a.leader.Run(ctx, term); err != nil && ctx.Err() == nil {
		log.Warn("leader work ended", zap.Error(err))
	}
	log.Info("leadership ended")
}

// deadLetters returns the handler's dead-letter counts
// (Options.DeadLetters, else a record.DeadLetterCounter handler's), nil
// when it has none.
func (a *Agent) deadLetters() func() map[string]int64 {
	if a.opts.DeadLetters != nil {
		return a.opts.DeadLetters
	}
	if dl, ok := a.opts.Handler.(record.DeadLetterCounter); ok {
		return dl.DeadLettered
	}
	return nil
}

// fleetView is what the leader work sees of the fleet through this agent:
// registrations from etcd, deaths from gossip.
type fleetView struct{ a *Agent }

func (f fleetView) Live() []string                              { return f.a.registry.Live() }
func (f fleetView) Lease(id string) (clientv3.LeaseID, bool)    { return f.a.registry.Lease(id) }
func (f fleetView) Dead() <-chan string                         { return f.a.gossip.dead }
func (f fleetView) GossipAlive(id string) bool                  { return f.a.gossip.alive(id) }
func (f fleetView) Answers(ctx context.Context, id string) bool { return f.a.answers(ctx, id) }
func (f fleetView) Views() coordinator.AgentViews               { return f.a.memberViews(time.Now()) }
func (f fleetView) Vouched(id string) (coordinator.Proof, string) {
	r, ok := f.a.registry.get(id)
	return f.a.vouch.vouched(r, ok)
}

// Subscribe tells of changes of the registrations and of the gossip views.
func (f fleetView) Subscribe(ctx context.Context) <-chan struct{} {
	ch := f.a.registry.subscribe(ctx)
	f.a.gossip.viewsChanged.Attach(ctx, ch)
	f.a.vouch.changed.Attach(ctx, ch)
	return ch
}

func (a *Agent) newWorker(s *concurrency.Session) *worker {
	reconf := make(chan configUpdate, 1)
	version, cfg := a.dyn.attach(reconf)
	hold := newCommitHold(holdBound(a.cfg.Source.CommitInterval), a.opts.hooks.NoCommitHold)
	a.hold.Store(hold)
	none := ""
	a.stuck.Store(&none)
	budget := newByteBudget(int64(a.cfg.Source.MaxInFlightMiB) << 20)
	a.budget.Store(budget)
	return &worker{
		hold:   hold,
		budget: budget,
		stuck:  &a.stuck, stuckAfter: a.opts.StuckAfter,
		reachable: func(cluster string) bool {
			v, ok := a.prober.view()[cluster]
			return !ok || v.Reachable
		},
		leaderToken: func() (int64, bool) {
			l, ok := a.observer.Leader()
			return l.Token, ok
		},
		reconf: reconf, configVersion: version, clusters: cfg.Clusters, initial: cfg.Source.InitialOffset,
		cfg: a.cfg, id: a.id, keys: a.keys, log: a.log, etcd: a.client, store: a.store,
		handler: a.opts.Handler, released: a.opts.Released, deadLetters: a.deadLetters(), rate: &a.rate, metrics: a.metrics, drain: a.opts.DrainTimeout,
		lease:          s.Lease(),
		sessionAlive:   func() bool { return s.Ctx().Err() == nil },
		owned:          &a.owned,
		dialer:         a.opts.hooks.KafkaDialer,
		restartFails:   a.opts.hooks.RestartFails,
		ackFails:       a.opts.hooks.AckFails,
		naming:         coordinator.NewNaming(cfg),
		signals:        a.signals,
		signalsApplied: &a.signalsApplied,
		active:         &a.active,
	}
}

// probeEtcdLoop checks that etcd answers, every third of the session TTL
// (at most every second), so readiness reflects an outage long before the
// lease would expire.
func (a *Agent) probeEtcdLoop(ctx context.Context) {
	interval := min(a.cfg.Etcd.SessionTTL/3, time.Second)
	t := time.NewTicker(interval)
	defer t.Stop()
	fails := 0
	for {
		pctx, cancel := context.WithTimeout(ctx, a.cfg.Etcd.RequestTimeout)
		resp, err := a.client.Get(pctx, a.keys.Agent(a.id), clientv3.WithCountOnly())
		cancel()
		if a.opts.hooks.EtcdProbed != nil {
			a.opts.hooks.EtcdProbed(err == nil && resp.Count > 0)
		}
		if ctx.Err() != nil {
			return
		}
		if err == nil && resp.Count == 0 {
			// A read served before the registration was written (the
			// probe raced the registration) says nothing about it.
			if s, st := a.current.Load(), a.session.Load(); s != nil && st.registered && resp.Header.Revision >= st.revision {
				// The leader evicted us (gossip thought us dead) or an
				// operator deleted the key: our commits are refused from
				// now on, so end this session and register again.
				a.log.Warn("this agent's registration was deleted; ending the session and registering again")
				s.Orphan()
			}
		}
		msg := ""
		if err != nil {
			a.metrics.etcdErrors.WithLabelValues("probe").Inc()
			fails++
			// One failed request is not an outage: with several
			// endpoints, the client may just be moving off a member that
			// died while the others hold quorum. Refused credentials or
			// access are reported as such, at once.
			switch {
			case etcdclient.AccessDenied(err):
				msg = etcdclient.Explain(err, a.cfg.Etcd, "read "+a.keys.Agent(a.id)).Error()
			case fails >= 2:
				msg = fmt.Sprintf("etcd unreachable at %v: %v", a.cfg.Etcd.Endpoints, err)
			}
		} else {
			fails = 0
		}
		if prev := *a.etcdErr.Swap(&msg); prev != msg {
			if msg != "" {
				a.log.Warn("etcd check failed", zap.String("error", msg))
			} else {
				a.log.Info("etcd reachable")
			}
		}
		a.updateReady()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// leaderChangeLoop logs leader changes and keeps the gauges of the fleet
// view fresh.
func (a *Agent) leaderChangeLoop(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-a.observer.Changes():
			l, ok := a.observer.Leader()
			if ok && l != a.lastLeader {
				a.metrics.leaderChanges.Inc()
				a.log.Info("leader changed", zap.String("leader", l.ID), zap.Int64("fencing_token", l.Token))
				a.lastLeader = l
			} else if !ok {
				a.log.Info("no leader")
			}
		case <-t.C:
		}
		a.metrics.agents.Set(float64(len(a.registry.list())))
		a.metrics.gossipMembers.Set(float64(a.ml.NumMembers()))
	}
}

package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"runtime/pprof"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/coordinator"
	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/dynconfig"
	"github.com/kswitch/kswitch/internal/etcdclient"
	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/internal/version"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/state"
)

// sessionState is the agent's standing in etcd.
type sessionState struct {
	registered bool
	lease      clientv3.LeaseID
	revision   int64  // etcd revision of the registration's write
	reason     string // why not registered
}

func (a *Agent) setSession(s sessionState) {
	a.session.Store(&s)
	a.updateReady()
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
	reg := state.Registration{ID: a.id, HTTP: a.httpAdvertised(), Gossip: a.GossipAddr(), Version: version.Version, Started: a.started, Config: &digest}
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
		OnRefused: func(state.ConfigRefusal) { a.metrics.badValues.WithLabelValues(refused.Config).Inc() }}
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

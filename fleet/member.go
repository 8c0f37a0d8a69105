package fleet

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/etcdclient"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/routing"
)

// Member is an agent and the router it hands every record to.
//
// The agent and the router share one etcd client, which the Member opens
// and closes, and the router reads channel pauses from the agent's
// signals.
//
// Who owns which goroutine: Start starts the router's Run (on a context
// of the Member's; it starts the router's loop, which Router.Close ends),
// then the agent's goroutines; Stop and Abort end them all, in this
// order, and return after they have:
//
//  1. the agent stops (Stop: its partitions drain the records handed to the
//     router, commit and are released; Abort: nothing is drained or
//     committed, as in a crash), so nothing is handed to the router any
//     more;
//  2. the router closes: its produces in flight are given what is left of
//     the stop's context to be acknowledged, then its producers close;
//  3. the router's Run ends; the etcd client closes.
//
// Closing the router before the agent has stopped would refuse the records
// of partitions still draining (they would wait out the agent's drain
// timeout); ending Run before closing the router is harmless but leaves
// its version in force without a follower, so it is done last.
type Member struct {
	agent  *agent.Agent
	router *routing.Router
	etcd   *clientv3.Client

	cancel   context.CancelFunc // ends Run; nil before Start
	wg       sync.WaitGroup     // Run
	stopOnce sync.Once
	stopErr  error
}

// NewMember builds the agent of cfg and its router, and opens their etcd
// client (it makes no request); nothing runs until Start, but the client
// is open, so a Member that is not started must still be stopped. opts
// are the agent's; its Handler,
// HandlerStatus, DeadLetters, Released and DeliveryProblem are the router's (any given are
// replaced).
//
// The router is always built, whether or not cfg has a routing section,
// so that routes and channels written to etcd later ('kswitch routes
// apply') take effect without a restart. With no rule, default route or
// dead-letter in force anywhere, it acknowledges every record and counts
// it as dropped (kswitch_routing_dropped_total{reason="no_match"}). It
// waits for the first read of etcd's routes before it takes a record, so a
// restarted agent never routes by the file what etcd routes otherwise. It
// follows routes and channels/ with the agent's etcd client; its metrics
// are on the agent's registry (/metrics).
func NewMember(cfg config.Config, opts agent.Options) (*Member, error) {
	log := opts.Logger
	if log == nil {
		log = zap.NewNop()
	}
	etcd, err := etcdclient.New(context.Background(), cfg.Etcd, log)
	if err != nil {
		return nil, fmt.Errorf("routing: %w", err)
	}
	rlog := log.With(zap.String("agent", cfg.Agent.ID), zap.String("fleet", cfg.Fleet))
	m := &Member{etcd: etcd}
	opts.Etcd = etcd

	// The router registers its metrics on the agent's registry, so the
	// agent is made first, with a handler that calls the router: it is
	// set below, before the agent starts and hands anything on.
	opts.Handler = record.HandlerFunc(func(ctx context.Context, r *record.Record) error {
		return m.router.Handle(ctx, r)
	})
	opts.HandlerStatus = func() any { return m.router.Status() }
	opts.DeadLetters = func() map[string]int64 { return m.router.DeadLettered() }
	opts.Released = func(p record.Owned) { m.router.Release(p) }
	opts.DeliveryProblem = func(after time.Duration) string { return m.router.DeliveryProblem(after) }
	onConfig := opts.OnConfig
	opts.OnConfig = func(c config.Config) {
		m.router.SetClusters(c.Clusters)
		if onConfig != nil {
			onConfig(c)
		}
	}
	if m.agent, err = agent.New(cfg, opts); err != nil {
		etcd.Close()
		return nil, err
	}
	if m.router, err = routing.New(cfg, m.agent.Signals, routing.Options{Etcd: etcd, Registerer: m.agent.Metrics(), Logger: rlog}); err != nil {
		etcd.Close()
		return nil, err
	}
	return m, nil
}

// Agent returns the agent.
func (m *Member) Agent() *agent.Agent { return m.agent }

// Router returns the router.
func (m *Member) Router() *routing.Router { return m.router }

// Start starts the router's followers of etcd, then the agent (see
// agent.Agent.Start: ctx only bounds Start itself). On error everything is
// stopped again.
func (m *Member) Start(ctx context.Context) error {
	if m.cancel != nil {
		return errors.New("member: already started")
	}
	rctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	m.cancel = cancel
	m.wg.Go(func() { _ = m.router.Run(rctx) })
	if err := m.agent.Start(ctx); err != nil {
		_ = m.Stop(ctx)
		return err
	}
	return nil
}

// Stop stops the agent cleanly (see agent.Agent.Stop), then closes the
// router and ends its followers, all within ctx; see Member for the order.
// Records whose produces are not acknowledged by then are consumed again
// by their partitions' next owners. Safe to call twice and after Abort.
func (m *Member) Stop(ctx context.Context) error {
	return m.stop(ctx, false)
}

// Abort ends the member as a crash would: the agent aborts (see
// agent.Agent.Abort), and the router closes without waiting for its
// produces in flight (sarama still flushes what it holds, so those records
// can reach their channels: their offsets were not committed, and the next
// owner delivers them again). It waits for every goroutine of the member.
func (m *Member) Abort() {
	_ = m.stop(context.Background(), true)
}

func (m *Member) stop(ctx context.Context, abort bool) error {
	m.stopOnce.Do(func() {
		var err error
		if abort {
			m.agent.Abort()
			done, cancel := context.WithCancel(ctx)
			cancel()
			_ = m.router.Close(done)
		} else {
			err = errors.Join(m.agent.Stop(ctx), m.router.Close(ctx))
		}
		if m.cancel != nil {
			m.cancel()
		}
		m.wg.Wait()
		m.etcd.Close()
		m.stopErr = err
	})
	return m.stopErr
}

// Run starts the member, runs it until ctx ends, then stops it (Stop)
// within stopTimeout.
func (m *Member) Run(ctx context.Context, stopTimeout time.Duration) error {
	if err := m.Start(ctx); err != nil {
		return err
	}
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), stopTimeout)
	defer cancel()
	return m.Stop(sctx)
}

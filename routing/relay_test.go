package routing

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/internal/config"
	"github.com/kswitch/kswitch/internal/keys"
	"github.com/kswitch/kswitch/internal/testenv"
	"github.com/kswitch/kswitch/signals"
)

// relayConfig is the configuration of a relay from topic orders on src
// (cluster A) to channels on dst (cluster D), on etcd e; the fleet, the
// agent id and the routing are the caller's.
func relayConfig(e *testenv.Etcd, src, dst *testenv.Kafka) config.Config {
	cfg := config.Default()
	cfg.Agent.HTTP = "127.0.0.1:0"
	cfg.Agent.Gossip = "127.0.0.1:0"
	cfg.Etcd.Endpoints = e.Endpoints()
	cfg.Etcd.SessionTTL = 2 * time.Second
	cfg.Etcd.RequestTimeout = time.Second
	cfg.Clusters = map[string]config.Cluster{
		"A": {Brokers: src.Brokers(), Role: config.RolePrimary, Version: config.DefaultKafkaVersion},
		"D": {Brokers: dst.Brokers(), Role: config.RoleSink, Version: config.DefaultKafkaVersion},
	}
	cfg.Source.Topics = []string{"orders"}
	return cfg
}

// relay is an agent whose handler is a Router, wired as 'kswitch agent'
// wires them (internal/cli): the router's metrics on the agent's
// registry, the router following etcd's routes, channels and signals.
type relay struct {
	agent  *agent.Agent
	router *Router
	// stop stops the agent, then the router (its produces in flight get
	// up to 15 s). Calls after the first return the first's error.
	stop func() error
}

// startRelay starts a relay for cfg, whose etcd is cli.
func startRelay(tb testing.TB, cfg config.Config, cli *clientv3.Client, log *zap.Logger) *relay {
	tb.Helper()
	sigs := signals.NewWatcher(cli, keys.New(cfg.Fleet), cfg.Etcd.RequestTimeout, log.Named("routing"))
	r := &relay{}
	a, err := agent.New(cfg, agent.Options{
		Logger:        log,
		Handler:       agent.HandlerFunc(func(ctx context.Context, rec *agent.Record) error { return r.router.Handle(ctx, rec) }),
		HandlerStatus: func() any { return r.router.Status() },
	})
	if err != nil {
		tb.Fatal(err)
	}
	if r.router, err = New(cfg, sigs.State, Options{Etcd: cli, Registerer: a.Metrics(), Logger: log}); err != nil {
		tb.Fatal(err)
	}
	r.agent = a
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = sigs.Run(ctx) })
	wg.Go(func() { _ = r.router.Run(ctx) })
	r.stop = sync.OnceValue(func() error {
		sctx, scancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer scancel()
		err := a.Stop(sctx)
		err = errors.Join(err, r.router.Close(sctx))
		cancel()
		wg.Wait()
		return err
	})
	if err := a.Start(context.Background()); err != nil {
		_ = r.stop()
		tb.Fatal(err)
	}
	return r
}

package routing_test

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/fleet"
)

// relayConfig is the configuration of a relay from topic orders on src
// (cluster A) to channels on dst (cluster D), on etcd e; the fleet, the
// agent id and the routing are the caller's.
func relayConfig(e *devstack.Etcd, src, dst *devstack.Kafka) config.Config {
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

// startRelay starts a member of cfg's fleet as 'kswitch agent' runs it: an
// agent whose handler is a routing.Router. The caller stops it.
func startRelay(tb testing.TB, cfg config.Config, log *zap.Logger) *fleet.Member {
	tb.Helper()
	m, err := fleet.NewMember(cfg, agent.Options{Logger: log})
	if err != nil {
		tb.Fatal(err)
	}
	if err := m.Start(context.Background()); err != nil {
		tb.Fatal(err)
	}
	return m
}

// stopRelay stops m within 15 s.
func stopRelay(tb testing.TB, m *fleet.Member) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := m.Stop(ctx); err != nil {
		tb.Error(err)
	}
}

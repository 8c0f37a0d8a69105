package cli

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/spf13/cobra"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/internal/config"
	"github.com/kswitch/kswitch/internal/keys"
	"github.com/kswitch/kswitch/internal/logx"
	"github.com/kswitch/kswitch/routing"
	"github.com/kswitch/kswitch/signals"
)

func newAgentCmd(g *globals) *cobra.Command {
	var file string
	var stopTimeout time.Duration
	cmd := &cobra.Command{
		Use:   "agent --config FILE [flags]",
		Short: "Run one agent of a fleet",
		Long: `Run one agent of a fleet until SIGINT or SIGTERM, then stop cleanly: resign
leadership so a successor takes over at once, release the etcd registration,
leave the gossip cluster.

Configuration comes from the YAML file (see examples/kswitch.yaml for every
field), then KSWITCH_* environment variables, then flags: a flag beats its
variable, which beats the file. The result is validated before anything
starts, and every problem is reported with the field that has it.

Each record of the partitions the agent owns goes to the routing sink: the
rules of the routing section and of etcd's routes and channels/ keys
('kswitch routes') choose the channels it is produced to; its offset is
committed once every channel has acknowledged it. Without any rule or default
route, records are acknowledged and counted, and produced nowhere.

The agent serves on agent.http:
  GET /healthz   the process is alive
  GET /readyz    200 when connected to etcd and registered, else 503 with the reason
  GET /leader    {"leader": id, "self": bool, "fencing_token": n}
  GET /status    the agent's view of the fleet (JSON)
  GET /metrics   Prometheus metrics`,
		Example: `  kswitch agent --config /etc/kswitch/kswitch.yaml
  kswitch agent --config kswitch.yaml --agent.id agent-2 --agent.http 127.0.0.1:8081 --log-format console
  KSWITCH_ETCD_ENDPOINTS=etcd1:2379,etcd2:2379 kswitch agent --config kswitch.yaml`,
		Args: cobra.NoArgs,
	}
	fs := cmd.Flags()
	fs.StringVarP(&file, "config", "c", "", "YAML configuration file (optional when env and flags give every required field)")
	fs.DurationVar(&stopTimeout, "stop-timeout", 10*time.Second, "how long a clean stop may take after SIGINT/SIGTERM")
	ov := config.BindFlags(fs)
	// --log-format and --log-level (global) are the documented spelling.
	_ = fs.MarkHidden("log.format")
	_ = fs.MarkHidden("log.level")

	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		cfg := config.Default()
		if file != "" {
			var err error
			if cfg, err = config.Load(file); err != nil {
				return err
			}
		}
		if err := ov.Apply(&cfg, g.environ); err != nil {
			return err
		}
		if f := cmd.Flags().Lookup("log-format"); f != nil && f.Changed {
			cfg.Log.Format = g.logFormat
		}
		if f := cmd.Flags().Lookup("log-level"); f != nil && f.Changed {
			cfg.Log.Level = g.logLevel
		}
		if err := cfg.Validate(); err != nil {
			return fmt.Errorf("invalid configuration:\n%w", err)
		}
		log, err := logx.New(cfg.Log.Format, cfg.Log.Level)
		if err != nil {
			return err
		}
		defer func() { _ = log.Sync() }()
		return runAgent(cmd.Context(), cfg, log, stopTimeout)
	}
	return cmd
}

// runAgent runs an agent whose records go to the routing sink until ctx
// ends, then stops the agent and, after it, the router.
//
// The router is always built, whether or not the file has a routing
// section, so that routes and channels written to etcd later ('kswitch
// routes apply') take effect without a restart. With no rule, default
// route or dead-letter in force anywhere, it acknowledges every record
// and counts it as dropped (kswitch_routing_dropped_total{reason="no_match"}),
// which is what the agent's default CountingHandler did. It waits for the
// first read of etcd's routes before it takes a record, so a restarted
// agent never routes by the file what etcd routes otherwise.
//
// The router follows etcd (routes, channels/, and the signals for channel
// pauses) with a client of its own; its metrics are on the agent's
// registry (/metrics).
func runAgent(ctx context.Context, cfg config.Config, log *zap.Logger, stopTimeout time.Duration) error {
	etcd, err := clientv3.New(clientv3.Config{
		Endpoints:   cfg.Etcd.Endpoints,
		DialTimeout: cfg.Etcd.DialTimeout,
		Logger:      log.Named("etcd").WithOptions(zap.IncreaseLevel(zap.ErrorLevel)),
	})
	if err != nil {
		return fmt.Errorf("routing: etcd client for %v: %w", cfg.Etcd.Endpoints, err)
	}
	defer etcd.Close()
	rlog := log.With(zap.String("agent", cfg.Agent.ID), zap.String("fleet", cfg.Fleet))
	sigs := signals.NewWatcher(etcd, keys.New(cfg.Fleet), cfg.Etcd.RequestTimeout, rlog.Named("routing"))

	// The router registers its metrics on the agent's registry, so the
	// agent is made first, with a handler that calls the router: it is
	// set below, before the agent starts and hands anything on.
	var router *routing.Router
	a, err := agent.New(cfg, agent.Options{
		Logger: log,
		Handler: agent.HandlerFunc(func(ctx context.Context, r *agent.Record) error {
			return router.Handle(ctx, r)
		}),
		HandlerStatus: func() any { return router.Status() },
	})
	if err != nil {
		return err
	}
	router, err = routing.New(cfg, sigs.State, routing.Options{Etcd: etcd, Registerer: a.Metrics(), Logger: rlog})
	if err != nil {
		return err
	}
	rctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	wg.Go(func() { _ = sigs.Run(rctx) })
	wg.Go(func() { _ = router.Run(rctx) })

	err = a.Run(ctx, stopTimeout)

	// The agent has stopped: nothing is handed to the router any more.
	// Its produces in flight get the same time to be acknowledged; their
	// records are consumed again by the partitions' next owners otherwise.
	cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), stopTimeout)
	defer ccancel()
	cerr := router.Close(cctx)
	cancel()
	wg.Wait()
	return errors.Join(err, cerr)
}

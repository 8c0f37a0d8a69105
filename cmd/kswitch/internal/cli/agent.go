package cli

import (
	"context"
	"fmt"
	"runtime/debug"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/fleet"
	"github.com/kswitch/kswitch/internal/logx"
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

The agent serves on agent.http (HTTPS with agent.http_tls), read-only: GET and
HEAD only, any other method gets 405 (see docs/SECURITY.md):
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
		var modeWarning string
		if file != "" {
			var err error
			if cfg, err = config.Load(file); err != nil {
				return err
			}
			if modeWarning, err = config.FileModeWarning(file, cfg); err != nil {
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
		if modeWarning != "" {
			log.Warn(modeWarning)
		}
		applyMemoryLimit(cfg.Agent.MemoryLimitMiB, g.environ, log)
		return runAgent(cmd.Context(), cfg, log, stopTimeout)
	}
	return cmd
}

// applyMemoryLimit sets the process's soft memory limit to mib MiB
// (agent.memory_limit_mib), unless it is 0 or GOMEMLIMIT is set in environ,
// which the Go runtime has applied already.
func applyMemoryLimit(mib int, environ []string, log *zap.Logger) {
	for _, kv := range environ {
		if strings.HasPrefix(kv, "GOMEMLIMIT=") {
			log.Info("memory limit from GOMEMLIMIT; agent.memory_limit_mib not applied", zap.String("GOMEMLIMIT", strings.TrimPrefix(kv, "GOMEMLIMIT=")))
			return
		}
	}
	if mib > 0 {
		debug.SetMemoryLimit(int64(mib) << 20)
	}
}

// runAgent runs an agent whose records go to the routing sink (see
// fleet.New) until ctx ends, then stops the agent and, after it, the
// router, within stopTimeout.
func runAgent(ctx context.Context, cfg config.Config, log *zap.Logger, stopTimeout time.Duration) error {
	m, err := fleet.NewMember(cfg, agent.Options{Logger: log})
	if err != nil {
		return err
	}
	return m.Run(ctx, stopTimeout)
}

package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/fleet"
	"github.com/kswitch/kswitch/keys"
)

// etcdFlags are the flags of commands that talk to a fleet's etcd without
// running an agent.
type etcdFlags struct {
	endpoints []string
	fleet     string
	file      string
	timeout   time.Duration
	// etcd is the etcd section of --config and the environment (TLS,
	// credentials), with endpoints and dial timeout from the flags; set
	// by resolve.
	etcd config.Etcd
}

func (f *etcdFlags) bind(cmd *cobra.Command) {
	fs := cmd.Flags()
	fs.StringSliceVar(&f.endpoints, "etcd", nil, "etcd endpoints, comma-separated (default: etcd.endpoints of --config, else $KSWITCH_ETCD_ENDPOINTS, else 127.0.0.1:2379)")
	fs.StringVar(&f.fleet, "fleet", "", "fleet name (default: fleet of --config, else $KSWITCH_FLEET)")
	fs.StringVarP(&f.file, "config", "c", "", "read etcd endpoints and fleet from this agent configuration file")
	fs.DurationVar(&f.timeout, "timeout", 5*time.Second, "give up when etcd does not answer within this time")
}

// resolve fills endpoints and fleet: flag, else file, else environment.
// It returns the configuration it read (defaults when no file was given),
// for the cluster addresses.
func (f *etcdFlags) resolve(environ []string) (config.Config, error) {
	cfg := config.Default()
	if f.file != "" {
		var err error
		if cfg, err = config.Load(f.file); err != nil {
			return cfg, err
		}
	}
	if err := (*config.Overrides)(nil).Apply(&cfg, environ); err != nil {
		return cfg, err
	}
	if len(f.endpoints) == 0 {
		f.endpoints = cfg.Etcd.Endpoints
	}
	if len(f.endpoints) == 0 {
		f.endpoints = []string{"127.0.0.1:2379"}
	}
	f.etcd = cfg.Etcd
	f.etcd.Endpoints, f.etcd.DialTimeout = f.endpoints, f.timeout
	if f.fleet == "" {
		f.fleet = cfg.Fleet
	}
	if f.fleet == "" {
		return cfg, fmt.Errorf("which fleet? pass --fleet NAME (or --config FILE, or set KSWITCH_FLEET)")
	}
	if err := keys.ValidName(f.fleet); err != nil {
		return cfg, fmt.Errorf("--fleet %q: %v", f.fleet, err)
	}
	return cfg, nil
}

// conn is one command's connection to a fleet's etcd.
type conn struct {
	cfg    config.Config // what --config and the environment say (defaults without them)
	client *clientv3.Client
	op     *fleet.Operator // the fleet's, over client
	keys   keys.Fleet
	ctx    context.Context // bounded by --timeout
	cancel context.CancelFunc
}

func (c *conn) close() {
	c.cancel()
	c.client.Close()
}

// open resolves the flags, connects to etcd and bounds the command by
// --timeout. The caller defers close.
func (f *etcdFlags) open(cmd *cobra.Command, environ []string) (*conn, error) {
	cfg, err := f.resolve(environ)
	if err != nil {
		return nil, err
	}
	c, err := f.client()
	if err != nil {
		return nil, err
	}
	op, err := fleet.NewOperator(c, f.fleet)
	if err != nil {
		c.Close()
		return nil, err
	}
	ctx, cancel := context.WithTimeout(cmd.Context(), f.timeout)
	return &conn{cfg: cfg, client: c, op: op, keys: op.Keys(), ctx: ctx, cancel: cancel}, nil
}

// checkOutput refuses an --output value not among allowed.
// runWith returns a command's RunE: it checks --output (*output) against
// allowed, opens etcd, runs fn with the connection and closes it.
func (f *etcdFlags) runWith(environ []string, output *string, allowed []string, fn func(cmd *cobra.Command, cn *conn) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, _ []string) error {
		if err := checkOutput(*output, allowed...); err != nil {
			return err
		}
		cn, err := f.open(cmd, environ)
		if err != nil {
			return err
		}
		defer cn.close()
		return fn(cmd, cn)
	}
}

func checkOutput(output string, allowed ...string) error {
	if slices.Contains(allowed, output) {
		return nil
	}
	return fmt.Errorf("--output %q: use %s", output, strings.Join(allowed, " or "))
}

// client opens the etcd client of a command, after resolve: TLS and
// credentials come from --config and KSWITCH_ETCD_* (an operator's own
// user, see docs/SECURITY.md).
func (f *etcdFlags) client() (*clientv3.Client, error) {
	return fleet.OpenEtcd(context.Background(), f.etcd, nil)
}

func newStatusCmd(g *globals) *cobra.Command {
	var ef etcdFlags
	var output string
	cmd := &cobra.Command{
		Use:   "status --etcd ENDPOINTS --fleet NAME [-o table|json]",
		Short: "Show a fleet as recorded in etcd: leader, agents, assignment, offsets, lag",
		Long: `Show a fleet as recorded in etcd: who leads (with its fencing token), every
registered agent with its HTTP and gossip addresses, version and age, the
partition assignment (generation, cluster, agent → partitions) and each
partition's committed offset, and the leader's list of partitions that no
agent has consumed for a while (state/stalled). The CONFIG column is the
digest of each agent's fleet-wide configuration (routing, source, clusters,
failover); an agent whose digest differs from the fleet's is named below
the table with the parts that differ. No agent needs to answer;
each is asked for its /readyz (--ask, on by default), and the READY column
shows its answer: yes, or no with the agent's reason (a stuck handler,
stalled partitions, commits held, no partition while others have no
consumer), or '?' when it does not answer.

With --config (or KSWITCH_CLUSTERS_<NAME>_BROKERS) naming the brokers of the
assigned cluster, it also asks Kafka for each partition's end offset and
shows the lag; otherwise the lag column shows '-'.`,
		Example: `  kswitch status --etcd 127.0.0.1:2379 --fleet orders
  kswitch status --config kswitch.yaml -o json`,
		Args: cobra.NoArgs,
	}
	ef.bind(cmd)
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table or json")
	var ask bool
	cmd.Flags().BoolVar(&ask, "ask", true, "ask each agent's /readyz (1 s each, in parallel) for the READY column; --ask=false reads etcd alone")
	cmd.RunE = ef.runWith(g.environ, &output, []string{"table", "json"}, func(cmd *cobra.Command, cn *conn) error {
		cfg, c, ctx := cn.cfg, cn.client, cn.ctx
		v, err := cn.op.Status(ctx)
		if err != nil {
			return fmt.Errorf("read fleet %q from etcd %v: %w", ef.fleet, ef.endpoints, err)
		}
		if err := v.FillLag(cfg.Clusters); err != nil {
			fmt.Fprintf(cmd.ErrOrStderr(), "warning: %v\n", err)
		}
		if ask {
			v.AskReady(ctx, time.Second)
		}
		topics := readTopicHistory(ctx, c, ef.fleet, cmd.ErrOrStderr())
		if output == "json" {
			enc := json.NewEncoder(cmd.OutOrStdout())
			enc.SetIndent("", "  ")
			return enc.Encode(topics.json(v))
		}
		v.WriteText(cmd.OutOrStdout(), time.Now())
		topics.print(cmd.OutOrStdout())
		return nil
	})
	return cmd
}

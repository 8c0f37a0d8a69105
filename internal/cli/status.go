package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/internal/config"
	"github.com/kswitch/kswitch/internal/keys"
)

// etcdFlags are the flags of commands that talk to a fleet's etcd without
// running an agent.
type etcdFlags struct {
	endpoints []string
	fleet     string
	file      string
	timeout   time.Duration
}

func (f *etcdFlags) bind(cmd *cobra.Command) {
	fs := cmd.Flags()
	fs.StringSliceVar(&f.endpoints, "etcd", nil, "etcd endpoints, comma-separated (default: etcd.endpoints of --config, else $KSWITCH_ETCD_ENDPOINTS, else 127.0.0.1:2379)")
	fs.StringVar(&f.fleet, "fleet", "", "fleet name (default: fleet of --config, else $KSWITCH_FLEET)")
	fs.StringVarP(&f.file, "config", "c", "", "read etcd endpoints and fleet from this agent configuration file")
	fs.DurationVar(&f.timeout, "timeout", 5*time.Second, "give up when etcd does not answer within this time")
}

// resolve fills endpoints and fleet: flag, else file, else environment.
func (f *etcdFlags) resolve(environ []string) error {
	cfg := config.Default()
	if f.file != "" {
		var err error
		if cfg, err = config.Load(f.file); err != nil {
			return err
		}
	}
	if err := (*config.Overrides)(nil).Apply(&cfg, environ); err != nil {
		return err
	}
	if len(f.endpoints) == 0 {
		f.endpoints = cfg.Etcd.Endpoints
	}
	if len(f.endpoints) == 0 {
		f.endpoints = []string{"127.0.0.1:2379"}
	}
	if f.fleet == "" {
		f.fleet = cfg.Fleet
	}
	if f.fleet == "" {
		return fmt.Errorf("which fleet? pass --fleet NAME (or --config FILE, or set KSWITCH_FLEET)")
	}
	if err := keys.ValidName(f.fleet); err != nil {
		return fmt.Errorf("--fleet %q: %v", f.fleet, err)
	}
	return nil
}

func (f *etcdFlags) client() (*clientv3.Client, error) {
	c, err := clientv3.New(clientv3.Config{Endpoints: f.endpoints, DialTimeout: f.timeout, Logger: zap.NewNop()})
	if err != nil {
		return nil, fmt.Errorf("etcd %v: %w", f.endpoints, err)
	}
	return c, nil
}

func newStatusCmd(g *globals) *cobra.Command {
	var ef etcdFlags
	var output string
	cmd := &cobra.Command{
		Use:   "status --etcd ENDPOINTS --fleet NAME [-o table|json]",
		Short: "Show a fleet as recorded in etcd: leader and agents",
		Long: `Show a fleet as recorded in etcd: who leads (with its fencing token) and
every registered agent with its HTTP and gossip addresses, version and age.
Reads etcd only; no agent needs to answer.`,
		Example: `  kswitch status --etcd 127.0.0.1:2379 --fleet orders
  kswitch status --config kswitch.yaml -o json`,
		Args: cobra.NoArgs,
	}
	ef.bind(cmd)
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table or json")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		if output != "table" && output != "json" {
			return fmt.Errorf("--output %q: use table or json", output)
		}
		if err := ef.resolve(g.environ); err != nil {
			return err
		}
		c, err := ef.client()
		if err != nil {
			return err
		}
		defer c.Close()
		ctx, cancel := context.WithTimeout(cmd.Context(), ef.timeout)
		defer cancel()
		v, err := agent.ReadFleet(ctx, c, ef.fleet)
		if err != nil {
			return fmt.Errorf("read fleet %q from etcd %v: %w", ef.fleet, ef.endpoints, err)
		}
		if output == "json" {
			enc := json.NewEncoder(cmd.OutOrStdout())
			enc.SetIndent("", "  ")
			return enc.Encode(v)
		}
		printFleet(cmd.OutOrStdout(), v, time.Now())
		return nil
	}
	return cmd
}

func printFleet(w io.Writer, v agent.FleetView, now time.Time) {
	leader := "(none)"
	if v.Leader != "" {
		leader = fmt.Sprintf("%s (fencing token %d)", v.Leader, v.Token)
	}
	fmt.Fprintf(w, "fleet:   %s\nleader:  %s\nagents:  %d\n\n", v.Fleet, leader, len(v.Agents))
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "AGENT\tLEADER\tHTTP\tGOSSIP\tVERSION\tAGE")
	for _, a := range v.Agents {
		mark := ""
		if a.ID == v.Leader {
			mark = "*"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", a.ID, mark, a.HTTP, a.Gossip, a.Version, now.Sub(a.Started).Round(time.Second))
	}
	tw.Flush()
	for _, r := range v.Refused {
		fmt.Fprintf(w, "warning: %s\n", strings.TrimSpace(r))
	}
}

package cli

import (
	"fmt"

	"github.com/spf13/cobra"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/coordinator"
	"github.com/kswitch/kswitch/keys"
)

func newFailoverCmd(g *globals) *cobra.Command {
	var ef etcdFlags
	var to string
	var auto bool
	cmd := &cobra.Command{
		Use:   "failover (--to CLUSTER | --auto)",
		Short: "Pin the fleet to a cluster, or return it to automatic failover",
		Long: `Pin the fleet to a cluster: the leader switches to it (if a quorum of agents
can reach it) and stays there whatever the health verdict says, until the pin
is removed with --auto. The pin is the etcd key /kswitch/<fleet>/control/pin;
operators can do the same with etcdctl:

  etcdctl put /kswitch/orders/control/pin B     # same as --to B
  etcdctl del /kswitch/orders/control/pin       # same as --auto

A switch releases every partition, translates each committed position to the
target cluster, then resumes there; 'kswitch status' shows its progress.`,
		Example: `  kswitch failover --etcd 127.0.0.1:2379 --fleet orders --to B
  kswitch failover --config kswitch.yaml --auto`,
		Args: cobra.NoArgs,
	}
	ef.bind(cmd)
	cmd.Flags().StringVar(&to, "to", "", "cluster to pin the fleet to (the primary or the standby)")
	cmd.Flags().BoolVar(&auto, "auto", false, "remove the pin: automatic failover and failback")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		if (to == "") == !auto {
			return fmt.Errorf("give exactly one of --to CLUSTER and --auto")
		}
		cn, err := ef.open(cmd, g.environ)
		if err != nil {
			return err
		}
		defer cn.close()
		cfg, c, ctx, k := cn.cfg, cn.client, cn.ctx, cn.keys
		if to != "" {
			if err := keys.ValidName(to); err != nil {
				return fmt.Errorf("--to %q: %v", to, err)
			}
			if cl, ok := cfg.Clusters[to]; ef.file != "" && (!ok || (cl.Role != config.RolePrimary && cl.Role != config.RoleStandby)) {
				return fmt.Errorf("--to %q: not the primary or standby cluster of %s", to, ef.file)
			}
		}
		if auto {
			if _, err := c.Delete(ctx, k.Pin()); err != nil {
				return fmt.Errorf("delete %s: %w", k.Pin(), err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "deleted %s: automatic failover and failback\n", k.Pin())
		} else {
			if _, err := c.Put(ctx, k.Pin(), to); err != nil {
				return fmt.Errorf("put %s: %w", k.Pin(), err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "put %s = %s: the leader switches to %s and stays there until 'kswitch failover --auto'\n", k.Pin(), to, to)
		}
		if resp, err := c.Get(ctx, k.Active(), clientv3.WithSerializable()); err == nil && len(resp.Kvs) > 0 {
			if a, err := coordinator.ParseActive(resp.Kvs[0].Value); err == nil {
				fmt.Fprintf(cmd.OutOrStdout(), "now: cluster %s, epoch %d, %s (%s)\n", a.Cluster, a.Epoch, a.Phase, a.Reason)
			}
		}
		return nil
	}
	return cmd
}

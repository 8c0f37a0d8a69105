package cli

import (
	"encoding/json"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/kswitch/kswitch/fleetview"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/offsets"
)

func newOffsetsCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "offsets",
		Short: "Inspect the fleet's committed offsets",
		Long: `Inspect the committed offsets the fleet keeps in etcd under
/kswitch/<fleet>/offsets/<cluster>/<topic>/<partition>. They are the
authority; the Kafka consumer group of source.group mirrors them.`,
		Example: "  kswitch offsets show --etcd 127.0.0.1:2379 --fleet orders",
		Args:    cobra.NoArgs,
	}
	cmd.AddCommand(newOffsetsShowCmd(g))
	return cmd
}

func newOffsetsShowCmd(g *globals) *cobra.Command {
	var ef etcdFlags
	var cluster, output string
	cmd := &cobra.Command{
		Use:   "show [--cluster NAME] [-o table|json]",
		Short: "Print the committed offset of every partition of a cluster",
		Long: `Print the committed offset (the next offset to consume) of every partition
of a cluster, with the timestamp of the last consumed record, the agent that
committed it, the assignment generation that fenced the commit, and when.`,
		Example: `  kswitch offsets show --etcd 127.0.0.1:2379 --fleet orders
  kswitch offsets show --config kswitch.yaml --cluster B -o json`,
		Args: cobra.NoArgs,
	}
	ef.bind(cmd)
	cmd.Flags().StringVar(&cluster, "cluster", "", "cluster whose offsets to show (default: the cluster of the current assignment)")
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table or json")
	cmd.RunE = ef.runWith(g.environ, &output, []string{"table", "json"}, func(cmd *cobra.Command, cn *conn) error {
		c, ctx := cn.client, cn.ctx
		if cluster == "" {
			v, err := fleetview.ReadFleet(ctx, c, keys.New(ef.fleet))
			if err != nil {
				return err
			}
			if v.Assignment == nil {
				return fmt.Errorf("fleet %q has no assignment yet; name the cluster with --cluster", ef.fleet)
			}
			cluster = v.Assignment.Cluster
		}
		ps, bad, err := offsets.NewStore(c, keys.New(ef.fleet)).List(ctx, cluster)
		if err != nil {
			return err
		}
		for _, b := range bad {
			fmt.Fprintf(cmd.ErrOrStderr(), "warning: %v\n", b)
		}
		if output == "json" {
			type row struct {
				Cluster      string    `json:"cluster"`
				Topic        string    `json:"topic"`
				Partition    int32     `json:"partition"`
				Offset       int64     `json:"offset"`
				Timestamp    time.Time `json:"timestamp,omitzero"`
				Fingerprints int       `json:"fingerprints"`
				Agent        string    `json:"agent"`
				Generation   int64     `json:"generation"`
				CommittedAt  time.Time `json:"committed_at"`
			}
			rows := []row{}
			for _, p := range ps {
				rows = append(rows, row{p.Cluster, p.Topic, p.Partition, p.Offset, p.Timestamp, len(p.Fingerprints), p.Agent, p.Generation, p.CommittedAt})
			}
			enc := json.NewEncoder(cmd.OutOrStdout())
			enc.SetIndent("", "  ")
			return enc.Encode(rows)
		}
		w := cmd.OutOrStdout()
		fmt.Fprintf(w, "cluster %s: %d partitions with committed offsets\n\n", cluster, len(ps))
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "TOPIC\tPARTITION\tOFFSET\tLAST RECORD\tAGENT\tGENERATION\tCOMMITTED")
		for _, p := range ps {
			last := "-"
			if !p.Timestamp.IsZero() {
				last = p.Timestamp.UTC().Format(time.RFC3339Nano)
			}
			fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\t%d\t%s\n", p.Topic, p.Partition, p.Offset, last, p.Agent, p.Generation, p.CommittedAt.UTC().Format(time.RFC3339))
		}
		return tw.Flush()
	})
	return cmd
}

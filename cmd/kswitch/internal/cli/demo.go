package cli

import (
	"time"

	"github.com/spf13/cobra"

	"github.com/kswitch/kswitch/cmd/kswitch/internal/demo"
	"github.com/kswitch/kswitch/internal/logx"
)

func newDemoCmd(g *globals) *cobra.Command {
	var o demo.Options
	var verbose bool
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run a live failover and failback in one process (embedded etcd and Kafka)",
		Long: `Run a live demonstration in one process, with nothing to install: an embedded
etcd; three Kafka clusters A, B and C (in process), with a mirror keeping B a
replica of A (like MirrorMaker 2); a producer writing numbered records to A;
and a fleet of agents, each run as 'kswitch agent' runs it, routing every
record to a channel on C. The story, narrated as a timeline:

  1. steady state: the leader, the assignment, the rate reaching C;
  2. a pause and a start through the etcd signal key (the etcdctl line shown);
  3. cluster A fails for the fleet: verdict, switch, translation per
     partition, the first record consumed from B reaching C;
  4. an agent is killed: its partitions move; a replacement joins and gets
     its share;
  5. A comes back: caught-up check, failback;
  6. a summary read back from C: produced, delivered, lost (must be 0),
     duplicated, pause, failover and failback times.

With --exactly-once, C is an exactly_once cluster: the channel gets each
record once, the killed agent's last records included (read_committed).

With --clusters 3, two cities and three data centres: A (primary), B
(standby, priority 1, the same city) and D (standby, priority 2, the remote
city), mirrors A → B and A → D. A fails: failover to B; B fails while the
fleet consumes it: failover to D, translated by fingerprint (no mirror joins
B and D); A returns while B stays down: failback from D straight to A. The
summary: written, delivered, lost (must be 0), duplicated, and the three
switches' times.

Exit status is non-zero when a record was lost or a step missed its bound.`,
		Example: `  kswitch demo
  kswitch demo --exactly-once
  kswitch demo --clusters 3
  kswitch demo --agents 5 --rate 500 --keep-running`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			o.Out = cmd.OutOrStdout()
			if verbose {
				log, err := logx.New("console", g.logLevel)
				if err != nil {
					return err
				}
				o.Logger = log
			}
			_, err := demo.Run(cmd.Context(), o)
			return err
		},
	}
	cmd.Flags().IntVar(&o.Agents, "agents", 3, "number of agents in the fleet (at least 2)")
	cmd.Flags().IntVar(&o.Rate, "rate", 200, "records per second the producer writes to A")
	cmd.Flags().DurationVar(&o.Duration, "duration", 12*time.Second, "how long the calm phases of the story last altogether (the switches add about 10s)")
	cmd.Flags().BoolVar(&o.KeepRunning, "keep-running", false, "leave everything up after the story, with the producer writing again; print the agents' URLs and etcdctl lines to try (pause, pin, routes)")
	cmd.Flags().BoolVar(&o.ExactlyOnce, "exactly-once", false, "make C an exactly_once cluster (Kafka transactions with the source positions): 0 duplicated, the killed agent's records included")
	cmd.Flags().IntVar(&o.Clusters, "clusters", 2, "source clusters: 2 (A and its replica B: the outage story) or 3 (A, B and D, two cities and three data centres: A fails, then B, then A returns)")
	cmd.Flags().BoolVarP(&verbose, "verbose", "v", false, "also print the agents' logs (console format) on stderr")
	return cmd
}

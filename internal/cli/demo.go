package cli

import (
	"github.com/spf13/cobra"

	"github.com/kswitch/kswitch/internal/demo"
	"github.com/kswitch/kswitch/internal/logx"
)

func newDemoCmd(g *globals) *cobra.Command {
	var o demo.Options
	var verbose bool
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run a live failover and failback in one process (embedded etcd and Kafka)",
		Long: `Run a live demonstration in one process, with nothing to install: an embedded
etcd, two Kafka clusters A and B (in process) with a mirror keeping B a
replica of A (like MirrorMaker 2), a producer writing numbered records to A,
and a fleet of agents consuming them. The story, narrated as a timeline:

  1. steady state: the leader, the assignment, the rate;
  2. a pause and a start through the etcd signal key (the etcdctl line shown);
  3. cluster A fails: detection, verdict, switch, translation per partition;
  4. an agent is killed: its partitions move;
  5. A recovers: caught-up check, failback;
  6. a summary: produced, handled, lost (must be 0), duplicated, timings.

Exit status is non-zero when a record was lost or a step missed its bound.`,
		Example: `  kswitch demo
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
	cmd.Flags().DurationVar(&o.Phase, "duration", 3e9, "length of each calm phase of the story (the whole demo takes about 10 of them plus the switches)")
	cmd.Flags().BoolVar(&o.KeepRunning, "keep-running", false, "leave the fleet up after the story, print URLs and commands to try")
	cmd.Flags().BoolVarP(&verbose, "verbose", "v", false, "also print the agents' logs (console format) on stderr")
	return cmd
}

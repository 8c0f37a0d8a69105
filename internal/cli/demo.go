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
		Short: "Run a live demonstration in one process (embedded etcd, a fleet of agents)",
		Long: `Run a live demonstration in one process: an embedded etcd and a fleet of
agents on free local ports, and a scripted story narrated as a timeline —
leader election, a leader crash (the successor waits for the lease TTL) and
a clean hand-over (the successor leads at once). Nothing to install.

Exit status is non-zero when the fleet broke a promise (two leaders, no
leader, a hand-over past its bound).`,
		Example: `  kswitch demo
  kswitch demo --agents 5 --keep-running`,
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
			return demo.Run(cmd.Context(), o)
		},
	}
	cmd.Flags().IntVar(&o.Agents, "agents", 3, "number of agents in the fleet (at least 2)")
	cmd.Flags().DurationVar(&o.SessionTTL, "session-ttl", 2e9, "etcd session TTL of the agents (whole seconds, at least 2s)")
	cmd.Flags().BoolVar(&o.KeepRunning, "keep-running", false, "leave the fleet up after the story, print URLs and commands to try")
	cmd.Flags().BoolVarP(&verbose, "verbose", "v", false, "also print the agents' logs (console format) on stderr")
	return cmd
}

// Package cli holds the kswitch commands. cmd/kswitch only turns signals
// into a context and calls Execute, so the commands run in tests in
// process.
package cli

import (
	"context"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/kswitch/kswitch/internal/version"
)

// Execute runs the kswitch command line args and returns the exit status.
// environ supplies the KSWITCH_ variables (os.Environ() in main).
func Execute(ctx context.Context, args []string, stdout, stderr io.Writer, environ []string) int {
	root := newRoot(environ)
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	if err := root.ExecuteContext(ctx); err != nil {
		fmt.Fprintln(stderr, "kswitch:", err)
		return 1
	}
	return 0
}

// globals are the flags every command takes.
type globals struct {
	logFormat string
	logLevel  string
	environ   []string
}

func newRoot(environ []string) *cobra.Command {
	g := &globals{environ: environ}
	root := &cobra.Command{
		Use:   "kswitch",
		Short: "Kafka consumer fleet that fails over between data centres by itself",
		Long: `kswitch runs a fleet of replicated Kafka consumer agents coordinated through
etcd. A leader elected in etcd decides which Kafka cluster is active (primary
A or its MirrorMaker 2 replica B), agents share the partitions, and operators
steer the fleet with etcd keys.

Start an agent with 'kswitch agent --config kswitch.yaml'; look at a fleet
with 'kswitch status --etcd 127.0.0.1:2379 --fleet orders'.`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().StringVar(&g.logFormat, "log-format", "json", "log format: json (one object a line) or console (human-readable); for agent, overrides log.format")
	root.PersistentFlags().StringVar(&g.logLevel, "log-level", "info", "log level: debug, info, warn or error; for agent, overrides log.level")
	root.AddCommand(newAgentCmd(g), newStatusCmd(g), newOffsetsCmd(g), newFailoverCmd(g), newPauseCmd(g), newResumeCmd(g), newSignalsCmd(g), newRoutesCmd(g), newConfigCmd(g), newDemoCmd(g), newVersionCmd())
	return root
}

func newVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "version",
		Short:   "Print the kswitch version",
		Example: "  kswitch version",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			fmt.Fprintln(cmd.OutOrStdout(), "kswitch", version.String())
			return nil
		},
	}
}

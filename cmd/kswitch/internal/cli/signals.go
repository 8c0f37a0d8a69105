package cli

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/user"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/kswitch/kswitch/fleet"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/signals"
)

// signalFlags are the flags of pause and resume.
type signalFlags struct {
	etcd                  etcdFlags
	topic, agent, channel string
	reason                string
}

func (f *signalFlags) bind(cmd *cobra.Command, verb string) {
	f.etcd.bind(cmd)
	fs := cmd.Flags()
	fs.StringVar(&f.topic, "topic", "", verb+" every partition of this source topic, on every agent")
	fs.StringVar(&f.agent, "agent", "", verb+" every partition this agent consumes")
	fs.StringVar(&f.channel, "channel", "", verb+" the records routed to this channel")
	fs.StringVar(&f.reason, "reason", "", "why, recorded in the key's value with the time and who wrote it")
	cmd.MarkFlagsMutuallyExclusive("topic", "agent", "channel")
}

// scope returns the scope the flags name: the fleet when no scope flag is
// given.
func (f *signalFlags) scope(cmd *cobra.Command) (signals.Scope, string, error) {
	for _, c := range []struct {
		flag, name string
		kind       signals.Kind
	}{{"topic", f.topic, signals.Topic}, {"agent", f.agent, signals.Agent}, {"channel", f.channel, signals.Channel}} {
		if !cmd.Flags().Changed(c.flag) {
			continue
		}
		if err := keys.ValidName(c.name); err != nil {
			return signals.Scope{}, "", fmt.Errorf("--%s %q: %v", c.flag, c.name, err)
		}
		return signals.Scope{Kind: c.kind, Name: c.name}, fmt.Sprintf(" --%s %s", c.flag, c.name), nil
	}
	return signals.Scope{Kind: signals.Fleet}, "", nil
}

// signalAuthor is user@host of the operator, for the note of a signal.
func signalAuthor(environ []string) string {
	name := ""
	for _, v := range []string{"USER", "LOGNAME", "USERNAME"} {
		if name = signalEnv(environ, v); name != "" {
			break
		}
	}
	if name == "" {
		if u, err := user.Current(); err == nil {
			name = u.Username
		}
	}
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown-host"
	}
	return strings.Join(strings.Fields(cmp.Or(name, "unknown")), "_") + "@" + host
}

func signalEnv(environ []string, name string) string {
	for _, kv := range environ {
		if v, ok := strings.CutPrefix(kv, name+"="); ok {
			return v
		}
	}
	return ""
}

func newPauseCmd(g *globals) *cobra.Command {
	return newSignalCmd(g, true)
}

func newResumeCmd(g *globals) *cobra.Command {
	return newSignalCmd(g, false)
}

func newSignalCmd(g *globals, pause bool) *cobra.Command {
	var f signalFlags
	cmd := &cobra.Command{Args: cobra.NoArgs}
	describeSignalCmd(cmd, pause)
	f.bind(cmd, signalVerb(pause))
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		return f.run(cmd, g.environ, pause)
	}
	return cmd
}

// signalVerb is the command that writes pause (or start): pause or resume.
func signalVerb(pause bool) string {
	return map[bool]string{true: "pause", false: "resume"}[pause]
}

// describeSignalCmd sets the usage, help and examples of pause (or, when
// pause is false, resume).
func describeSignalCmd(cmd *cobra.Command, pause bool) {
	if pause {
		cmd.Use = "pause [--topic T | --agent ID | --channel C] [--reason TEXT]"
		cmd.Short = "Pause the fleet, a topic, an agent or a channel (a signal key in etcd)"
		cmd.Long = `Pause consumption by writing "pause" to a signal key in etcd:

  /kswitch/<fleet>/signals/fleet              no flag: every partition of the fleet
  /kswitch/<fleet>/signals/topic/<T>          --topic T: every partition of topic T
  /kswitch/<fleet>/signals/agent/<ID>         --agent ID: every partition agent ID consumes
  /kswitch/<fleet>/signals/channel/<C>        --channel C: records routed to channel C

Agents watch these keys and obey within milliseconds: they stop fetching the
paused partitions, let the records already handed out finish, commit, and
keep their assignment; 'kswitch resume' continues from exactly there. A
channel pause holds the records bound for the channel without dropping them
and without committing past them. A partition is paused while the fleet, its
topic or its agent is paused: resuming one scope does not resume the others
('kswitch signals' lists them all).

The value written is 'pause # <time, UTC> by <user>@<host>: <reason>'.
etcdctl works as well: the value is the word pause or start (any case),
optionally followed by " # " and a note; a deleted key means start; any
other value is refused and the state before it stays in force.`
		cmd.Example = `  kswitch pause --etcd 127.0.0.1:2379 --fleet orders --reason "downstream upgrade"
  kswitch pause --config kswitch.yaml --topic payments --reason "bad batch upstream"
  kswitch pause --config kswitch.yaml --agent agent-2
  kswitch pause --config kswitch.yaml --channel audit

  # the same with etcdctl
  etcdctl put /kswitch/orders/signals/fleet pause
  etcdctl put /kswitch/orders/signals/topic/payments 'pause # bad batch upstream'`
	} else {
		cmd.Use = "resume [--topic T | --agent ID | --channel C] [--reason TEXT]"
		cmd.Short = "Resume what 'kswitch pause' paused (writes start to the signal key)"
		cmd.Long = `Resume consumption by writing "start" to a signal key in etcd (the same keys
as 'kswitch pause': no flag for the fleet, or one of --topic, --agent,
--channel). The key is overwritten rather than deleted so that its value,
'start # <time, UTC> by <user>@<host>: <reason>', and etcd's history show who
resumed and why. Agents continue each partition from where it was paused.

A partition stays paused while another scope covering it (the fleet, its
topic or its agent) is paused; resume prints the scopes still paused.`
		cmd.Example = `  kswitch resume --etcd 127.0.0.1:2379 --fleet orders
  kswitch resume --config kswitch.yaml --topic payments --reason "upstream fixed"

  # the same with etcdctl (deleting the key also means start)
  etcdctl put /kswitch/orders/signals/fleet start
  etcdctl del /kswitch/orders/signals/topic/payments`
	}
}

// run writes pause (or start) with a note of when, who and why to the
// signal key of the scope the flags name, says what it did and, without
// failing, what other scopes are still paused and which values etcd holds
// that the agents refuse.
func (f *signalFlags) run(cmd *cobra.Command, environ []string, pause bool) error {
	verb := signalVerb(pause)
	scope, flag, err := f.scope(cmd)
	if err != nil {
		return err
	}
	if strings.ContainsAny(f.reason, "\r\n") {
		return fmt.Errorf("--reason: must be one line")
	}
	if _, err := f.etcd.resolve(environ); err != nil {
		return err
	}
	note := time.Now().UTC().Format(time.RFC3339) + " by " + signalAuthor(environ)
	if r := strings.TrimSpace(f.reason); r != "" {
		note += ": " + r
	}
	value, err := signals.Format(pause, note)
	if err != nil {
		return fmt.Errorf("--reason: %w", err)
	}
	c, err := f.etcd.client()
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(cmd.Context(), f.etcd.timeout)
	defer cancel()
	op, err := fleet.NewOperator(c, f.etcd.fleet)
	if err != nil {
		return err
	}
	k := op.Keys()
	write := op.Resume
	if pause {
		write = op.Pause
	}
	if err := write(ctx, scope, note); err != nil {
		return fmt.Errorf("%s %s (etcd %v): %w", verb, scope, f.etcd.endpoints, err)
	}
	w := cmd.OutOrStdout()
	fmt.Fprintf(w, "put %s = %q\n", scope.Key(k), value)
	if pause {
		fmt.Fprintf(w, "%s paused; 'kswitch resume%s' starts it again\n", scope, flag)
	} else {
		fmt.Fprintf(w, "%s started\n", scope)
	}
	warnOtherSignals(ctx, cmd, op, scope, pause)
	return nil
}

// warnOtherSignals tells the operator what still holds after scope was
// paused (or, when pause is false, started): after a resume, the other
// scopes still paused; in any case, the values refused at other keys. The
// write is done, so a failure to read the signals is only a warning.
func warnOtherSignals(ctx context.Context, cmd *cobra.Command, op *fleet.Operator, scope signals.Scope, pause bool) {
	s, err := op.Signals(ctx)
	if err != nil {
		fmt.Fprintf(cmd.ErrOrStderr(), "warning: could not read the other signals: %v\n", err)
		return
	}
	var still []string
	for _, sig := range s.Signals() {
		if sig.Paused && sig.Scope != scope {
			still = append(still, sig.Scope.String())
		}
	}
	if !pause && len(still) > 0 {
		fmt.Fprintf(cmd.OutOrStdout(), "still paused: %s\n", strings.Join(still, ", "))
	}
	for _, r := range s.Refusals() {
		if r.Key == scope.Key(op.Keys()) {
			continue // overwritten just now
		}
		fmt.Fprintf(cmd.ErrOrStderr(), "warning: refused value %q at %s: %s\n", r.Value, r.Key, r.Reason)
	}
}

func newSignalsCmd(g *globals) *cobra.Command {
	var ef etcdFlags
	var output string
	cmd := &cobra.Command{
		Use:   "signals [-o table|json]",
		Short: "List the pause/start signals of a fleet and any refused values",
		Long: `List every signal key of a fleet in etcd (/kswitch/<fleet>/signals/…) with
the state in force (paused or started), the note written with it (by
'kswitch pause' and 'kswitch resume': when, by whom, why) and the etcd
revision of that value. A scope without a key is started.

Values that are not "pause" or "start" (optionally followed by " # note")
are refused: they are listed with the reason, and the scope keeps the state
of its last valid value, which is what the table shows.`,
		Example: `  kswitch signals --etcd 127.0.0.1:2379 --fleet orders
  kswitch signals --config kswitch.yaml -o json`,
		Args: cobra.NoArgs,
	}
	ef.bind(cmd)
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table or json")
	cmd.RunE = ef.runWith(g.environ, &output, []string{"table", "json"}, func(cmd *cobra.Command, cn *conn) error {
		s, err := cn.op.Signals(cn.ctx)
		if err != nil {
			return fmt.Errorf("read signals of fleet %q from etcd %v: %w", ef.fleet, ef.endpoints, err)
		}
		if output == "json" {
			type view struct {
				Fleet    string            `json:"fleet"`
				Revision int64             `json:"revision"`
				Signals  []signals.Signal  `json:"signals"`
				Refusals []signals.Refusal `json:"refusals"`
			}
			v := view{Fleet: ef.fleet, Revision: s.Revision(), Signals: s.Signals(), Refusals: s.Refusals()}
			if v.Signals == nil {
				v.Signals = []signals.Signal{}
			}
			if v.Refusals == nil {
				v.Refusals = []signals.Refusal{}
			}
			enc := json.NewEncoder(cmd.OutOrStdout())
			enc.SetIndent("", "  ")
			enc.SetEscapeHTML(false)
			return enc.Encode(v)
		}
		return printSignals(cmd.OutOrStdout(), ef.fleet, s)
	})
	return cmd
}

func printSignals(w io.Writer, fleet string, s signals.State) error {
	fmt.Fprintf(w, "fleet %s, signals at etcd revision %d\n\n", fleet, s.Revision())
	sigs := s.Signals()
	if len(sigs) == 0 {
		fmt.Fprintln(w, "no signal keys: nothing is paused")
	} else {
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "SCOPE\tSTATE\tREVISION\tNOTE")
		for _, sig := range sigs {
			state := "started"
			if sig.Paused {
				state = "paused"
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\n", sig.Scope, state, sig.Revision, cmp.Or(oneLine(sig.Note), "-"))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	refused := s.Refusals()
	if len(refused) == 0 {
		return nil
	}
	fmt.Fprintln(w, "\nrefused values (each key keeps the state of its last valid value):")
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "KEY\tREVISION\tVALUE\tREASON")
	for _, r := range refused {
		fmt.Fprintf(tw, "%s\t%d\t%q\t%s\n", r.Key, r.Revision, r.Value, oneLine(r.Reason))
	}
	return tw.Flush()
}

// oneLine replaces control characters, so a note written with etcdctl
// cannot break the table.
func oneLine(s string) string {
	return strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return ' '
		}
		return r
	}, s)
}

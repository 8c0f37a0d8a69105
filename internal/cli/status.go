package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/fleet"
	"github.com/kswitch/kswitch/fleetview"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
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
		printFleet(cmd.OutOrStdout(), v, time.Now())
		topics.print(cmd.OutOrStdout())
		return nil
	})
	return cmd
}

func noteOf(note string) string {
	if note == "" {
		return ""
	}
	return ": " + note
}

func orDash(n int64) string {
	if n < 0 {
		return "-"
	}
	return fmt.Sprint(n)
}

func printFleet(w io.Writer, v fleetview.FleetView, now time.Time) {
	leader := "(none)"
	if v.Leader != "" {
		leader = fmt.Sprintf("%s (fencing token %d)", v.Leader, v.Token)
	}
	active := "(not decided yet)"
	if a := v.Active; a != nil {
		active = fmt.Sprintf("%s (epoch %d, %s since %s: %s)", a.Cluster, a.Epoch, a.Phase, a.Since.Format(time.RFC3339), a.Reason)
	}
	config := "the agents' files (no dynamic version)"
	if cv := v.Config.Version; cv.Number > 0 {
		config = fmt.Sprintf("version %d, accepted %s (changed: %s)", cv.Number, cv.At.Format(time.RFC3339), strings.Join(cv.Changed, ", "))
	}
	fmt.Fprintf(w, "fleet:   %s\nleader:  %s\nactive:  %s\n", v.Fleet, leader, active)
	if a := v.Active; a != nil {
		for _, t := range slices.Sorted(maps.Keys(a.Topics)) {
			e := a.Topics[t]
			where := "consumed there"
			if e.Phase == state.PhaseSwitching {
				where = "moving there from " + e.From
			}
			fmt.Fprintf(w, "topic:   %s on %s (epoch %d, %s since %s: %s)\n", t, e.Cluster, e.Epoch, where, e.Since.Format(time.RFC3339), e.Reason)
		}
	}
	if fb := v.Failback; fb != nil {
		verdict := "the primary holds everything consumed here"
		if !fb.CaughtUp {
			verdict = "waiting: " + fb.Reason
		}
		fmt.Fprintf(w, "failback: %s (checked %s)\n", verdict, fb.Checked.Format(time.RFC3339))
	}
	if st := v.Stages; st != nil {
		var stages []string
		for i, sg := range st.Plan.Stages {
			mark := ""
			if i == st.Stage {
				mark = "*"
			}
			stages = append(stages, mark+strings.Join(sg.Topics, ","))
		}
		fmt.Fprintf(w, "stages:  to %s, stage %d of %d %s since %s: %s (%s; checked for %s each)\n", st.Plan.To, st.Stage+1, len(st.Plan.Stages),
			st.Phase, st.Since.Format(time.RFC3339), st.Reason, strings.Join(stages, "; "), st.Plan.Check)
		for _, step := range v.StageSteps {
			// The reasons carry the checks' measures.
			fmt.Fprintf(w, "  %s  stage %d %s %s: %s (leader %s)\n", step.At.Format(time.RFC3339), step.Stage+1, strings.Join(step.Topics, ","),
				step.Phase, step.Reason, step.Leader)
		}
	}
	if st := v.Stalled; st != nil && len(st.Partitions) > 0 {
		fmt.Fprintf(w, "stalled: %d partitions have no consumer (noted by %s): %s\n", len(st.Partitions), st.Leader, st.String(now))
	}
	if st := v.Stalled; st != nil {
		for _, id := range slices.Sorted(maps.Keys(st.Silent)) {
			fmt.Fprintf(w, "silent:  %s %s (noted by %s)\n", id, st.Silent[id], st.Leader)
		}
	}
	fmt.Fprintf(w, "config:  %s\nagents:  %d\n\n", config, len(v.Agents))
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "AGENT\tLEADER\tHTTP\tGOSSIP\tVERSION\tAGE\tCONFIG\tREADY")
	var notReady []string
	for _, a := range v.Agents {
		mark := ""
		if a.ID == v.Leader {
			mark = "*"
		}
		ready := "-"
		if r, ok := v.Ready[a.ID]; ok {
			switch {
			case !r.Answered:
				ready = "?"
				notReady = append(notReady, fmt.Sprintf("%s did not answer: %s", a.ID, r.Reason))
			case r.Ready:
				ready = "yes"
			default:
				ready = "no"
				notReady = append(notReady, fmt.Sprintf("%s is not ready: %s", a.ID, r.Reason))
			}
		}
		digest := "-" // an agent older than the digest
		if a.Config != nil {
			digest = a.Config.Digest
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", a.ID, mark, a.HTTP, a.Gossip, a.Version, now.Sub(a.Started).Round(time.Second), digest, ready)
	}
	tw.Flush()
	for _, r := range notReady {
		fmt.Fprintf(w, "  %s\n", r)
	}
	for _, d := range v.ConfigDisagree {
		fmt.Fprintf(w, "  %s's configuration differs from the fleet's in %s: digest %s, the fleet's %s; give every agent the same file\n",
			d.Agent, strings.Join(d.Differs, ", "), d.Digest, d.Fleet)
	}
	if a := v.Assignment; a != nil {
		placed := ""
		if secs := a.Sections(); len(secs) > 1 {
			placed = " (topics placed on " + strings.Join(secs[1:], ", ") + ")"
		}
		fmt.Fprintf(w, "\nassignment: generation %d on cluster %s%s, published %s by %s\n\n", a.Generation, a.Cluster, placed,
			a.Published.Format(time.RFC3339), a.Leader)
		tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "CLUSTER\tPARTITION\tOWNER\tCOMMITTED\tEND\tLAG")
		for _, p := range v.Partitions {
			owner := p.Owner
			if p.Revoking {
				owner += " (releasing)"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", p.Cluster, p.TopicPartition, owner, orDash(p.Committed), orDash(p.End), orDash(p.Lag))
		}
		tw.Flush()
	}
	var paused []string
	for _, s := range v.Signals.Signals() {
		if s.Paused {
			paused = append(paused, fmt.Sprintf("%s (revision %d%s)", s.Scope, s.Revision, noteOf(s.Note)))
		}
	}
	if len(paused) > 0 {
		fmt.Fprintf(w, "\npaused:  %s\n", strings.Join(paused, "\n         "))
	}
	for _, r := range v.Signals.Refusals() {
		fmt.Fprintf(w, "warning: refused %s = %q: %s\n", r.Key, r.Value, r.Reason)
	}
	for _, r := range v.Refused {
		fmt.Fprintf(w, "warning: %s\n", strings.TrimSpace(r))
	}
	if r := v.Config.Refusal; r != nil {
		fmt.Fprintf(w, "warning: the dynamic configuration at revision %d was refused (version %d stays; kswitch config show): %s\n",
			r.Revision, r.InForce, strings.ReplaceAll(r.Reason, "\n", "; "))
	}
}

package cli

import (
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// failoverOptions are the flags of 'kswitch failover'.
type failoverOptions struct {
	etcd              etcdFlags
	to, topic, stages string
	check             time.Duration
	auto              bool
}

func newFailoverCmd(g *globals) *cobra.Command {
	var o failoverOptions
	cmd := &cobra.Command{
		Use:   "failover (--to CLUSTER | --auto) [--topic TOPIC | --stages STAGES [--check DURATION]]",
		Short: "Pin the fleet (or one topic) to a cluster, or return it to automatic failover",
		Long: `Pin the fleet to a cluster: the leader switches to it (if a quorum of agents
can reach it) and stays there whatever the health verdict says, until the pin
is removed with --auto. The pin is the etcd key /kswitch/<fleet>/control/pin;
operators can do the same with etcdctl:

  etcdctl put /kswitch/orders/control/pin B     # same as --to B
  etcdctl del /kswitch/orders/control/pin       # same as --auto

A switch releases every partition, translates each committed position to the
target cluster, then resumes there; 'kswitch status' shows its progress.

With --topic, only that logical topic moves (a canary): its partitions are
released, translated and assigned on the other cluster while every other topic
goes on being consumed where it is, unpaused. The topic stays there through
the fleet's own switches while a quorum of agents reaches that cluster; if the
cluster fails it comes back to the fleet's cluster by itself. --auto --topic
returns it to wherever the fleet is. The key is
/kswitch/<fleet>/control/pin/topic/<TOPIC>:

  etcdctl put /kswitch/orders/control/pin/topic/audit B   # same as --to B --topic audit
  etcdctl del /kswitch/orders/control/pin/topic/audit     # same as --auto --topic audit

With --stages, topics move stage by stage (stages separated by ';', topics by
','): the leader moves the first stage's topics, holds them on the target for
--check, and moves the next stage only if they are healthy there: every
partition consumed, the lag not grown by more than 1000 records, and no record
dead-lettered. A stage that is not healthy is moved back and the move stops
(the earlier stages stay). Each step is in history/stages/ and kswitch status.
An automatic failover or a fleet pin overrides a move in progress. --auto
--stages ends the move: its topics go back to the fleet's cluster. The key is
/kswitch/<fleet>/control/stages (YAML):

  etcdctl put /kswitch/orders/control/stages "$(printf 'to: B\ncheck: 30s\nstages:\n  - topics: [audit, clicks]\n  - topics: [orders, payments]\n')"`,
		Example: `  kswitch failover --etcd 127.0.0.1:2379 --fleet orders --to B
  kswitch failover --config kswitch.yaml --auto
  kswitch failover --config kswitch.yaml --to B --topic audit
  kswitch failover --config kswitch.yaml --auto --topic audit
  kswitch failover --config kswitch.yaml --to B --stages "audit,clicks;orders,payments" --check 30s
  kswitch failover --config kswitch.yaml --auto --stages`,
		Args: cobra.NoArgs,
	}
	o.etcd.bind(cmd)
	cmd.Flags().StringVar(&o.to, "to", "", "cluster to pin the fleet to (the primary or the standby)")
	cmd.Flags().BoolVar(&o.auto, "auto", false, "remove the pin: automatic failover and failback")
	cmd.Flags().StringVar(&o.topic, "topic", "", "pin (or, with --auto, unpin) this logical topic alone")
	cmd.Flags().StringVar(&o.stages, "stages", "", "move topics stage by stage: \"audit,clicks;orders,payments\" (with --auto: any value, or none with --stages=, ends the move)")
	cmd.Flags().DurationVar(&o.check, "check", 30*time.Second, "with --stages: how long each stage is held and checked before the next")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		return o.run(cmd, g.environ)
	}
	return cmd
}

// run checks the flags, writes (or, with --auto, deletes) the fleet's pin,
// a topic's pin or a staged move, and prints where the fleet is now. A
// malformed --stages is refused before etcd is touched; the names are
// checked against --config when it is given.
func (o *failoverOptions) run(cmd *cobra.Command, environ []string) error {
	if (o.to == "") == !o.auto {
		return fmt.Errorf("give exactly one of --to CLUSTER and --auto")
	}
	staged := cmd.Flags().Changed("stages")
	if staged && o.topic != "" {
		return fmt.Errorf("give --topic or --stages, not both")
	}
	var plan state.StagePlan
	if staged && !o.auto {
		var err error
		if plan, err = o.stagePlan(); err != nil {
			return err
		}
	}
	cn, err := o.etcd.open(cmd, environ)
	if err != nil {
		return err
	}
	defer cn.close()
	if err := o.checkNames(cn.cfg, plan); err != nil {
		return err
	}
	w := cmd.OutOrStdout()
	if err := o.write(w, cn, staged, plan); err != nil {
		return err
	}
	printActive(w, cn)
	return nil
}

// stagePlan parses --stages (stages separated by ';', topics by ',') and
// --check into the plan for the leader, and validates it as the leader
// will, so that a malformed plan is refused before etcd is touched.
func (o *failoverOptions) stagePlan() (state.StagePlan, error) {
	plan := state.StagePlan{To: o.to, Check: o.check}
	for i, st := range strings.Split(o.stages, ";") {
		var ts []string
		for _, t := range strings.Split(st, ",") {
			if t = strings.TrimSpace(t); t != "" {
				ts = append(ts, t)
			}
		}
		if len(ts) == 0 {
			return state.StagePlan{}, fmt.Errorf("--stages %q: stage %d has no topics (stages are separated by ';', topics by ',')", o.stages, i+1)
		}
		plan.Stages = append(plan.Stages, state.Stage{Topics: ts})
	}
	if _, err := state.ParseStagePlan([]byte(state.FormatStagePlan(plan)), nil); err != nil {
		return state.StagePlan{}, fmt.Errorf("--stages %q --check %s: %v", o.stages, o.check, err)
	}
	return plan, nil
}

// checkNames refuses a --topic, --to or topic of plan that is not a valid
// name or, when --config is given, not one of its source topics or its
// primary or standby cluster.
func (o *failoverOptions) checkNames(cfg config.Config, plan state.StagePlan) error {
	if o.topic != "" {
		if err := keys.ValidName(o.topic); err != nil {
			return fmt.Errorf("--topic %q: %v", o.topic, err)
		}
		if o.notSource(cfg, o.topic) {
			return fmt.Errorf("--topic %q: not a source topic of %s (its topics: %s)", o.topic, o.etcd.file, strings.Join(cfg.Source.Topics, ", "))
		}
	}
	if o.to != "" {
		if err := keys.ValidName(o.to); err != nil {
			return fmt.Errorf("--to %q: %v", o.to, err)
		}
		if cl, ok := cfg.Clusters[o.to]; o.etcd.file != "" && (!ok || (cl.Role != config.RolePrimary && cl.Role != config.RoleStandby)) {
			return fmt.Errorf("--to %q: not the primary or standby cluster of %s", o.to, o.etcd.file)
		}
	}
	for _, st := range plan.Stages {
		for _, t := range st.Topics {
			if o.notSource(cfg, t) {
				return fmt.Errorf("--stages: %q is not a source topic of %s (its topics: %s)", t, o.etcd.file, strings.Join(cfg.Source.Topics, ", "))
			}
		}
	}
	return nil
}

// notSource reports whether --config lists source topics and topic is not
// one of them.
func (o *failoverOptions) notSource(cfg config.Config, topic string) bool {
	return o.etcd.file != "" && len(cfg.Source.Topics) > 0 && !slices.Contains(cfg.Source.Topics, topic)
}

// write puts or deletes the key the flags ask for (the staged move, a
// topic's pin or the fleet's pin) and says on w what the leader does next.
func (o *failoverOptions) write(w io.Writer, cn *conn, staged bool, plan state.StagePlan) error {
	op, ctx, k := cn.op, cn.ctx, cn.keys
	to, topic := o.to, o.topic
	switch {
	case staged && o.auto:
		if err := op.EndStagedMove(ctx); err != nil {
			return err
		}
		fmt.Fprintf(w, "deleted %s: the staged move ends, its topics go back to the fleet's cluster\n", k.Stages())
	case staged:
		if err := op.MoveInStages(ctx, plan); err != nil {
			return err
		}
		fmt.Fprintf(w, "put %s: the leader moves %d stages to %s, each held and checked for %s; follow it with 'kswitch status'\n",
			k.Stages(), len(plan.Stages), to, o.check)
	case topic != "" && o.auto:
		if err := op.UnpinTopic(ctx, topic); err != nil {
			return err
		}
		fmt.Fprintf(w, "deleted %s: %s goes back to the fleet's cluster\n", k.TopicPin(topic), topic)
	case topic != "":
		if err := op.PinTopic(ctx, topic, to); err != nil {
			return err
		}
		fmt.Fprintf(w, "put %s = %s: the leader moves %s alone to %s and keeps it there until 'kswitch failover --auto --topic %s'\n",
			k.TopicPin(topic), to, topic, to, topic)
	case o.auto:
		if err := op.Unpin(ctx); err != nil {
			return err
		}
		fmt.Fprintf(w, "deleted %s: automatic failover and failback\n", k.Pin())
	default:
		if err := op.Pin(ctx, to); err != nil {
			return err
		}
		fmt.Fprintf(w, "put %s = %s: the leader switches to %s and stays there until 'kswitch failover --auto'\n", k.Pin(), to, to)
	}
	return nil
}

// printActive prints the fleet's active cluster and the topics placed on
// their own, when etcd tells them; the write is done, so a failure to read
// them is not one of the command's.
func printActive(w io.Writer, cn *conn) {
	a, ok, err := cn.op.Active(cn.ctx)
	if err != nil || !ok {
		return
	}
	fmt.Fprintf(w, "now: cluster %s, epoch %d, %s (%s)\n", a.Cluster, a.Epoch, a.Phase, a.Reason)
	for _, t := range slices.Sorted(maps.Keys(a.Topics)) {
		e := a.Topics[t]
		fmt.Fprintf(w, "now: topic %s on %s, epoch %d, %s (%s)\n", t, e.Cluster, e.Epoch, e.Phase, e.Reason)
	}
}

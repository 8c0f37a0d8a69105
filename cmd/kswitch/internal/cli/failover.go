package cli

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

func newFailoverCmd(g *globals) *cobra.Command {
	var ef etcdFlags
	var to, topic, stages string
	var check time.Duration
	var auto bool
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
	ef.bind(cmd)
	cmd.Flags().StringVar(&to, "to", "", "cluster to pin the fleet to (the primary or the standby)")
	cmd.Flags().BoolVar(&auto, "auto", false, "remove the pin: automatic failover and failback")
	cmd.Flags().StringVar(&topic, "topic", "", "pin (or, with --auto, unpin) this logical topic alone")
	cmd.Flags().StringVar(&stages, "stages", "", "move topics stage by stage: \"audit,clicks;orders,payments\" (with --auto: any value, or none with --stages=, ends the move)")
	cmd.Flags().DurationVar(&check, "check", 30*time.Second, "with --stages: how long each stage is held and checked before the next")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		if (to == "") == !auto {
			return fmt.Errorf("give exactly one of --to CLUSTER and --auto")
		}
		staged := cmd.Flags().Changed("stages")
		if staged && topic != "" {
			return fmt.Errorf("give --topic or --stages, not both")
		}
		var plan state.StagePlan
		if staged && !auto {
			plan = state.StagePlan{To: to, Check: check}
			for i, st := range strings.Split(stages, ";") {
				var ts []string
				for _, t := range strings.Split(st, ",") {
					if t = strings.TrimSpace(t); t != "" {
						ts = append(ts, t)
					}
				}
				if len(ts) == 0 {
					return fmt.Errorf("--stages %q: stage %d has no topics (stages are separated by ';', topics by ',')", stages, i+1)
				}
				plan.Stages = append(plan.Stages, state.Stage{Topics: ts})
			}
			if _, err := state.ParseStagePlan([]byte(state.FormatStagePlan(plan)), nil); err != nil {
				return fmt.Errorf("--stages %q --check %s: %v", stages, check, err)
			}
		}
		cn, err := ef.open(cmd, g.environ)
		if err != nil {
			return err
		}
		defer cn.close()
		cfg, ctx, k := cn.cfg, cn.ctx, cn.keys
		if topic != "" {
			if err := keys.ValidName(topic); err != nil {
				return fmt.Errorf("--topic %q: %v", topic, err)
			}
			if ef.file != "" && len(cfg.Source.Topics) > 0 && !slices.Contains(cfg.Source.Topics, topic) {
				return fmt.Errorf("--topic %q: not a source topic of %s (its topics: %s)", topic, ef.file, strings.Join(cfg.Source.Topics, ", "))
			}
		}
		if to != "" {
			if err := keys.ValidName(to); err != nil {
				return fmt.Errorf("--to %q: %v", to, err)
			}
			if cl, ok := cfg.Clusters[to]; ef.file != "" && (!ok || (cl.Role != config.RolePrimary && cl.Role != config.RoleStandby)) {
				return fmt.Errorf("--to %q: not the primary or standby cluster of %s", to, ef.file)
			}
		}
		op, w := cn.op, cmd.OutOrStdout()
		switch {
		case staged && auto:
			if err := op.EndStagedMove(ctx); err != nil {
				return err
			}
			fmt.Fprintf(w, "deleted %s: the staged move ends, its topics go back to the fleet's cluster\n", k.Stages())
		case staged:
			for _, st := range plan.Stages {
				for _, t := range st.Topics {
					if ef.file != "" && len(cfg.Source.Topics) > 0 && !slices.Contains(cfg.Source.Topics, t) {
						return fmt.Errorf("--stages: %q is not a source topic of %s (its topics: %s)", t, ef.file, strings.Join(cfg.Source.Topics, ", "))
					}
				}
			}
			if err := op.MoveInStages(ctx, plan); err != nil {
				return err
			}
			fmt.Fprintf(w, "put %s: the leader moves %d stages to %s, each held and checked for %s; follow it with 'kswitch status'\n",
				k.Stages(), len(plan.Stages), to, check)
		case topic != "" && auto:
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
		case auto:
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
		if a, ok, err := op.Active(ctx); err == nil && ok {
			fmt.Fprintf(w, "now: cluster %s, epoch %d, %s (%s)\n", a.Cluster, a.Epoch, a.Phase, a.Reason)
			for _, t := range slices.Sorted(maps.Keys(a.Topics)) {
				e := a.Topics[t]
				fmt.Fprintf(w, "now: topic %s on %s, epoch %d, %s (%s)\n", t, e.Cluster, e.Epoch, e.Phase, e.Reason)
			}
		}
		return nil
	}
	return cmd
}

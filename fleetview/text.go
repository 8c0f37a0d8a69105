package fleetview

import (
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kswitch/kswitch/state"
)

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

// WriteText writes v as 'kswitch status' prints it: the leader, the
// active cluster and the topics placed elsewhere, the configuration in
// force, a failback wait, a staged move and its steps, the agents (with
// their answers when asked), the assignment with positions and lag, the
// paused scopes, stalled partitions and refused values. now is the time
// ages are counted to.
func (v FleetView) WriteText(w io.Writer, now time.Time) {
	v.writeActive(w)
	v.writeClusters(w, now)
	v.writeFailback(w)
	v.writeStages(w)
	v.writeStalled(w, now)
	fmt.Fprintf(w, "config:  %s\nagents:  %d\n\n", v.configText(), len(v.Agents))
	v.writeAgents(w, now)
	v.writeAssignment(w)
	v.writeWarnings(w)
}

// writeActive writes the fleet, its leader, the active cluster and each
// topic placed on a cluster of its own.
func (v FleetView) writeActive(w io.Writer) {
	leader := "(none)"
	if v.Leader != "" {
		leader = fmt.Sprintf("%s (fencing token %d)", v.Leader, v.Token)
	}
	active := "(not decided yet)"
	if a := v.Active; a != nil {
		active = fmt.Sprintf("%s (epoch %d, %s since %s: %s)", a.Cluster, a.Epoch, a.Phase, a.Since.Format(time.RFC3339), a.Reason)
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
}

// writeClusters writes the leader's view of the source clusters, in
// order of preference: place, health and how far each is behind the
// active one.
func (v FleetView) writeClusters(w io.Writer, now time.Time) {
	cs := v.Clusters
	if cs == nil {
		return
	}
	fmt.Fprintf(w, "clusters: in order of failover, as the leader %s saw them %s ago\n", cs.Leader, now.Sub(cs.Updated).Round(time.Second))
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  PLACE\tCLUSTER\tHEALTH\tREACHED BY\tBEHIND THE ACTIVE ONE")
	for _, c := range cs.Clusters {
		place := "primary"
		if c.Place > 0 {
			place = fmt.Sprintf("standby %d", c.Place)
		}
		health := "down"
		if c.Up {
			health = "up"
		}
		if !c.Since.IsZero() {
			health += " for " + now.Sub(c.Since).Round(time.Second).String()
		}
		behind := "-"
		switch {
		case c.Name == cs.Active:
			behind, place = "(active)", place+" *"
		case c.Behind == 0:
			behind = fmt.Sprintf("caught up (checked %s ago)", now.Sub(c.Checked).Round(time.Second))
		case c.Behind > 0:
			behind = fmt.Sprintf("%d partitions, %d records (checked %s ago)", c.Behind, c.Lacking, now.Sub(c.Checked).Round(time.Second))
		case c.Up:
			behind = "not checked yet"
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%d of %d agents\t%s\n", place, c.Name, health, c.Reached, c.Agents, behind)
	}
	tw.Flush()
}

// writeFailback writes the leader's last failback check, when the fleet
// is on the standby: why it does not fail back yet.
func (v FleetView) writeFailback(w io.Writer) {
	if fb := v.Failback; fb != nil {
		verdict := "the primary holds everything consumed here"
		if fb.To != "" {
			verdict = fb.To + " holds everything consumed here"
		}
		if !fb.CaughtUp {
			verdict = "waiting: " + fb.Reason
		}
		fmt.Fprintf(w, "failback: %s (checked %s)\n", verdict, fb.Checked.Format(time.RFC3339))
	}
}

// writeStages writes a staged move, its stages (the current one marked
// with *) and its steps so far.
func (v FleetView) writeStages(w io.Writer) {
	st := v.Stages
	if st == nil {
		return
	}
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

// writeStalled writes the partitions the leader found without a consumer
// and the agents it found silent.
func (v FleetView) writeStalled(w io.Writer, now time.Time) {
	st := v.Stalled
	if st == nil {
		return
	}
	if len(st.Partitions) > 0 {
		fmt.Fprintf(w, "stalled: %d partitions have no consumer (noted by %s): %s\n", len(st.Partitions), st.Leader, st.String(now))
	}
	for _, id := range slices.Sorted(maps.Keys(st.Silent)) {
		fmt.Fprintf(w, "silent:  %s %s (noted by %s)\n", id, st.Silent[id], st.Leader)
	}
}

// configText says which configuration is in force: the agents' files, or
// the dynamic version accepted last and what it changed.
func (v FleetView) configText() string {
	if cv := v.Config.Version; cv.Number > 0 {
		return fmt.Sprintf("version %d, accepted %s (changed: %s)", cv.Number, cv.At.Format(time.RFC3339), strings.Join(cv.Changed, ", "))
	}
	return "the agents' files (no dynamic version)"
}

// writeAgents writes the table of agents (the leader marked with *, each
// one's answer on /readyz when asked), then why those not ready are not,
// and the agents whose configuration differs from the fleet's.
func (v FleetView) writeAgents(w io.Writer, now time.Time) {
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
}

// writeAssignment writes the assignment, when one was published, and the
// table of its partitions with their owners, positions and lag.
func (v FleetView) writeAssignment(w io.Writer) {
	a := v.Assignment
	if a == nil {
		return
	}
	placed := ""
	if secs := a.Sections(); len(secs) > 1 {
		placed = " (topics placed on " + strings.Join(secs[1:], ", ") + ")"
	}
	fmt.Fprintf(w, "\nassignment: generation %d on cluster %s%s, published %s by %s\n\n", a.Generation, a.Cluster, placed,
		a.Published.Format(time.RFC3339), a.Leader)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
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

// writeWarnings writes the paused scopes, then a warning for each value
// refused: signals, keys that could not be parsed, and the dynamic
// configuration the leader refused last.
func (v FleetView) writeWarnings(w io.Writer) {
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

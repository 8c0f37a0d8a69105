package demo

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// Summary is the demo's result, read from C.
type Summary struct {
	// Produced is the number of records A and B acknowledged to the
	// producer; ProducedA and ProducedB split it by cluster, and
	// DeliveredA and DeliveredB count those of each on C.
	Produced               int
	ProducedA, ProducedB   int
	DeliveredA, DeliveredB int
	// Late is A's unmirrored tail, as the failback counted it: records A
	// took before it failed that B did not have, consumed after A
	// returned; LateBy is how late at most.
	Late   int64
	LateBy time.Duration
	// Delivered is how many of them are on C; OnC counts every record on
	// C, duplicates included.
	Delivered, OnC int
	// Lost is Produced - Delivered: records A or B acknowledged that
	// never reached C. Duplicated is OnC - Delivered.
	Lost, Duplicated int
	// PauseApply is from the pause signal's write to the last record to
	// reach C before deliveries stopped.
	PauseApply time.Duration
	// Failover is from cluster A failing to the first record consumed
	// from B reaching C; Failback from A's return to the first record
	// consumed from A again reaching C.
	Failover, Failback time.Duration
	// FailoverD is, in the chain story, from B failing to every agent
	// consuming D.
	FailoverD time.Duration
}

// owned lists a's partitions.
func owned(a *agent.Agent) string {
	var s []string
	for _, tp := range a.Owned() {
		s = append(s, fmt.Sprintf("%s/%d", tp.Topic, tp.Partition))
	}
	return strings.Join(s, " ")
}

// printSwitch shows the switch to cluster to from history/: it waits for
// the latest event to be a switch to to, newer than the last one shown.
// The leader may write it a little after the agents consume to.
func (d *demo) printSwitch(ctx context.Context, to string) state.SwitchEvent {
	var ev state.SwitchEvent
	err := d.await(ctx, 10*time.Second, "the switch to "+to+" in history/", func() bool {
		resp, err := d.cli.Get(ctx, keys.New(fleetName).SwitchHistory(), clientv3.WithLastKey()...)
		if err != nil || len(resp.Kvs) == 0 || json.Unmarshal(resp.Kvs[0].Value, &ev) != nil {
			return false
		}
		return ev.To == to && ev.Epoch > d.shown
	})
	if err != nil {
		d.say("    (%v)", err)
		return state.SwitchEvent{}
	}
	d.shown = ev.Epoch
	d.say("    switch %s → %s (epoch %d): %s; revoke %.0f ms, translate %.0f ms", ev.From, ev.To, ev.Epoch, ev.Reason,
		1000*ev.Phases["revoke"], 1000*ev.Phases["translate"])
	for _, p := range ev.Partitions {
		if p.Method == "none" {
			d.say("      %s/%d written on %s: nothing consumed from %s's %s yet; %s's %s from its start", p.Topic, p.Partition, p.Origin,
				ev.From, p.FromTopic, ev.To, p.ToTopic)
			continue
		}
		d.say("      %s/%d written on %s: %s's %s offset %d → %s's %s offset %d by %s (rewound %d)", p.Topic, p.Partition, p.Origin,
			ev.From, p.FromTopic, p.FromOffset, ev.To, p.ToTopic, p.ToOffset, p.Method, p.Rewound)
	}
	return ev
}

// summarize reads C to the end of every partition and counts what
// reached it of what A and B acknowledged.
func (d *demo) summarize(ctx context.Context) (Summary, error) {
	s := Summary{PauseApply: d.pauseApply, Failover: d.failover, Failback: d.failback, FailoverD: d.failoverD, Late: d.late, LateBy: d.lateBy}
	if d.prod == nil || d.c2 == nil {
		return s, nil
	}
	d.prod.stop()
	seen, err := readC(ctx, d.c.Brokers())
	if err != nil {
		return s, err
	}
	for _, p := range d.producers() {
		for _, id := range p.ids() {
			delivered := 0
			if seen[id] > 0 {
				delivered = 1
			}
			if p.cluster == "B" {
				s.ProducedB++
				s.DeliveredB += delivered
			} else {
				s.ProducedA++
				s.DeliveredA += delivered
			}
		}
	}
	s.Produced, s.Delivered = s.ProducedA+s.ProducedB, s.DeliveredA+s.DeliveredB
	for _, n := range seen {
		s.OnC += n
	}
	s.Lost = s.Produced - s.Delivered
	s.Duplicated = s.OnC - s.Delivered
	d.say("read C back: every partition of %s to its end, %d records", outTopic, s.OnC)
	return s, nil
}

func (d *demo) printSummary(s Summary) {
	fmt.Fprintln(d.o.Out)
	tw := tabwriter.NewWriter(d.o.Out, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "records written to A (acknowledged)\t%d\n", s.ProducedA)
	fmt.Fprintf(tw, "  of which delivered to C (read back from C)\t%d\n", s.DeliveredA)
	fmt.Fprintf(tw, "records written to B during the outage\t%d\n", s.ProducedB)
	fmt.Fprintf(tw, "  of which delivered to C\t%d\n", s.DeliveredB)
	fmt.Fprintf(tw, "lost\t%d\n", s.Lost)
	fmt.Fprintf(tw, "duplicated\t%d\n", s.Duplicated)
	fmt.Fprintf(tw, "late: A's unmirrored tail, delivered after A returned\t%d (by at most %v)\n", s.Late, s.LateBy.Round(100*time.Millisecond))
	if s.PauseApply > 0 {
		fmt.Fprintf(tw, "pause applied (put → last record on C)\t%v\n", s.PauseApply.Round(time.Millisecond))
	} else {
		fmt.Fprintf(tw, "pause applied (put → last record on C)\tat once: none reached C after the put\n")
	}
	fmt.Fprintf(tw, "failover (A fails → first record from B on C)\t%s\n", measured(s.Failover))
	fmt.Fprintf(tw, "failback (A back → first record from A on C)\t%s\n", measured(s.Failback))
	tw.Flush()
	if s.Duplicated > 0 && !d.o.ExactlyOnce {
		fmt.Fprintln(d.o.Out, "(duplicates: delivery is at least once (try --exactly-once); a killed agent's last records reached C before their offsets were committed, and its partitions' next owners delivered them again;"+
			" records the fleet took from A just before it failed that B did not have (the failover's lagged) are delivered again after A returns)")
	}
}

// measured shows a time the story measured, or that it did not get
// that far.
func measured(t time.Duration) string {
	if t == 0 {
		return "not measured: the story stopped before"
	}
	return t.Round(time.Millisecond).String()
}

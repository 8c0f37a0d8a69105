package demo

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/keys"
)

// The chain story (kswitch demo --clusters 3): two cities, three data
// centres. A is the primary, B the same-city standby (priority 1), D the
// remote one (priority 2); mirrors copy A to B and A to D (a star, as
// MirrorMaker 2 would: A.orders on each). The producer writes to A and
// waits for it while it is down. A fails and the fleet moves to B; B fails
// while the fleet consumes it and the fleet moves to D (no mirror joins B
// and D: the records' fingerprints translate); A returns while B stays
// down, and the fleet fails back to A directly.

// setUpChain starts what the chain story runs on.
func (d *demo) setUpChain(ctx context.Context) error {
	if err := d.startEtcd(); err != nil {
		return err
	}
	var err error
	if d.a, err = startKafka(d.dir, "A", topic); err != nil {
		return err
	}
	if d.b, err = startKafka(d.dir, "B", ""); err != nil {
		return err
	}
	if d.far, err = startKafka(d.dir, "D", ""); err != nil {
		return err
	}
	if d.c, err = startKafka(d.dir, "C", outTopic); err != nil {
		return err
	}
	d.say("two cities, three data centres: etcd %s; Kafka A %s (primary, topic %s, %d partitions), B %s (standby, priority 1: the same city), D %s (standby, priority 2: the remote city), C %s (topic %s)",
		d.etcd.Endpoints()[0], d.a.Brokers()[0], topic, partitions, d.b.Brokers()[0], d.far.Brokers()[0], d.c.Brokers()[0], outTopic)
	if d.ab, err = d.startMirror(ctx, d.a, d.b, 100); err != nil {
		return err
	}
	if d.ad, err = d.startMirror(ctx, d.a, d.far, 200); err != nil {
		return err
	}
	d.say("mirrors A → B and A → D (a star, like MirrorMaker 2): A's %s is A.%s on B (offsets 100 ahead) and on D (200 ahead); nothing joins B and D", topic, topic)
	return d.startFleet(ctx)
}

// chainClusters gives cfg the chain story's source clusters, their order
// and MirrorMaker 2's flows.
func (d *demo) chainClusters(cfg *config.Config) {
	cfg.Clusters["B"] = config.Cluster{Brokers: d.b.Brokers(), Role: config.RoleStandby, Priority: 1}
	cfg.Clusters["D"] = config.Cluster{Brokers: d.far.Brokers(), Role: config.RoleStandby, Priority: 2}
	a := cfg.Clusters["A"]
	a.OffsetSyncsOn = "" // the flows are described in cfg.Replication
	cfg.Clusters["A"] = a
	cfg.Replication = []config.Flow{{From: "A", To: "B", OffsetSyncsOn: "target"}, {From: "A", To: "D", OffsetSyncsOn: "target"}}
}

func (d *demo) chainStory(ctx context.Context) error {
	k := keys.New(fleetName)
	if err := d.steady(ctx); err != nil {
		return err
	}

	// 1. A fails. The fleet is paused first, so that B and D hold records
	// it has not consumed yet: the failover has something to deliver.
	if _, err := d.cli.Put(ctx, k.FleetSignal(), "pause # demo"); err != nil {
		return fmt.Errorf("demo: write the pause signal: %w", err)
	}
	d.say("the fleet is paused for a moment (%s), so that B and D hold records it has not consumed when A fails", k.FleetSignal())
	if err := d.sleep(ctx, d.phase/2); err != nil {
		return err
	}
	d.say("cluster A's data centre fails: A refuses every connection; the producer waits for it, the mirrors from A stop")
	failedA := time.Now()
	d.a.Fail()
	if _, err := d.cli.Put(ctx, k.FleetSignal(), "start"); err != nil {
		return fmt.Errorf("demo: write the start signal: %w", err)
	}
	if err := d.await(ctx, 20*time.Second, "the fleet consumes B", func() bool { return d.consuming("B") }); err != nil {
		return err
	}
	d.say("failover: every agent consumes B, the most preferred standby, %v after A failed", time.Since(failedA).Round(time.Millisecond))
	d.printSwitch(ctx, "B")
	if err := d.await(ctx, 10*time.Second, "a record consumed from B reaches C", func() bool {
		fromB, ok := d.c2.first(failedA, "B")
		d.failover = fromB.Sub(failedA)
		return ok
	}); err != nil {
		return err
	}
	d.say("the first record consumed from B reached C %v after A failed", d.failover.Round(time.Millisecond))

	// 2. B fails too, while the fleet consumes it.
	if err := d.sleep(ctx, d.phase/2); err != nil {
		return err
	}
	d.say("cluster B fails too, while the fleet consumes it: the next in the order is D, in the other city")
	failedB := time.Now()
	d.b.Fail()
	if err := d.await(ctx, 20*time.Second, "the fleet consumes D", func() bool { return d.consuming("D") }); err != nil {
		return err
	}
	d.failoverD = time.Since(failedB)
	d.say("failover: every agent consumes D %v after B failed; no mirror joins B and D, so the records' fingerprints translated the positions:", d.failoverD.Round(time.Millisecond))
	d.printSwitch(ctx, "D")

	// 3. A returns, B stays down: straight back to A.
	if err := d.sleep(ctx, d.phase/2); err != nil {
		return err
	}
	back := time.Now()
	d.a.Recover()
	d.say("cluster A is back with its data (B is still down); the producer's waiting records reach A, the mirror A → D copies them to D, where the fleet consumes them")
	d.say("failback waits until A has been healthy for 3s and holds everything consumed on D, then goes straight to A, not through B")
	if err := d.await(ctx, 60*time.Second, "failback to A", func() bool { return d.consuming("A") }); err != nil {
		return err
	}
	d.say("failback: every agent consumes A again %v after A came back", time.Since(back).Round(time.Millisecond))
	d.printSwitch(ctx, "A")
	if err := d.await(ctx, 10*time.Second, "a record consumed from A reaches C", func() bool {
		fromA, ok := d.c2.first(back, "A")
		d.failback = fromA.Sub(back)
		return ok
	}); err != nil {
		return err
	}
	d.say("the first record consumed from A again reached C %v after A came back", d.failback.Round(time.Millisecond))
	return d.finish(ctx)
}

// steady waits for the fleet to consume A, shows the leader and the
// assignment, and the rate reaching C over a calm phase.
func (d *demo) steady(ctx context.Context) error {
	if err := d.await(ctx, 20*time.Second, "the fleet consumes A", func() bool { return d.consuming("A") && d.leader() != nil }); err != nil {
		return err
	}
	l := d.leader()
	d.say("%s leads (fencing token %d); the fleet consumes A:", l.ID(), l.LeaderView().FencingToken)
	for _, f := range d.fleet {
		d.say("    %s owns %s", f.agent().ID(), owned(f.agent()))
	}
	began, onC := time.Now(), d.c2.count()
	if err := d.sleep(ctx, d.phase); err != nil {
		return err
	}
	d.say("steady: %d records written to A, %d on C, %.0f/s reaching C",
		d.prod.count(), d.c2.count(), float64(d.c2.count()-onC)/time.Since(began).Seconds())
	return nil
}

// finish stops the producer after a calm phase and waits for C to hold
// every record it wrote.
func (d *demo) finish(ctx context.Context) error {
	if err := d.sleep(ctx, d.phase); err != nil {
		return err
	}
	d.prod.stop()
	var ids []int64
	var to []string // the clusters written to
	for _, p := range d.producers() {
		ids = append(ids, p.ids()...)
		if !slices.Contains(to, p.cluster) {
			to = append(to, p.cluster)
		}
	}
	d.say("producer stopped after %d records (%s); waiting for C to have them all", len(ids), strings.Join(to, " and "))
	if err := d.await(ctx, 30*time.Second, "every record on C", func() bool { return d.c2.hasAll(ids) }); err != nil {
		d.say("%v", err) // the summary says which are missing
	}
	return nil
}

func (d *demo) printChainSummary(s Summary) {
	fmt.Fprintln(d.o.Out)
	tw := tabwriter.NewWriter(d.o.Out, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "records written to A (acknowledged)\t%d\n", s.Produced)
	fmt.Fprintf(tw, "  of which delivered to C (read back from C)\t%d\n", s.Delivered)
	fmt.Fprintf(tw, "lost\t%d\n", s.Lost)
	fmt.Fprintf(tw, "duplicated\t%d\n", s.Duplicated)
	fmt.Fprintf(tw, "failover A → B (A fails → first record from B on C)\t%s\n", measured(s.Failover))
	fmt.Fprintf(tw, "failover B → D (B fails → every agent consumes D)\t%s\n", measured(s.FailoverD))
	fmt.Fprintf(tw, "failback D → A (A back → first record from A on C)\t%s\n", measured(s.Failback))
	tw.Flush()
}

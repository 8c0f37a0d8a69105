// Package demo runs kswitch's live demonstration in one process: an
// embedded etcd; Kafka clusters A, B and C (kfake), with in-process
// mirrors both ways as MirrorMaker 2 runs them for a real data-centre
// outage (A's orders is A.orders on B, B's orders is B.orders on A); a
// producer writing numbered records to A, which moves to B while A is
// down and back when it returns; and a fleet of agents, each run as
// 'kswitch agent' runs it (see fleet.Member), routing every record to
// a channel on C. A scripted story is narrated as a timeline: a pause and
// start through an etcd key, A's data centre failing for everyone with an
// unmirrored tail (failover to B with translated offsets), an agent
// killed, A returning (failback, the tail delivered late). The summary is
// read from C, as a consumer downstream would see it: every record of
// each producer delivered, lost or duplicated, and how long deliveries
// stopped at each event. With Options.Clusters 3 it tells the chain story
// instead (chain.go): two cities, three data centres.
package demo

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/devstack/mirror"
	"github.com/kswitch/kswitch/fleet"
	"github.com/kswitch/kswitch/keys"
)

// Options configure a demo run. The zero value plays the default demo.
type Options struct {
	// Agents is the fleet size, at least 2. Default 3.
	Agents int
	// Rate is the producer's records per second. Default 200.
	Rate int
	// Duration is how long the calm phases of the story last altogether;
	// the switches add what they take (about 10s). Default 12s.
	Duration time.Duration
	// KeepRunning leaves everything up after the story, with the
	// producer writing again, until ctx ends.
	KeepRunning bool
	// Out receives the timeline. Default os.Stdout.
	Out io.Writer
	// Logger receives the components' logs. Default: none.
	Logger *zap.Logger
	// ExactlyOnce makes C an exactly_once cluster: the killed agent's
	// last records are not delivered twice.
	ExactlyOnce bool
	// Clusters is the number of source clusters: 2 (default: A and its
	// replica B, the outage story) or 3 (A, B and D: the chain story,
	// chain.go).
	Clusters int
}

const (
	fleetName  = "demo"
	topic      = "orders"     // on A and on B; A.orders on B and B.orders on A are the mirrors' copies
	partitions = 6            // of orders, and of outTopic on C
	channel    = "out"        // the routing channel on C
	outTopic   = "orders-out" // its topic
	// fromB numbers the records the producer writes to B while A is
	// down, so that C shows which producer wrote each.
	fromB = 1_000_000
)

// Run plays the demo and returns its summary. It returns an error when a
// record was lost or a step did not happen within its bound.
func Run(ctx context.Context, o Options) (Summary, error) {
	if o.Agents == 0 {
		o.Agents = 3
	}
	if o.Agents < 2 {
		return Summary{}, fmt.Errorf("demo: --agents %d: need at least 2 to show partitions moving", o.Agents)
	}
	if o.Rate <= 0 {
		o.Rate = 200
	}
	switch o.Clusters {
	case 0:
		o.Clusters = 2
	case 2, 3:
	default:
		return Summary{}, fmt.Errorf("demo: --clusters %d: the stories are for 2 source clusters (A and B) or 3 (A, B and D)", o.Clusters)
	}
	if o.Duration <= 0 {
		o.Duration = 12 * time.Second
	}
	if o.Out == nil {
		o.Out = os.Stdout
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	d := &demo{o: o, phase: o.Duration / 4, start: time.Now()}
	defer d.close()
	setUp, story := d.setUp, d.story
	if o.Clusters == 3 {
		setUp, story = d.setUpChain, d.chainStory
	}
	if err := setUp(ctx); err != nil {
		return Summary{}, err
	}
	err := story(ctx)
	if ctx.Err() != nil {
		return Summary{}, fmt.Errorf("demo: interrupted: %w", ctx.Err())
	}
	sum, serr := d.summarize(ctx)
	switch {
	case serr == nil && o.Clusters == 3:
		d.printChainSummary(sum)
	case serr == nil:
		d.printSummary(sum)
	}
	err = errors.Join(err, serr)
	if err == nil && sum.Lost > 0 {
		err = fmt.Errorf("demo: %d records lost: A or B acknowledged them and they never reached C", sum.Lost)
	}
	if err == nil && o.KeepRunning {
		d.keepRunning(ctx)
	}
	return sum, err
}

// demo is one run. The story runs on Run's goroutine; the producer and the
// reader of C own their goroutines and are stopped by close.
type demo struct {
	o     Options
	phase time.Duration
	start time.Time

	dir     string
	etcd    *devstack.Etcd
	a, b, c *devstack.Kafka
	ab, ba  *mirror.Mirror // A → B and B → A
	// far is the chain story's remote cluster D, filled by ad (A → D);
	// ba is nil there.
	far    *devstack.Kafka
	ad     *mirror.Mirror
	cli    *clientv3.Client
	fleet  []*fleetMember // live members, in start order
	prod   *producer      // the producer's current stint
	stints []*producer    // its stints before, stopped
	c2     *reader

	// Measured by the story, from C's arrivals.
	pauseApply, failover, failback time.Duration
	failoverD                      time.Duration // the chain's second failover
	late                           int64
	lateBy                         time.Duration
	// shown is the epoch of the last switch printed.
	shown int64
}

// fleetMember is one agent with its router.
type fleetMember struct {
	m *fleet.Member
}

func (f *fleetMember) agent() *agent.Agent { return f.m.Agent() }

func (d *demo) say(format string, args ...any) {
	fmt.Fprintf(d.o.Out, "%6.1fs  %s\n", time.Since(d.start).Seconds(), fmt.Sprintf(format, args...))
}

// moveProducer stops the producer's stint and starts the next on cluster
// k, numbered from `from`.
func (d *demo) moveProducer(k *devstack.Kafka, from int64) {
	d.prod.stop()
	d.stints = append(d.stints, d.prod)
	d.prod = startProducer(k.Name(), k.Brokers(), d.o.Rate, from)
}

// producers returns every stint of the producer.
func (d *demo) producers() []*producer {
	if d.prod == nil {
		return d.stints
	}
	return append(slices.Clone(d.stints), d.prod)
}

// await polls cond every 10 ms until it holds, timeout passes, or ctx
// ends.
func (d *demo) await(ctx context.Context, timeout time.Duration, what string, cond func() bool) error {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("demo: %s: not within %v", what, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	return nil
}

func (d *demo) sleep(ctx context.Context, dur time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(dur):
		return nil
	}
}

func (d *demo) leader() *agent.Agent {
	for _, f := range d.fleet {
		if f.agent().Leading() {
			return f.agent()
		}
	}
	return nil
}

// consuming reports whether every live agent applied an assignment on
// cluster, all partitions of both copies of the topic are owned, and
// each agent has its share.
func (d *demo) consuming(cluster string) bool {
	copies := 2 // the local topic and the other cluster's, with mirrors both ways
	if d.far != nil {
		copies = 1 // the chain story's mirrors go one way, from A
	}
	n := 0
	for _, f := range d.fleet {
		st := f.agent().Status()
		if st.Active != cluster || len(st.Owned) < copies*partitions/len(d.fleet) {
			return false
		}
		n += len(st.Owned)
	}
	return n == copies*partitions
}

func (d *demo) story(ctx context.Context) error {
	k := keys.New(fleetName)
	etcdctl := "etcdctl --endpoints " + d.etcd.Endpoints()[0]

	// 1. Steady state.
	if err := d.steady(ctx); err != nil {
		return err
	}

	// 2. Pause through the signal key. While the fleet is paused, the
	// mirror A → B falls behind: what A takes now is its unmirrored tail,
	// which nobody has consumed (the pause makes sure of that).
	d.say("an operator pauses the fleet:  %s put %s pause", etcdctl, k.FleetSignal())
	paused := time.Now()
	if _, err := d.cli.Put(ctx, k.FleetSignal(), "pause # demo"); err != nil {
		return fmt.Errorf("demo: write the pause signal: %w", err)
	}
	if err := d.await(ctx, 5*time.Second, "every agent paused", func() bool {
		for _, f := range d.fleet {
			if p, _ := f.agent().Status().Signals.Paused(topic, f.agent().ID()); !p {
				return false
			}
		}
		return true
	}); err != nil {
		return err
	}
	d.ab.Hold()
	written := d.prod.count()
	d.say("meanwhile the mirror A → B falls behind (as MirrorMaker 2 does under load): what A takes from now on is not on B")
	if err := d.sleep(ctx, d.phase/2); err != nil {
		return err
	}
	if last, ok := d.c2.last(paused, time.Now()); ok {
		d.pauseApply = last.Sub(paused)
		d.say("paused: the last record reached C %v after the put; then nothing, while A received %d more",
			d.pauseApply.Round(time.Millisecond), d.prod.count()-written)
	} else {
		d.say("paused: no record reached C after the put, while A received %d more", d.prod.count()-written)
	}

	// 3. A's data centre fails for everyone: the agents, the producer,
	// the mirrors. The producer moves to B.
	d.say("cluster A's data centre fails: A refuses every connection, from the agents, the producer and both mirrors")
	failed := time.Now()
	d.a.Fail()
	d.moveProducer(d.b, fromB)
	d.say("the producer moves to B: %d records/s to B's own %s, numbered from %d", d.o.Rate, topic, fromB)
	d.say("and the operator starts the fleet again: %s put %s start", etcdctl, k.FleetSignal())
	if _, err := d.cli.Put(ctx, k.FleetSignal(), "start"); err != nil {
		return fmt.Errorf("demo: write the start signal: %w", err)
	}
	quorum, failing := len(d.fleet)/2+1, 0
	if err := d.await(ctx, 10*time.Second, "A's failure detected", func() bool {
		failing = 0
		if l := d.leader(); l != nil {
			for _, views := range l.Status().Clusters {
				if v, ok := views["A"]; ok && !v.Reachable {
					failing++
				}
			}
		}
		return failing >= quorum
	}); err != nil {
		return err
	}
	d.say("detected: the probes of %d of %d agents fail to reach A (%v after it failed); the leader's verdict waits for the failure window, 1.5s since each agent last reached A",
		failing, len(d.fleet), time.Since(failed).Round(time.Millisecond))
	if err := d.await(ctx, 20*time.Second, "the fleet consumes B", func() bool { return d.consuming("B") }); err != nil {
		return err
	}
	d.say("failover: every agent consumes B (A.%s and B's own %s) %v after A failed", topic, topic, time.Since(failed).Round(time.Millisecond))
	d.printSwitch(ctx, "B")
	var fromB time.Time
	var ok bool
	if err := d.await(ctx, 10*time.Second, "a record consumed from B reaches C", func() bool {
		fromB, ok = d.c2.first(failed, "B")
		return ok
	}); err != nil {
		return err
	}
	d.failover = fromB.Sub(failed)
	d.say("the first record consumed from B reached C %v after A failed", d.failover.Round(time.Millisecond))

	// 4. An agent is killed.
	if err := d.sleep(ctx, d.phase/2); err != nil {
		return err
	}
	victim := d.fleet[len(d.fleet)-1]
	if victim.agent().Leading() {
		victim = d.fleet[0]
	}
	lost := victim.agent().Owned()
	d.say("%s is killed (no clean stop); it owned %s", victim.agent().ID(), owned(victim.agent()))
	killed := time.Now()
	victim.m.Abort()
	d.fleet = slices.DeleteFunc(d.fleet, func(f *fleetMember) bool { return f == victim })
	if err := d.await(ctx, 20*time.Second, "its partitions move", func() bool { return d.consuming("B") }); err != nil {
		return err
	}
	var moved []string
	for _, f := range d.fleet {
		for _, tp := range f.agent().Owned() {
			if slices.Contains(lost, tp) {
				moved = append(moved, fmt.Sprintf("%s/%d → %s", tp.Topic, tp.Partition, f.agent().ID()))
			}
		}
	}
	d.say("its partitions moved in %v (gossip found it dead, or its 2s etcd session expired): %s", time.Since(killed).Round(time.Millisecond), strings.Join(moved, ", "))

	// A replacement joins: the leader gives it a share.
	id := fmt.Sprintf("agent-%d", d.o.Agents+1)
	joined := time.Now()
	if err := d.startMember(ctx, id); err != nil {
		return err
	}
	newcomer := d.fleet[len(d.fleet)-1].agent()
	if err := d.await(ctx, 20*time.Second, id+" gets partitions", func() bool { return len(newcomer.Owned()) > 0 && d.consuming("B") }); err != nil {
		return err
	}
	d.say("%s joined and owns %s (%v after it started)", id, owned(newcomer), time.Since(joined).Round(time.Millisecond))

	// 5. A comes back with its data, the unmirrored tail included. The
	// producer moves back; the mirrors catch up.
	if err := d.sleep(ctx, d.phase/2); err != nil {
		return err
	}
	back := time.Now()
	d.a.Recover()
	d.ab.Release()
	d.moveProducer(d.a, d.stints[0].next())
	d.say("cluster A is back with its data; the producer moves back to A; the mirrors copy A's tail to B and B's records to B.%s on A", topic)
	d.say("failback waits until A has been healthy for 3s and holds everything consumed on B, B's own records included (B.%s on A)", topic)
	if err := d.await(ctx, 60*time.Second, "failback to A", func() bool { return d.consuming("A") }); err != nil {
		return err
	}
	d.say("failback: every agent consumes A (%s and B.%s) again %v after A came back", topic, topic, time.Since(back).Round(time.Millisecond))
	ev := d.printSwitch(ctx, "A")
	// The leader counts the tail after the switch, beside its loop, and
	// records the count in the switch's history entry.
	if err := d.await(ctx, 30*time.Second, "the unmirrored tail counted", func() bool {
		resp, err := d.cli.Get(ctx, keys.New(fleetName).HistoryEvent(ev.Epoch))
		return err == nil && len(resp.Kvs) == 1 && json.Unmarshal(resp.Kvs[0].Value, &ev) == nil && ev.LateCounted
	}); err != nil {
		return err
	}
	d.late, d.lateBy = ev.Late, time.Duration(ev.LateBySeconds*float64(time.Second))
	d.say("A's unmirrored tail: %d records A took before it failed and B did not have, delivered late (by at most %v), not lost",
		d.late, d.lateBy.Round(100*time.Millisecond))
	var fromA time.Time
	if err := d.await(ctx, 10*time.Second, "a record consumed from A reaches C", func() bool {
		fromA, ok = d.c2.first(back, "A")
		return ok
	}); err != nil {
		return err
	}
	d.failback = fromA.Sub(back)
	d.say("the first record consumed from A again reached C %v after A came back; deliveries to C stopped for at most %v during the switch",
		d.failback.Round(time.Millisecond), d.c2.longestGap(back, fromA).Round(time.Millisecond))

	// 6. The end: stop producing, let everything reach C.
	return d.finish(ctx)
}

// keepRunning writes again and prints what to try, until ctx ends.
func (d *demo) keepRunning(ctx context.Context) {
	d.moveProducer(d.a, d.prod.next())
	k := keys.New(fleetName)
	etcdctl := "etcdctl --endpoints " + d.etcd.Endpoints()[0]
	out := d.o.Out
	fmt.Fprintf(out, "\nEverything keeps running, and the producer writes again. Try:\n")
	fmt.Fprintf(out, "  # the status page, in a browser (every agent serves it)\n  http://%s/\n", d.fleet[0].agent().HTTPAddr())
	fmt.Fprintf(out, "  # each agent's view of the fleet (also /leader, /readyz, /metrics)\n")
	for _, f := range d.fleet {
		fmt.Fprintf(out, "  curl http://%s/status\n", f.agent().HTTPAddr())
	}
	for _, l := range [][2]string{
		{"pause the fleet; 'start' resumes it", "put " + k.FleetSignal() + " pause"},
		{"pause only the channel to C", "put " + k.ChannelSignal(channel) + " pause"},
		{"pin the fleet to B (a failover by hand); delete the key to go back to automatic", "put " + k.Pin() + " B"},
		{"change the routes: only odd numbers reach C from now on", "put " + k.Routes() + ` 'rules: [{name: odd, match: "int(value) % 2 == 1", channels: [` + channel + `]}]'`},
	} {
		fmt.Fprintf(out, "  # %s\n  %s %s\n", l[0], etcdctl, l[1])
	}
	fmt.Fprintf(out, "  # what etcd says about the fleet\n  kswitch status --etcd %s --fleet %s\n", d.etcd.Endpoints()[0], fleetName)
	fmt.Fprintln(out, "Press Ctrl-C to stop.")
	<-ctx.Done()
}

// close stops everything setUp started, in reverse order: the producer,
// the members (each stops its agent, then its router), the reader of C,
// the mirror, the clusters, etcd.
func (d *demo) close() {
	if d.prod != nil {
		d.prod.stop()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]error, len(d.fleet))
	for i, f := range d.fleet {
		wg.Go(func() { errs[i] = f.m.Stop(ctx) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		fmt.Fprintf(d.o.Out, "stopping the fleet: %v\n", err)
	}
	if d.c2 != nil {
		d.c2.stop()
	}
	for _, m := range []*mirror.Mirror{d.ab, d.ba, d.ad} {
		if m != nil {
			m.Stop()
		}
	}
	if d.cli != nil {
		d.cli.Close()
	}
	for _, k := range []*devstack.Kafka{d.a, d.b, d.far, d.c} {
		if k != nil {
			k.Stop()
		}
	}
	if d.etcd != nil {
		d.etcd.Stop()
	}
	if d.dir != "" {
		os.RemoveAll(d.dir)
	}
}

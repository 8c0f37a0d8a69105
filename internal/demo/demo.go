// Package demo runs kswitch's live demonstration in one process: an
// embedded etcd, Kafka clusters A and B (kfake) with the in-process mirror
// keeping B a replica of A, a producer writing numbered records to A, and
// a fleet of agents consuming them; a scripted story is narrated as a
// timeline: a pause and start through an etcd key, cluster A failing
// (failover to B with translated offsets), an agent killed, A returning
// (failback), and a summary that counts what was lost and duplicated.
package demo

import (
	"context"
	"encoding/json"

	"fmt"
	"io"
	"os"
	"strconv"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/IBM/sarama"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/coordinator"
	"github.com/kswitch/kswitch/internal/config"
	"github.com/kswitch/kswitch/internal/keys"
	"github.com/kswitch/kswitch/internal/mirror"
	"github.com/kswitch/kswitch/internal/testenv"
)

// Options configure a demo run.
type Options struct {
	// Agents is the fleet size, at least 2. Default 3.
	Agents int
	// Rate is the producer's records per second. Default 200.
	Rate int
	// Phase is how long each calm phase of the story lasts. Default 3s.
	Phase time.Duration
	// KeepRunning leaves everything up after the story until ctx ends.
	KeepRunning bool
	// Out receives the timeline. Default os.Stdout.
	Out io.Writer
	// Logger receives the components' logs. Default: none.
	Logger *zap.Logger
}

const (
	fleet      = "demo"
	topic      = "orders"
	partitions = 6
)

// Summary is the demo's result.
type Summary struct {
	Produced, Handled, Lost, Duplicated int
	Failover, Failback, PauseApply      time.Duration
}

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
	if o.Phase <= 0 {
		o.Phase = 3 * time.Second
	}
	if o.Out == nil {
		o.Out = os.Stdout
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	d := &demo{o: o, start: time.Now(), seen: map[int64]int{}}
	defer d.close()
	if err := d.setUp(ctx); err != nil {
		return Summary{}, err
	}
	err := d.story(ctx)
	sum := d.summary()
	d.printSummary(sum)
	if err == nil && sum.Lost > 0 {
		err = fmt.Errorf("demo: %d records lost", sum.Lost)
	}
	if err == nil && o.KeepRunning {
		fmt.Fprintf(o.Out, "\nstill running; try:\n  kswitch status --etcd %s --fleet %s\n", d.etcd.Endpoints()[0], fleet)
		fmt.Fprintf(o.Out, "  kswitch pause --etcd %s --fleet %s --reason 'trying it'\n", d.etcd.Endpoints()[0], fleet)
		fmt.Fprintf(o.Out, "  kswitch failover --etcd %s --fleet %s --to B\n", d.etcd.Endpoints()[0], fleet)
		for _, a := range d.agents {
			fmt.Fprintf(o.Out, "  curl http://%s/status\n", a.HTTPAddr())
		}
		fmt.Fprintln(o.Out, "press Ctrl-C to stop")
		<-ctx.Done()
	}
	return sum, err
}

type demo struct {
	o      Options
	start  time.Time
	dir    string
	etcd   *testenv.Etcd
	a, b   *testenv.Kafka
	mirror *mirror.Mirror
	cli    *clientv3.Client
	agents []*agent.Agent
	prod   *producer

	mu        sync.Mutex
	seen      map[int64]int
	lastFrom  string
	firstFrom map[string]time.Time

	failover, failback, pauseApply time.Duration
}

func (d *demo) say(format string, args ...any) {
	fmt.Fprintf(d.o.Out, "%7.3fs  %s\n", time.Since(d.start).Seconds(), fmt.Sprintf(format, args...))
}

func (d *demo) setUp(ctx context.Context) error {
	var err error
	if d.dir, err = os.MkdirTemp("", "kswitch-demo-"); err != nil {
		return fmt.Errorf("demo: temp dir: %w", err)
	}
	if d.etcd, err = testenv.StartEtcd(d.dir+"/etcd", d.o.Logger.Named("etcd")); err != nil {
		return fmt.Errorf("demo: start embedded etcd: %w", err)
	}
	if d.cli, err = d.etcd.Client(); err != nil {
		return err
	}
	if d.a, err = testenv.StartKafka("A", testenv.KafkaOptions{DataDir: d.dir + "/A", Topics: map[string]int32{topic: partitions}}); err != nil {
		return fmt.Errorf("demo: start Kafka A: %w", err)
	}
	if d.b, err = testenv.StartKafka("B", testenv.KafkaOptions{DataDir: d.dir + "/B"}); err != nil {
		return fmt.Errorf("demo: start Kafka B: %w", err)
	}
	d.say("etcd %v, Kafka A %v (topic %s, %d partitions), Kafka B %v", d.etcd.Endpoints(), d.a.Brokers(), topic, partitions, d.b.Brokers())
	if d.mirror, err = mirror.Start(ctx, mirror.Config{
		Source: d.a.Brokers(), Target: d.b.Brokers(), SourceName: "A", TargetName: "B",
		Topics: []string{topic}, RemoteTopic: func(t string) string { return "A." + t },
		TargetPrefill: 100, OffsetSyncsTopic: "mm2-offset-syncs.A.internal", OffsetSyncsOnTarget: true,
		Logger: d.o.Logger.Named("mirror"),
	}); err != nil {
		return fmt.Errorf("demo: start the mirror: %w", err)
	}
	d.say("mirror A → B running (like MirrorMaker 2: %s on A is A.%s on B, offsets on B are 100 higher)", topic, topic)
	for i := range d.o.Agents {
		if err := d.startAgent(ctx, fmt.Sprintf("agent-%d", i+1)); err != nil {
			return err
		}
	}
	d.prod = startProducer(d.a.Brokers(), d.o.Rate)
	d.say("producer writing %d records/s to A", d.o.Rate)
	return nil
}

func (d *demo) config(id string) config.Config {
	cfg := config.Default()
	cfg.Fleet = fleet
	cfg.Agent.ID = id
	cfg.Agent.HTTP = "127.0.0.1:0"
	cfg.Agent.Gossip = "127.0.0.1:0"
	cfg.Etcd.Endpoints = d.etcd.Endpoints()
	cfg.Etcd.SessionTTL = 2 * time.Second
	cfg.Etcd.RequestTimeout = time.Second
	cfg.Clusters = map[string]config.Cluster{
		"A": {Brokers: d.a.Brokers(), Role: config.RolePrimary},
		"B": {Brokers: d.b.Brokers(), Role: config.RoleStandby, OffsetSyncsOn: "target"},
	}
	cfg.Source.Topics = []string{topic}
	cfg.Source.Group = "demo"
	cfg.Source.CommitInterval = 200 * time.Millisecond
	cfg.Failover.ProbeInterval = 250 * time.Millisecond
	cfg.Failover.ProbeTimeout = 500 * time.Millisecond
	cfg.Failover.FailureWindow = 1500 * time.Millisecond
	cfg.Failover.FailbackStable = 3 * time.Second
	return cfg
}

func (d *demo) startAgent(ctx context.Context, id string) error {
	a, err := agent.New(d.config(id), agent.Options{Logger: d.o.Logger.Named(id), Handler: agent.HandlerFunc(d.handle)})
	if err != nil {
		return err
	}
	if err := a.Start(ctx); err != nil {
		return err
	}
	d.agents = append(d.agents, a)
	d.say("%s started: http://%s/status", a.ID(), a.HTTPAddr())
	return nil
}

// handle is every agent's handler: it records each record's id and the
// cluster it came from.
func (d *demo) handle(_ context.Context, r *agent.Record) error {
	id, err := strconv.ParseInt(string(r.Value), 10, 64)
	d.mu.Lock()
	if err == nil {
		d.seen[id]++
	}
	if d.firstFrom == nil {
		d.firstFrom = map[string]time.Time{}
	}
	if _, ok := d.firstFrom[r.Cluster]; !ok {
		d.firstFrom[r.Cluster] = time.Now()
	}
	d.lastFrom = r.Cluster
	d.mu.Unlock()
	r.Ack()
	return nil
}

func (d *demo) handled() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.seen)
}

// await polls cond every 10 ms until it holds or timeout passes.
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

func (d *demo) leader() *agent.Agent {
	for _, a := range d.agents {
		if a.Leading() {
			return a
		}
	}
	return nil
}

// consuming reports whether every agent applied an assignment on cluster
// and all partitions are owned.
func (d *demo) consuming(cluster string) bool {
	n := 0
	for _, a := range d.agents {
		st := a.Status()
		if st.Active != cluster {
			return false
		}
		n += len(st.Owned)
	}
	return n == partitions
}

func (d *demo) story(ctx context.Context) error {
	// 1. Steady state.
	if err := d.await(ctx, 20*time.Second, "the fleet consumes A", func() bool { return d.consuming("A") && d.leader() != nil }); err != nil {
		return err
	}
	l := d.leader()
	d.say("%s leads (fencing token %d); the fleet consumes A:", l.ID(), l.LeaderView().FencingToken)
	for _, a := range d.agents {
		d.say("    %s owns %v", a.ID(), a.Owned())
	}
	if err := d.sleep(ctx, d.o.Phase); err != nil {
		return err
	}
	d.say("steady: %d records produced, %d handled", d.prod.count(), d.handled())

	// 2. Pause and start through the signal key.
	k := keys.New(fleet)
	d.say("operator: etcdctl put %s pause", k.FleetSignal())
	began := time.Now()
	if _, err := d.cli.Put(ctx, k.FleetSignal(), "pause # demo"); err != nil {
		return err
	}
	if err := d.await(ctx, 5*time.Second, "every agent paused", func() bool {
		for _, a := range d.agents {
			if p, _ := a.Status().Signals.Paused(topic, a.ID()); !p {
				return false
			}
		}
		return true
	}); err != nil {
		return err
	}
	d.pauseApply = time.Since(began)
	held := d.handled()
	if err := d.sleep(ctx, d.o.Phase/2); err != nil {
		return err
	}
	d.say("paused in %v: %d records handled while paused (want 0), producer kept writing", d.pauseApply.Round(time.Millisecond), d.handled()-held)
	d.say("operator: etcdctl put %s start", k.FleetSignal())
	if _, err := d.cli.Put(ctx, k.FleetSignal(), "start"); err != nil {
		return err
	}
	if err := d.sleep(ctx, d.o.Phase/2); err != nil {
		return err
	}

	// 3. Cluster A fails.
	d.say("cluster A fails: every request to it is refused")
	began = time.Now()
	d.a.Fail()
	if err := d.await(ctx, 20*time.Second, "the fleet consumes B", func() bool { return d.consuming("B") }); err != nil {
		return err
	}
	d.failover = time.Since(began)
	d.say("failover: the fleet consumes B %v after A failed", d.failover.Round(time.Millisecond))
	d.printSwitch(ctx)

	// 4. An agent is killed.
	if err := d.sleep(ctx, d.o.Phase/2); err != nil {
		return err
	}
	victim := d.agents[len(d.agents)-1]
	if victim.Leading() {
		victim = d.agents[0]
	}
	d.say("%s is killed (no clean stop); it owned %v", victim.ID(), victim.Owned())
	victim.Abort()
	d.agents = remove(d.agents, victim)
	began = time.Now()
	if err := d.await(ctx, 20*time.Second, "its partitions move", func() bool { return d.consuming("B") }); err != nil {
		return err
	}
	d.say("its partitions moved to the others in %v (session TTL 2s)", time.Since(began).Round(time.Millisecond))

	// 5. A comes back.
	if err := d.sleep(ctx, d.o.Phase/2); err != nil {
		return err
	}
	d.say("cluster A recovers; the mirror catches up; failback waits for A to be healthy for 3s and hold what was consumed on B")
	began = time.Now()
	d.a.Recover()
	if err := d.await(ctx, 60*time.Second, "failback to A", func() bool { return d.consuming("A") }); err != nil {
		return err
	}
	d.failback = time.Since(began)
	d.say("failback: the fleet consumes A again %v after A recovered", d.failback.Round(time.Millisecond))
	d.printSwitch(ctx)

	// 6. The end: stop producing, let everything drain.
	if err := d.sleep(ctx, d.o.Phase); err != nil {
		return err
	}
	d.prod.stop()
	produced := d.prod.count()
	d.say("producer stopped after %d records; waiting for the fleet to drain", produced)
	_ = d.await(ctx, 20*time.Second, "every record handled", func() bool {
		d.mu.Lock()
		defer d.mu.Unlock()
		for _, id := range d.prod.ids() {
			if d.seen[id] == 0 {
				return false
			}
		}
		return true
	})
	return nil
}

// printSwitch shows the latest switch from history/.
func (d *demo) printSwitch(ctx context.Context) {
	resp, err := d.cli.Get(ctx, keys.New(fleet).History(), clientv3.WithLastKey()...)
	if err != nil || len(resp.Kvs) == 0 {
		return
	}
	var ev coordinator.SwitchEvent
	if json.Unmarshal(resp.Kvs[0].Value, &ev) != nil {
		return
	}
	d.say("  switch %s → %s (epoch %d): %s; revoke %.0f ms, translate %.0f ms", ev.From, ev.To, ev.Epoch, ev.Reason,
		1000*ev.Phases["revoke"], 1000*ev.Phases["translate"])
	for _, p := range ev.Partitions {
		d.say("    %s/%d: offset %d on %s → %d on %s by %s (rewound %d)", p.Topic, p.Partition, p.FromOffset, ev.From, p.ToOffset, ev.To, p.Method, p.Rewound)
	}
}

func (d *demo) sleep(ctx context.Context, dur time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(dur):
		return nil
	}
}

func (d *demo) summary() Summary {
	s := Summary{Failover: d.failover, Failback: d.failback, PauseApply: d.pauseApply}
	if d.prod == nil {
		return s
	}
	ids := d.prod.ids()
	d.mu.Lock()
	defer d.mu.Unlock()
	s.Produced, s.Handled = len(ids), len(d.seen)
	for _, id := range ids {
		switch n := d.seen[id]; {
		case n == 0:
			s.Lost++
		case n > 1:
			s.Duplicated += n - 1
		}
	}
	return s
}

func (d *demo) printSummary(s Summary) {
	fmt.Fprintln(d.o.Out)
	tw := tabwriter.NewWriter(d.o.Out, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "records produced (acknowledged by A)\t%d\n", s.Produced)
	fmt.Fprintf(tw, "records handled (distinct)\t%d\n", s.Handled)
	fmt.Fprintf(tw, "lost\t%d\n", s.Lost)
	fmt.Fprintf(tw, "duplicated\t%d\n", s.Duplicated)
	fmt.Fprintf(tw, "pause applied in\t%v\n", s.PauseApply.Round(time.Millisecond))
	fmt.Fprintf(tw, "failover (A fails → consuming B)\t%v\n", s.Failover.Round(time.Millisecond))
	fmt.Fprintf(tw, "failback (A recovers → consuming A)\t%v\n", s.Failback.Round(time.Millisecond))
	tw.Flush()
}

func (d *demo) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if d.prod != nil {
		d.prod.stop()
	}
	for _, a := range d.agents {
		_ = a.Stop(ctx)
	}
	if d.mirror != nil {
		d.mirror.Stop()
	}
	if d.cli != nil {
		d.cli.Close()
	}
	for _, k := range []*testenv.Kafka{d.a, d.b} {
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

func remove(fleet []*agent.Agent, a *agent.Agent) []*agent.Agent {
	var out []*agent.Agent
	for _, x := range fleet {
		if x != a {
			out = append(out, x)
		}
	}
	return out
}

// producer writes numbered records to A at a steady rate, retrying while A
// is down, and remembers which ids A acknowledged.
type producer struct {
	mu    sync.Mutex
	acked []int64
	quit  chan struct{}
	done  chan struct{}
	once  sync.Once
}

func startProducer(brokers []string, rate int) *producer {
	p := &producer{quit: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(p.done)
		p.run(brokers, rate)
	}()
	return p
}

func (p *producer) run(brokers []string, rate int) {
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	sc.Producer.Return.Successes = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Retry.Max = 0
	sc.Producer.Partitioner = sarama.NewRoundRobinPartitioner
	sc.Net.DialTimeout, sc.Net.ReadTimeout, sc.Net.WriteTimeout = time.Second, time.Second, time.Second
	sc.Metadata.Retry.Max = 0
	var sp sarama.SyncProducer
	defer func() {
		if sp != nil {
			sp.Close()
		}
	}()
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	next := int64(0)
	for {
		select {
		case <-p.quit:
			return
		case <-tick.C:
		}
		if sp == nil {
			var err error
			if sp, err = sarama.NewSyncProducer(brokers, sc); err != nil {
				sp = nil
				continue
			}
		}
		v := strconv.FormatInt(next, 10)
		if _, _, err := sp.SendMessage(&sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder(v), Value: sarama.StringEncoder(v)}); err != nil {
			// A is down: start afresh when it is back. The id is not
			// counted as produced; it is written again.
			sp.Close()
			sp = nil
			continue
		}
		p.mu.Lock()
		p.acked = append(p.acked, next)
		p.mu.Unlock()
		next++
	}
}

func (p *producer) stop() {
	p.once.Do(func() { close(p.quit) })
	<-p.done
}

func (p *producer) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.acked)
}

func (p *producer) ids() []int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]int64(nil), p.acked...)
}

//go:build integration

package integration

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/integration/netfault"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
)

// TestChaosOnRealKafka is make chaos on real processes (docs/CHAOS.md,
// Real stack): Kafka A and B with MirrorMaker 2 both ways, the sink C,
// etcd ×3, three agents and two kcat producers, one on A's orders and one
// on B's, under a seeded nemesis that sends signals: SIGKILL (then a start
// on the same data) and SIGSTOP (then SIGCONT) of agents, the leader,
// brokers, etcd members, SIGSTOP of MirrorMaker 2, and the network
// between one agent and one cluster cut, blackholed or slowed (each agent
// reaches the clusters through a SOCKS5 proxy of its own,
// integration/netfault, clusters.<name>.proxy). Checked from
// outside as make chaos checks: every record on A's and B's orders is on
// C (kcat), duplicates within what the faults and switches explain
// (exactly_once: none, read read_committed), order per source partition
// beyond what the agents counted, one leader per term, no partition
// committed by two agents in one generation, and everything on C and
// committed within chaosSettleBound of the producers' stop.
//
// KSWITCH_CHAOS_SEED replays a timeline (default: drawn and printed);
// KSWITCH_CHAOS_MODE is C's delivery (at_least_once, the default, or
// exactly_once).
func TestChaosOnRealKafka(t *testing.T) { addReport(runChaosReal(t)) }

const (
	// chaosDuration is how long the producers write from the nemesis's
	// start; the faults fall between chaosWarmup and chaosDuration -
	// chaosQuiet: 110 s of faults.
	chaosDuration = 150 * time.Second
	chaosWarmup   = 15 * time.Second
	// chaosQuiet is the calm between the last heal and the producers'
	// stop: a broker started again answers within 6-17 s here, and a
	// failback follows failback_stable (10 s) after it.
	chaosQuiet   = 25 * time.Second
	chaosMeanGap = 10 * time.Second
	// chaosRate is each producer's records per second.
	chaosRate = 50
	// chaosSettleBound is the checker's bound on recovery: within it of
	// the producers' stop (chaosQuiet after the last heal at the
	// latest), every record of A's and B's orders is on C, the fleet is
	// active on one cluster and committed to the end of both its
	// topics. It covers, on top of the quiet, a broker's start (up to 20
	// s), failback_stable (10 s) and the failure window (3 s), a session
	// TTL (3 s) and MirrorMaker 2 copying what it held: about 40 s,
	// twice over for a loaded machine.
	chaosSettleBound = 90 * time.Second
	// chaosDupSeconds is at_least_once's duplicate allowance per fault
	// injected: the records both producers write in that many seconds. A
	// fault that kills, stops or cuts off an agent, etcd member or broker
	// makes a partition's next owner deliver again what was handled and
	// not committed: about 1.25 commit intervals (625 ms) of the owner's
	// share. A stopped MirrorMaker 2 explains nothing by itself; what it
	// causes goes through a switch, which history/ counts.
	chaosDupSeconds = 2
)

func runChaosReal(t *testing.T) (rep scenarioReport) {
	rep = newReport("chaos")
	defer func() { rep.Passed = !t.Failed() }()
	seed, mode := chaosSettings(t)
	plan := chaosPlan{Seed: seed, Duration: chaosDuration, Warmup: chaosWarmup, Quiet: chaosQuiet, MeanGap: chaosMeanGap}
	faults := plan.timeline()
	replay := fmt.Sprintf("make integration RUN=TestChaosOnRealKafka KSWITCH_CHAOS_SEED=%d KSWITCH_CHAOS_MODE=%s", seed, mode)
	t.Logf("chaos seed %d, %s, %v, %d faults; replay with %s", seed, mode, chaosDuration, len(faults), replay)
	for _, f := range faults {
		t.Logf("  %s", f)
	}
	rep.Covers = fmt.Sprintf("seed %d, %s: %d faults in %v (SIGKILL/SIGSTOP of agents, the leader, brokers A, B, C, etcd members; SIGSTOP of MirrorMaker 2; an agent's link to a cluster cut, blackholed, slowed), checked from outside",
		seed, mode, len(faults), chaosDuration-chaosWarmup-chaosQuiet)
	t.Cleanup(func() {
		if t.Failed() {
			recaps.add(t, "chaos seed %d failed; replay with %s", seed, replay)
		}
	})
	timed := rep.timer(t)

	// The stack: A and B with MirrorMaker 2 both ways, C the sink.
	env, logs := kafkaTools(t), logDir(t)
	cDir := filepath.Join(t.TempDir(), "kafka-C")
	type formatted struct {
		b   *kafkaBroker
		err error
	}
	cFormatted := make(chan formatted, 1)
	go func() {
		b, err := newKafkaBroker(env, "C", cDir, logs)
		cFormatted <- formatted{b, err}
	}()
	st := startStackWith(t, timed, prefixPolicy, true, true)
	f := <-cFormatted
	if f.err != nil {
		fatal(t, f.err)
	}
	c := f.b
	c.start(t)
	timed("kafka_c_ready", c.waitReady(t, 2*time.Minute))
	c.createTopic(t, "sink", ordersPartitions)
	brokers := map[string]*kafkaBroker{"A": st.a, "B": st.b, "C": c}
	// Each agent reaches the clusters through a SOCKS5 proxy of its own,
	// a link per cluster: the network faults' targets.
	links := map[string]*netfault.Link{}
	var agents []*agentProc
	for _, id := range chaosAgents {
		byAddr := map[string]*netfault.Link{}
		for name, b := range brokers {
			l := netfault.NewLink(id + ">" + name)
			links[l.Name()], byAddr[b.addr] = l, l
		}
		proxy, err := netfault.ListenSOCKS5("127.0.0.1:0", byAddr)
		if err != nil {
			fatal(t, err)
		}
		t.Cleanup(func() { _ = proxy.Close() })
		conf := st.agentConfig()
		conf.Clusters = chaosClusters(st, c, "socks5://"+proxy.Addr(), mode)
		conf.Extra = routingTo("C", "sink", "")
		agents = append(agents, startAgentWith(t, id, conf))
	}
	producers := []*producer{
		startNamedProducer(t, "a", st.a.addr, "orders", chaosRate),
		startNamedProducer(t, "b", st.b.addr, "orders", chaosRate),
	}
	st.moving(t, "the fleet consumes every partition of A's orders", time.Minute)

	// The nemesis, watched from outside.
	obs := startChaosObserver(t, agents)
	n := &chaosNemesis{t: t, brokers: brokers, links: links, st: st, agents: agents,
		down: map[string]bool{}, resolved: map[int]string{}, began: time.Now()}
	n.run(faults, chaosDuration)
	for _, pr := range producers {
		pr.finish(t, time.Minute)
	}
	stopped := time.Now()
	t.Logf("%6.1fs  producers stopped: %d records to A, %d to B; settling", stopped.Sub(n.began).Seconds(), producers[0].count(), producers[1].count())

	// What the producers' clusters hold is the truth: all of it must
	// reach C. (A record kcat handed on and its broker never took is on
	// neither, and no one's to deliver.)
	source := map[string]map[int32][]kRecord{}
	for name, b := range map[string]*kafkaBroker{"A": st.a, "B": st.b} {
		var err error
		if source[name], err = readTopic(b.addr, "orders"); err != nil {
			fatal(t, err)
		}
	}
	readC := readTopic
	if mode == "exactly_once" {
		readC = readCommitted
	}
	var sink map[int32][]kRecord
	settle := func() error {
		a, ok := st.tl.active()
		if !ok || a.Phase != "active" {
			return fmt.Errorf("state/active: %+v", a)
		}
		other := map[string]string{"A": "B", "B": "A"}[a.Cluster]
		on := map[string]*kafkaBroker{"A": st.a, "B": st.b}
		theirs, err := endOffsets(on[other].addr, "orders")
		if err != nil {
			return err
		}
		if err := atLeast(on[a.Cluster].addr, other+".orders", theirs); err != nil {
			return fmt.Errorf("MirrorMaker 2 has not copied %s's orders yet: %w", other, err)
		}
		for _, topic := range []string{"orders", other + ".orders"} {
			ends, err := endOffsets(on[a.Cluster].addr, topic)
			if err != nil {
				return err
			}
			if err := st.tl.caughtUp(a.Cluster, topic, ends); err != nil {
				return err
			}
		}
		if sink, err = readC(c.addr, "sink"); err != nil {
			return err
		}
		on2 := map[string]bool{}
		for _, recs := range sink {
			for _, r := range recs {
				on2[r.Value] = true
			}
		}
		missing := 0
		for _, content := range source {
			for _, recs := range content {
				for _, r := range recs {
					if !on2[r.Value] {
						missing++
					}
				}
			}
		}
		if missing > 0 {
			return fmt.Errorf("%d records of A's and B's orders not on C", missing)
		}
		return nil
	}
	settled := time.Duration(0)
	if err := wait.Until(chaosSettleBound, settle); err != nil {
		errorf(t, "recovery: not settled %v after the producers' stop (%v after the last heal at the latest): %v", chaosSettleBound, chaosSettleBound+chaosQuiet, err)
	} else {
		settled = time.Since(stopped)
		timed("settled_after_producers_stop", settled)
	}
	obs.stop()
	if settled == 0 {
		var err error
		if sink, err = readC(c.addr, "sink"); err != nil {
			fatal(t, err)
		}
	}

	// The invariants.
	v := n.check(obs, source, sink, mode)
	rep.Records, rep.Delivered, rep.LostCount, rep.Lost, rep.Duplicates = v.records, v.delivered, v.lost, v.lostAt, v.duplicates
	rep.Details = append(rep.Details, fmt.Sprintf("seed %d (%s), faults as applied: %s", seed, replay, strings.Join(n.applied, "; ")), v.String())
	if settled > 0 {
		rep.Details = append(rep.Details, fmt.Sprintf("settled %.1f s after the producers' stop (bound %v)", settled.Seconds(), chaosSettleBound))
	}
	t.Log(v)
	timed("scenario", time.Since(st.began))
	return rep
}

// chaosClusters is the agents' clusters section on the chaos stack (the
// stack's, as agentConfig writes it, and the sink C), every cluster
// reached through proxy; C delivers in mode.
func chaosClusters(st *stack, c *kafkaBroker, proxy, mode string) string {
	return fmt.Sprintf(`  A: {brokers: [%s], proxy: %q, role: primary, version: %q, offset_syncs_on: target}
  B:
    brokers: [%s]
    proxy: %q
    role: standby
    version: %q
    replication_policy: %s
    source_alias: A
    offset_syncs_on: target
    offset_syncs_topic: %s
    checkpoints_topic: A.checkpoints.internal
  C: {brokers: [%s], proxy: %q, role: sink, version: %q, delivery: %s}
`, st.a.addr, proxy, kafkaVersion, st.b.addr, proxy, kafkaVersion, st.policy.kswitch, st.policy.syncTopic, c.addr, proxy, kafkaVersion, mode)
}

// chaosSettings reads KSWITCH_CHAOS_SEED and KSWITCH_CHAOS_MODE.
func chaosSettings(t *testing.T) (uint64, string) {
	t.Helper()
	seed := rand.Uint64() % 1_000_000
	if s := os.Getenv("KSWITCH_CHAOS_SEED"); s != "" {
		var err error
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			fatalf(t, "KSWITCH_CHAOS_SEED=%q: a seed is a number (the one a run printed): %v", s, err)
		}
	}
	mode := "at_least_once"
	if s := os.Getenv("KSWITCH_CHAOS_MODE"); s != "" {
		if s != "at_least_once" && s != "exactly_once" {
			fatalf(t, "KSWITCH_CHAOS_MODE=%q: at_least_once or exactly_once", s)
		}
		mode = s
	}
	return seed, mode
}

// chaosNemesis applies a timeline to the stack's processes, from the test's
// goroutine, one step after another.
type chaosNemesis struct {
	t       *testing.T
	st      *stack
	brokers map[string]*kafkaBroker
	links   map[string]*netfault.Link // agent>cluster
	agents  []*agentProc
	began   time.Time
	// down holds the targets faulted now; resolved the agent each
	// leader-kill killed, by fault number.
	down     map[string]bool
	resolved map[int]string
	// applied are the steps as applied, with their times; injected
	// counts the faults injected, mirror stops excepted.
	applied  []string
	injected int
}

type chaosStep struct {
	at   time.Duration
	f    chaosFault
	heal bool
}

// run applies the faults' steps at their times, then waits out duration.
// A step applied late (a slow one before it) is applied at once.
func (n *chaosNemesis) run(faults []chaosFault, duration time.Duration) {
	var steps []chaosStep
	for _, f := range faults {
		steps = append(steps, chaosStep{f.At, f, false}, chaosStep{f.Heal, f, true})
	}
	slices.SortStableFunc(steps, func(a, b chaosStep) int { return int(a.at - b.at) })
	for _, s := range steps {
		time.Sleep(time.Until(n.began.Add(s.at))) // the timeline's schedule, not a wait for a condition
		n.apply(s)
	}
	time.Sleep(time.Until(n.began.Add(duration)))
}

func (n *chaosNemesis) apply(s chaosStep) {
	t, f := n.t, s.f
	target := f.Target
	if f.Kind == "leader-kill" {
		if !s.heal {
			id, err := n.leader()
			if err != nil {
				n.log("inject #%d leader-kill: skipped, %v", f.N, err)
				return
			}
			n.resolved[f.N] = id
		}
		if target = n.resolved[f.N]; target == "" {
			return // its injection was skipped
		}
	}
	verb := map[bool]string{false: "inject", true: "heal  "}[s.heal]
	n.log("%s #%d %s %s", verb, f.N, f.Kind, target)
	n.down[target] = !s.heal
	if !s.heal && f.Kind != "mirror-stop" {
		n.injected++
	}
	var p *proc
	switch {
	case strings.HasPrefix(f.Kind, "agent-") || f.Kind == "leader-kill":
		a := byID(n.agents, target)
		if s.heal && f.Kind != "agent-stop" {
			a.restart(t)
			return
		}
		p = a.proc
	case strings.HasPrefix(f.Kind, "broker-"):
		b := n.brokers[target]
		if s.heal && f.Kind == "broker-kill" {
			b.start(t) // not waited for: the timeline goes on while it starts
			return
		}
		p = b.proc
	case f.Kind == "mirror-stop":
		p = n.st.mm.proc
	case strings.HasPrefix(f.Kind, "net-"):
		l := n.links[target]
		switch {
		case s.heal:
			l.Heal()
		case f.Kind == "net-cut":
			l.Set(netfault.Fault{Cut: true})
		case f.Kind == "net-blackhole":
			l.Set(netfault.Fault{Blackhole: true})
		default:
			l.Set(netfault.Fault{Latency: 250 * time.Millisecond, Jitter: 100 * time.Millisecond, Bandwidth: 100_000})
		}
		return
	case strings.HasPrefix(f.Kind, "etcd-"):
		i := slices.Index(chaosEtcd, target)
		m := n.st.etcd.members[i]
		if s.heal && f.Kind == "etcd-kill" {
			n.st.etcd.start(t, m, "existing")
			return
		}
		p = m.proc
	default:
		fatalf(t, "chaos: fault kind %q has no action", f.Kind)
	}
	switch {
	case strings.HasSuffix(f.Kind, "-kill"):
		stopProc(t, p, syscall.SIGKILL)
	case s.heal:
		p.signal(syscall.SIGCONT)
	default:
		p.signal(syscall.SIGSTOP)
	}
}

func (n *chaosNemesis) log(format string, args ...any) {
	at := time.Since(n.began).Seconds()
	line := fmt.Sprintf(format, args...)
	n.applied = append(n.applied, fmt.Sprintf("%.1fs %s", at, line))
	n.t.Logf("%6.1fs  %s", at, line)
}

// leader returns the agent that an agent neither killed nor stopped names
// as leading, when that one is neither either.
func (n *chaosNemesis) leader() (string, error) {
	var errs []error
	for _, a := range n.agents {
		if n.down[a.id] {
			continue
		}
		var v leaderView
		if _, err := getJSON("http://"+a.http+"/leader", &v); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", a.id, err))
			continue
		}
		if v.Leader != "" && !n.down[v.Leader] && byID(n.agents, v.Leader) != nil {
			return v.Leader, nil
		}
		errs = append(errs, fmt.Errorf("%s names leader %q", a.id, v.Leader))
	}
	return "", fmt.Errorf("no live agent names a live leader: %w", errors.Join(errs...))
}

// chaosObserver polls every agent's /leader and /metrics each second while
// the nemesis runs: the leaders' claims, and the reorderings each agent
// process counted (a SIGKILL loses what a process counted since its last
// poll).
type chaosObserver struct {
	mu sync.Mutex
	// claims are the (agent, fencing token) pairs of /leader answers
	// saying self, with when first seen.
	claims map[leaderClaim]time.Time
	// reordered is kswitch_routing_reordered_total: banked for processes
	// gone (a value lower than the last one seen is a new process), the
	// last seen of the current ones.
	banked, last map[string]float64
	stop         func()
}

type leaderClaim struct {
	agent string
	token int64
}

func startChaosObserver(t *testing.T, agents []*agentProc) *chaosObserver {
	o := &chaosObserver{claims: map[leaderClaim]time.Time{}, banked: map[string]float64{}, last: map[string]float64{}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			o.poll(agents)
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	var once sync.Once
	o.stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(o.stop)
	return o
}

func (o *chaosObserver) poll(agents []*agentProc) {
	for _, a := range agents {
		var v leaderView
		if _, err := getJSON("http://"+a.http+"/leader", &v); err == nil && v.Self {
			o.mu.Lock()
			if _, ok := o.claims[leaderClaim{a.id, v.FencingToken}]; !ok {
				o.claims[leaderClaim{a.id, v.FencingToken}] = time.Now()
			}
			o.mu.Unlock()
		}
		if n, _, err := counterSum([]*agentProc{a}, "kswitch_routing_reordered_total"); err == nil {
			o.mu.Lock()
			if n < o.last[a.id] {
				o.banked[a.id] += o.last[a.id]
			}
			o.last[a.id] = n
			o.mu.Unlock()
		}
	}
}

func (o *chaosObserver) reordered() float64 {
	o.mu.Lock()
	defer o.mu.Unlock()
	var sum float64
	for id, n := range o.last {
		sum += n + o.banked[id]
	}
	return sum
}

// chaosVerdict is what the checker found.
type chaosVerdict struct {
	records, delivered, lost int
	lostAt                   []string
	duplicates, budget       int
	switchRedeliveries       int64
	switches                 int
	outOfOrder               int
	reorderedCounted         float64
	terms                    int
	violations               []string
}

func (v chaosVerdict) String() string {
	return fmt.Sprintf("chaos verdict: %d records on A's and B's orders, %d copies on C: %d lost, %d duplicates (%d explained; %d by %d switches' rewound+lagged), "+
		"%d out of order (%v counted by the agents), %d terms, %d violations",
		v.records, v.delivered, v.lost, v.duplicates, v.budget, v.switchRedeliveries, v.switches, v.outOfOrder, v.reorderedCounted, v.terms, len(v.violations))
}

// check judges the run from outside and fails the test for each broken
// invariant, naming the seed's faults as applied.
func (n *chaosNemesis) check(obs *chaosObserver, source map[string]map[int32][]kRecord, sink map[int32][]kRecord, mode string) chaosVerdict {
	t := n.t
	var v chaosVerdict
	violate := func(format string, args ...any) {
		msg := fmt.Sprintf(format, args...)
		v.violations = append(v.violations, msg)
		errorf(t, "VIOLATION %s", msg)
	}
	known := map[string]bool{}
	for _, origin := range []string{"A", "B"} {
		ov := judgeOrder(source[origin], func(kRecord) bool { return true }, sink)
		v.records += ov.Records
		v.delivered += ov.Delivered
		v.lost += ov.LostCount
		for _, l := range ov.Lost {
			v.lostAt = append(v.lostAt, origin+":"+l)
		}
		v.duplicates += ov.Duplicates
		v.outOfOrder += ov.OutOfOrder
		if ov.WrongPartition > 0 {
			violate("partition: %d copies of %s's orders in another partition of C than their source's (manual-same-partition)", ov.WrongPartition, origin)
		}
		if ov.OutOfOrder > 0 {
			t.Logf("%s's orders out of order on C: %s", origin, strings.Join(ov.OutOfOrderAt, "; "))
		}
		for _, recs := range source[origin] {
			for _, r := range recs {
				known[r.Value] = true
			}
		}
	}
	strangers := 0
	for _, recs := range sink {
		for _, r := range recs {
			if !known[r.Value] {
				strangers++
			}
		}
	}
	if strangers > 0 {
		violate("strangers: %d records on C that neither A's nor B's orders holds", strangers)
	}
	if v.lost > 0 {
		violate("lost: %d of %d records on A's and B's orders are not on C, first %v", v.lost, v.records, v.lostAt)
	}

	// Duplicates: exactly_once none; at_least_once what the faults and
	// the switches explain.
	events, err := n.st.tl.history()
	if err != nil {
		fatal(t, err)
	}
	v.switches = len(events)
	perPartitionSecond := chaosRate / ordersPartitions // of one physical partition
	for _, ev := range events {
		for _, ps := range ev.Partitions {
			if ps.Rewound < 0 { // unknown: the timestamp translation's margin, 5 s
				v.switchRedeliveries += int64(5 * perPartitionSecond)
			} else {
				v.switchRedeliveries += ps.Rewound
			}
			v.switchRedeliveries += ps.Lagged
		}
	}
	v.budget = int(v.switchRedeliveries) + n.injected*chaosDupSeconds*2*chaosRate
	rule := fmt.Sprintf("at_least_once: %d s of both producers' rate (%d records) per fault injected (%d, MirrorMaker 2's stops excepted), plus the switches' rewound + lagged (%d)",
		chaosDupSeconds, chaosDupSeconds*2*chaosRate, n.injected, v.switchRedeliveries)
	if mode == "exactly_once" {
		v.budget, rule = 0, "exactly_once: none, read read_committed"
	}
	if v.duplicates > v.budget {
		violate("duplicates: %d on C, %d explained (%s): %s", v.duplicates, v.budget, rule, strings.Join(duplicated(sink), ", "))
	}

	v.reorderedCounted = obs.reordered()
	if float64(v.outOfOrder) > v.reorderedCounted {
		violate("order: %d records reached C after a later record of their source partition, the agents counted %v", v.outOfOrder, v.reorderedCounted)
	}
	if dc := n.st.tl.doubleCommits(); len(dc) > 0 {
		violate("fencing: two agents committed one partition in one generation: %v", dc)
	}
	v.terms = n.checkLeaders(obs, violate)
	if len(v.violations) > 0 {
		t.Logf("faults as applied:\n  %s", strings.Join(n.applied, "\n  "))
	}
	return v
}

// checkLeaders: one leader per term. No fencing token was claimed (/leader
// self) by two agents, and the election key etcd created at that revision
// holds the claimant's id. It returns the number of terms seen.
func (n *chaosNemesis) checkLeaders(obs *chaosObserver, violate func(string, ...any)) int {
	obs.mu.Lock()
	byToken := map[int64][]string{}
	for c := range obs.claims {
		byToken[c.token] = append(byToken[c.token], c.agent)
	}
	obs.mu.Unlock()
	cli := n.st.tl.client
	prefix := keys.New("orders").Election() // fleetPrefix's fleet
	for token, claimants := range byToken {
		if len(claimants) > 1 {
			slices.Sort(claimants)
			violate("one leader per term: term %d claimed by %v", token, claimants)
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(token))
		cancel()
		if err != nil {
			violate("one leader per term: term %d: etcd at revision %d: %v", token, token, err)
			continue
		}
		owner := ""
		for _, kv := range resp.Kvs {
			if kv.CreateRevision == token {
				owner = string(kv.Value)
			}
		}
		if owner != claimants[0] {
			violate("one leader per term: term %d claimed by %s, etcd's election key created at revision %d names %q", token, claimants[0], token, owner)
		}
	}
	return len(byToken)
}

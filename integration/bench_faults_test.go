//go:build integration && bench

package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// Failover and failback (figures 2 and 3), rebalance after an agent's
// death (figure 4) and pause (figure 5), on the suite's fleet: three
// agents consuming orders (4 partitions) on A, routing every record to the
// channel topic delivered on B in the partition it came from, MirrorMaker 2
// copying A to B, kcat producing 100 records a second to A.

// failoverTrial is one fault of A's broker, the failover to B, A's
// recovery and the failback.
type failoverTrial struct {
	Trial int `json:"trial"`
	// Fault is faultStopped or faultHung; empty in results written before
	// hung trials existed: stopped.
	Fault string `json:"fault,omitempty"`
	// Seconds after the SIGKILL: the leader started the switch (A declared
	// down, state/active switching), B active, the first record consumed
	// from B delivered to the channel topic, and an agent's first commit
	// on B past the translated offsets.
	DetectedSeconds    float64 `json:"detected_seconds"`
	ActiveSeconds      float64 `json:"active_seconds"`
	FirstRecordSeconds float64 `json:"first_record_seconds"`
	FirstCommitSeconds float64 `json:"first_commit_seconds"`
	// Phases of the switch from history/: revoke (every agent released A
	// and acknowledged), translate, activate.
	Phases map[string]float64 `json:"phases_seconds"`
	// Methods counts the partitions by translation method.
	Methods map[string]int `json:"methods"`
	// Failback: A's broker restarted on its data answers metadata (it
	// holds everything: nothing is produced on B) → A active, → the first
	// record consumed from A delivered.
	FailbackActiveSeconds      float64 `json:"failback_active_seconds"`
	FailbackFirstRecordSeconds float64 `json:"failback_first_record_seconds"`
	// FailbackProducedSeconds: A ready → the producer's first record
	// written to A again (its end offsets grow). Nothing newer than what
	// was consumed on B can be consumed from A before that.
	FailbackProducedSeconds float64 `json:"failback_produced_seconds,omitempty"`
	// Lost and Duplicated are counted from kcat reads of orders on A and
	// of the channel topic, over the records the fleet had committed on A
	// after the failback; Duplicated is this trial's increase.
	Lost       int `json:"lost"`
	Duplicated int `json:"duplicated"`
	Records    int `json:"records_checked"`
}

// The faults of the failover figures. Stopped: A's broker gets SIGKILL, so
// connections to it are refused at once (a hard failure), and it is started
// again on its data. Hung: SIGSTOP, so the kernel still accepts
// connections and nothing answers (the full failure window), and SIGCONT.
const (
	faultStopped = "stopped"
	faultHung    = "hung"
)

// hung reports whether the trial's fault was a hang.
func (x failoverTrial) hung() bool { return x.Fault == faultHung }

// rebalanceTrial is one SIGKILL of an agent that is not the leader.
type rebalanceTrial struct {
	DeathDetection string  `json:"death_detection"` // gossip or lease
	Trial          int     `json:"trial"`
	Agent          string  `json:"agent"`
	Partitions     []int32 `json:"partitions"`
	// Seconds after the SIGKILL: every partition of the dead agent in an
	// assignment to another agent; and its first record delivered to the
	// channel topic by the new owner (the last partition's).
	ReassignedSeconds float64 `json:"reassigned_seconds"`
	ConsumedSeconds   float64 `json:"consumed_seconds"`
}

// pauseResult is every flip of the fleet signal.
type pauseResult struct {
	Flips int `json:"flips"`
	// ApplyMs: the etcd write returned → every agent's /status shows a
	// signals_applied revision at least the write's (every partition
	// parked, or running again), in milliseconds, per flip.
	ApplyMs []float64 `json:"apply_ms"`
	// WatchMs: the same write → a bare etcd watch in the benchmark
	// process sees it: the baseline.
	WatchMs []float64 `json:"watch_ms"`
	// PollMs is the duration of one round of /status requests to the three
	// agents, the resolution of ApplyMs.
	PollMs []float64 `json:"poll_ms"`
}

// deliveredWatch samples the end offsets of the channel topic on B every
// 20 ms, so that the first record the fleet delivers after an event can
// be found afterwards.
type deliveredWatch struct {
	mu      sync.Mutex
	samples []endsSample
}

type endsSample struct {
	at   time.Time
	ends map[int32]int64
}

func (bx *bench) watchDelivered() *deliveredWatch {
	t := bx.t
	cl, err := sarama.NewClient([]string{bx.st.b.addr}, saramaConfig(3*time.Second))
	if err != nil {
		fatal(t, err)
	}
	w := &deliveredWatch{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			ends, err := topicEnds(cl, "delivered")
			if err != nil {
				continue
			}
			w.mu.Lock()
			w.samples = append(w.samples, endsSample{at: time.Now(), ends: ends})
			w.mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		cl.Close()
	})
	return w
}

// firstGrowth returns when the channel topic's partition p (all of them:
// -1) first grew past what the first sample at or after since held.
func (w *deliveredWatch) firstGrowth(since time.Time, p int32) (time.Time, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	total := func(s endsSample) int64 {
		if p >= 0 {
			return s.ends[p]
		}
		return sum(s.ends)
	}
	base := int64(-1)
	for _, s := range w.samples {
		if s.at.Before(since) {
			continue
		}
		if base < 0 {
			base = total(s)
			continue
		}
		if total(s) > base {
			return s.at, true
		}
	}
	return time.Time{}, false
}

// waitGrowth waits for firstGrowth.
func (bx *bench) waitGrowth(w *deliveredWatch, since time.Time, p int32, what string) time.Time {
	var at time.Time
	wait.For(bx.t, 30*time.Second, what, func() error {
		var ok bool
		if at, ok = w.firstGrowth(since, p); !ok {
			return fmt.Errorf("the channel topic has not grown since %s", since.Format("15:04:05.000"))
		}
		return nil
	})
	return at
}

// firstWrite polls topic's end offsets on addr every 20 ms from now and
// sends the time they first grow (or, after a minute, the time it gave
// up, which then shows in the figures).
func (bx *bench) firstWrite(addr, topic string) <-chan time.Time {
	out := make(chan time.Time, 1)
	var cl sarama.Client
	// total is the sum of topic's end offsets, read through cl (one
	// client for the whole poll).
	total := func() (int64, error) {
		ps, err := cl.Partitions(topic)
		if err != nil {
			return 0, err
		}
		var n int64
		for _, p := range ps {
			o, err := cl.GetOffset(topic, p, sarama.OffsetNewest)
			if err != nil {
				_ = cl.RefreshMetadata(topic)
				return 0, err
			}
			n += o
		}
		return n, nil
	}
	var start int64
	// Right after a SIGCONT the broker may answer "not the leader" for a
	// moment.
	wait.For(bx.t, 10*time.Second, "the end offsets of "+topic+" on "+addr, func() (err error) {
		if cl == nil {
			if cl, err = sarama.NewClient([]string{addr}, saramaConfig(3*time.Second)); err != nil {
				return err
			}
		}
		start, err = total()
		return err
	})
	go func() {
		defer cl.Close()
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		giveUp := time.After(time.Minute)
	poll:
		for {
			if n, err := total(); err == nil && n > start {
				break
			}
			select {
			case <-tick.C:
			case <-giveUp:
				break poll
			}
		}
		out <- time.Now()
	}()
	return out
}

// fleetArgs change the suite's agent configuration for the fault
// figures: the circuit breaker would stop automatic switching after the
// third failover within its window, and a shorter failback_stable keeps
// the run within its time budget.
var fleetArgs = []string{"--failover.max_failed_switches=1000", "--failover.failback_stable=" + benchFailbackStable.String()}

// benchFailbackStable is failover.failback_stable of the fault figures.
const benchFailbackStable = 5 * time.Second

// fleet starts the suite's three agents on orders, with fleetArgs and
// extraArgs.
func (bx *bench) fleet(extraArgs []string) []*agentProc {
	var agents []*agentProc
	args := append(slices.Clone(fleetArgs), extraArgs...)
	for i := 1; i <= 3; i++ {
		agents = append(agents, bx.startAgent(fmt.Sprintf("agent-%d", i), bx.st.agentConfig(), args))
	}
	wait.For(bx.t, time.Minute, "the fleet commits offsets on A for every partition", func() error {
		return bx.allMoving(time.Now().Add(-time.Hour))
	})
	return agents
}

// allMoving returns nil when every partition of orders has a commit on A
// seen after since.
func (bx *bench) allMoving(since time.Time) error {
	for p := range int32(ordersPartitions) {
		if _, ok := bx.st.tl.first(since, func(ev event) bool {
			q, c, ok := offsetEvent(ev, "A", "orders")
			return ok && q == p && c.Offset > 0
		}); !ok {
			return fmt.Errorf("no commit of orders/%d on A since %s", p, since.Format("15:04:05.000"))
		}
	}
	return nil
}

func (bx *bench) failover() {
	t, st := bx.t, bx.st
	st.mm = startMirrorMaker(t, st.env, st.a, st.b, st.policy)
	remote := st.policy.remote
	waitFor(t, 2*time.Minute, "MirrorMaker 2 creates "+remote+" on B", func() error {
		_, err := endOffsets(st.b.addr, remote)
		return err
	})
	bx.prod = startProducer(t, st.a.addr, "orders", produceRate)
	bx.agents = bx.fleet(nil)
	bx.delivered = bx.watchDelivered()
	dups, trial := 0, 0
	for _, f := range []struct {
		fault  string
		trials int
	}{{faultStopped, bx.scale.FailoverTrials}, {faultHung, bx.scale.FailoverHungTrials}} {
		for range f.trials {
			trial++
			tr, total := bx.failoverTrial(trial, f.fault, dups)
			dups = total
			bx.res.Failover = append(bx.res.Failover, tr)
		}
	}
}

// failoverTrial runs one failover on fault (faultStopped or faultHung)
// and the failback; dupsBefore is the duplicates count after the previous
// trial; it returns the new one.
func (bx *bench) failoverTrial(trial int, fault string, dupsBefore int) (failoverTrial, int) {
	t, st, tl, w := bx.t, bx.st, bx.st.tl, bx.delivered
	remote := st.policy.remote
	tr := failoverTrial{Trial: trial, Fault: fault, Methods: map[string]int{}}
	waitFor(t, time.Minute, "the fleet consumes every partition of A", func() error { return bx.allMoving(time.Now().Add(-2 * time.Second)) })
	// A backlog on B: the fleet paused until MirrorMaker 2 has copied 150
	// records more than it consumed, so that records are waiting on B when
	// it gets there and "first record from B" is a consumption, not an
	// arrival.
	// Against A's end offsets once every agent has parked its partitions:
	// the fleet cannot have consumed past them. The fleet's last commits
	// on A, which this read before, may be a commit interval old, or a
	// phase old for agents just started: B then held its "backlog" at
	// once, while the records after the fleet's position were still on
	// their way, and the failover found nothing on B to deliver.
	bx.signalFleet("pause")
	ends, err := endOffsets(st.a.addr, "orders")
	if err != nil {
		fatal(t, err)
	}
	atPause := sum(ends)
	waitFor(t, 30*time.Second, "a backlog of 150 records on B", func() error {
		ends, err := endOffsets(st.b.addr, remote)
		if err != nil {
			return err
		}
		if sum(ends) < atPause+150 {
			return fmt.Errorf("B holds %d records, A held %d at the pause", sum(ends), atPause)
		}
		return nil
	})
	faultAt := time.Now()
	if fault == faultHung {
		stopProc(t, st.a.proc, syscall.SIGSTOP)
	} else {
		stopProc(t, st.a.proc, syscall.SIGKILL)
	}
	put(t, st.etcd, fleetPrefix+"signals/fleet", "start")
	activeB := tl.waitActive(t, faultAt, "B", failureWindow+45*time.Second)
	tr.ActiveSeconds = round3(activeB.Sub(faultAt).Seconds())
	if ev, ok := tl.first(faultAt, func(ev event) bool { s, ok := parseActive(ev); return ok && s.Cluster == "B" }); ok {
		tr.DetectedSeconds = round3(ev.At.Sub(faultAt).Seconds())
	}
	// After B is active nothing from A can be delivered any more.
	tr.FirstRecordSeconds = round3(bx.waitGrowth(w, activeB, -1, "a record from B in the channel topic").Sub(faultAt).Seconds())
	ev := lastSwitch(t, tl, "A", "B")
	for k, v := range ev.Phases {
		ev.Phases[k] = round3(v)
	}
	tr.Phases = ev.Phases
	to := map[int32]int64{}
	for _, ps := range ev.Partitions {
		tr.Methods[ps.Method]++
		to[ps.Partition] = ps.ToOffset
	}
	waitFor(t, 30*time.Second, "an agent commits on B past the translated offsets", func() error {
		first, ok := tl.first(faultAt, func(ev event) bool {
			p, c, ok := offsetEvent(ev, "B", remote)
			return ok && !strings.HasPrefix(c.Agent, "leader:") && c.Offset > to[p]
		})
		if !ok {
			return fmt.Errorf("committed on B: %v, translated %v", offsetsOf(tl.offsets("B", remote)), to)
		}
		tr.FirstCommitSeconds = round3(first.At.Sub(faultAt).Seconds())
		return nil
	})

	// Failback: A's broker again, on its data.
	if fault == faultHung {
		stopProc(t, st.a.proc, syscall.SIGCONT)
	} else {
		st.a.start(t)
	}
	st.a.waitReady(t, 2*time.Minute)
	ready := time.Now()
	produced := bx.firstWrite(st.a.addr, "orders")
	activeA := tl.waitActive(t, ready, "A", benchFailbackStable+time.Minute)
	tr.FailbackActiveSeconds = round3(activeA.Sub(ready).Seconds())
	tr.FailbackFirstRecordSeconds = round3(bx.waitGrowth(w, activeA, -1, "a record from A in the channel topic after the failback").Sub(ready).Seconds())
	tr.FailbackProducedSeconds = round3((<-produced).Sub(ready).Seconds())
	lastSwitch(t, tl, "B", "A")

	// Lost and duplicated: every record below the fleet's commits on A
	// must be in the channel topic.
	back := time.Now()
	waitFor(t, time.Minute, "the fleet consumes every partition of A again", func() error { return bx.allMoving(back) })
	committed := offsetsOf(tl.offsets("A", "orders"))
	delivered, err := readTopic(st.b.addr, "delivered")
	if err != nil {
		fatal(t, err)
	}
	source, err := readTopic(st.a.addr, "orders")
	if err != nil {
		fatal(t, err)
	}
	count := map[string]int{}
	for _, recs := range delivered {
		for _, r := range recs {
			count[r.Value]++
		}
	}
	dups := 0
	for _, c := range count {
		dups += max(0, c-1)
	}
	for p, recs := range source {
		for _, r := range recs {
			if r.Offset >= committed[p] {
				break
			}
			tr.Records++
			if count[r.Value] == 0 {
				tr.Lost++
			}
		}
	}
	tr.Duplicated = dups - dupsBefore
	t.Logf("failover trial %d (%s): %+v", trial, fault, tr)
	return tr, dups
}

func (bx *bench) rebalance() {
	t := bx.t
	for _, mode := range []string{"gossip", "lease"} {
		if mode == "lease" {
			// The same fleet with gossip-driven eviction off.
			for _, a := range bx.agents {
				a.signal(syscall.SIGTERM)
				if err := a.wait(20 * time.Second); err != nil && a.running() {
					fatal(t, err)
				}
			}
			bx.agents = bx.fleet([]string{"--agent.death_detection=lease"})
		}
		for i := 1; i <= bx.scale.RebalanceTrials; i++ {
			bx.res.Rebalance = append(bx.res.Rebalance, bx.rebalanceTrial(mode, i))
		}
	}
}

// assignment is the part of state/assignment the benchmark reads.
type assignment struct {
	Generation int64 `json:"generation"`
	Owned      map[string][]struct {
		Topic     string `json:"topic"`
		Partition int32  `json:"partition"`
	} `json:"owned"`
}

func (bx *bench) rebalanceTrial(mode string, trial int) rebalanceTrial {
	t, tl, agents := bx.t, bx.st.tl, bx.agents
	var leader string
	waitFor(t, 30*time.Second, "a stable fleet: every agent owns partitions and every partition moves", func() (err error) {
		if leader, _, err = agreedLeader(agents); err != nil {
			return err
		}
		if owners := tl.owners(); len(owners) != len(agents) {
			return fmt.Errorf("owners: %v", owners)
		}
		return bx.allMoving(time.Now().Add(-time.Second))
	})
	var victim *agentProc
	for _, a := range agents {
		if a.id != leader {
			victim = a
			break
		}
	}
	var cur assignment
	tl.mu.Lock()
	err := json.Unmarshal(tl.latest["state/assignment"], &cur)
	tl.mu.Unlock()
	if err != nil {
		fatal(t, err)
	}
	var parts []int32
	for _, tp := range cur.Owned[victim.id] {
		parts = append(parts, tp.Partition)
	}
	killed := time.Now()
	stopProc(t, victim.proc, syscall.SIGKILL)
	tr := rebalanceTrial{DeathDetection: mode, Trial: trial, Agent: victim.id, Partitions: parts}
	var reassigned time.Time
	waitFor(t, 30*time.Second, "the dead agent's partitions assigned to others", func() error {
		ev, ok := tl.first(killed, func(ev event) bool {
			var a assignment
			if ev.Key != "state/assignment" || ev.Deleted || json.Unmarshal(ev.Value, &a) != nil {
				return false
			}
			for _, p := range parts {
				if !ownedByOther(a, p, victim.id) {
					return false
				}
			}
			return true
		})
		if !ok {
			return fmt.Errorf("%s's partitions %v not reassigned yet", victim.id, parts)
		}
		reassigned = ev.At
		return nil
	})
	tr.ReassignedSeconds = round3(reassigned.Sub(killed).Seconds())
	var consumed time.Time
	for _, p := range parts {
		at := bx.waitGrowth(bx.delivered, reassigned, p, fmt.Sprintf("a record of orders/%d delivered by its new owner", p))
		if at.After(consumed) {
			consumed = at
		}
	}
	tr.ConsumedSeconds = round3(consumed.Sub(killed).Seconds())
	t.Logf("rebalance %s trial %d: %+v", mode, trial, tr)
	victim.restart(t)
	waitFor(t, 30*time.Second, "the restarted agent owns partitions again", func() error {
		if n := tl.owners()[victim.id]; n == 0 {
			return fmt.Errorf("owners: %v", tl.owners())
		}
		return nil
	})
	return tr
}

func ownedByOther(a assignment, p int32, dead string) bool {
	for id, tps := range a.Owned {
		if id == dead {
			continue
		}
		if slices.ContainsFunc(tps, func(tp struct {
			Topic     string `json:"topic"`
			Partition int32  `json:"partition"`
		}) bool {
			return tp.Topic == "orders" && tp.Partition == p
		}) {
			return true
		}
	}
	return false
}

// signalFleet writes the fleet signal and waits until every agent's
// /status shows a signals_applied revision at least the write's.
func (bx *bench) signalFleet(val string) {
	rev := putRev(bx.t, bx.st.etcd, fleetPrefix+"signals/fleet", val)
	waitFor(bx.t, 10*time.Second, fmt.Sprintf("the fleet signal %s (revision %d) applied by every agent", val, rev), func() error {
		return signalsApplied(bx.agents, rev)
	})
}

// pause flips signals/fleet between pause and start and measures, per
// flip, the etcd write → every agent applied it (from their /status),
// against a bare etcd watch in this process seeing the same write.
func (bx *bench) pause() {
	t, agents := bx.t, bx.agents
	waitFor(t, 30*time.Second, "every agent consumes", func() error {
		if owners := bx.st.tl.owners(); len(owners) != len(agents) {
			return fmt.Errorf("owners: %v", owners)
		}
		return nil
	})
	cli, err := clientv3.New(clientv3.Config{Endpoints: bx.st.etcd.endpoints(), DialTimeout: 5 * time.Second})
	if err != nil {
		fatal(t, err)
	}
	defer cli.Close()
	key := fleetPrefix + "signals/fleet"
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	type sighting struct {
		rev int64
		at  time.Time
	}
	seen := make(chan sighting, 2*bx.scale.PauseFlips)
	watched := make(chan struct{})
	wch := cli.Watch(ctx, key)
	go func() {
		defer close(watched)
		for wr := range wch {
			now := time.Now()
			for _, ev := range wr.Events {
				seen <- sighting{ev.Kv.ModRevision, now}
			}
		}
	}()
	defer func() { cancel(); <-watched }()
	httpc := &http.Client{Timeout: time.Second}
	applied := func(a *agentProc) (int64, error) {
		resp, err := httpc.Get("http://" + a.http + "/status")
		if err != nil {
			return 0, err
		}
		defer resp.Body.Close()
		var s struct {
			SignalsApplied int64 `json:"signals_applied"`
		}
		return s.SignalsApplied, json.NewDecoder(resp.Body).Decode(&s)
	}
	res := pauseResult{Flips: bx.scale.PauseFlips}
	for i := range bx.scale.PauseFlips {
		val := "pause"
		if i%2 == 1 {
			val = "start"
		}
		began := time.Now()
		resp, err := cli.Put(context.Background(), key, val)
		if err != nil {
			fatal(t, err)
		}
		rev := resp.Header.Revision
		var watchAt time.Time
		done := map[string]bool{}
		for len(done) < len(agents) {
			if time.Since(began) > 10*time.Second {
				fatalf(t, "flip %d (%s at revision %d) not applied by every agent within 10 s: applied by %v", i, val, rev, done)
			}
			pollAt := time.Now()
			for _, a := range agents {
				if done[a.id] {
					continue
				}
				r, err := applied(a)
				if err != nil {
					fatalf(t, "%s /status: %v", a.id, err)
				}
				if r >= rev {
					done[a.id] = true
				}
			}
			res.PollMs = append(res.PollMs, ms(time.Since(pollAt)))
		}
		res.ApplyMs = append(res.ApplyMs, ms(time.Since(began)))
		for watchAt.IsZero() {
			select {
			case s := <-seen:
				if s.rev >= rev {
					watchAt = s.at
				}
			case <-time.After(10 * time.Second):
				fatalf(t, "the bare watch did not see revision %d", rev)
			}
		}
		res.WatchMs = append(res.WatchMs, ms(watchAt.Sub(began)))
	}
	bx.res.Pause = res
}

func ms(d time.Duration) float64 { return round3(float64(d) / float64(time.Millisecond)) }

package agent_test

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/state"
)

// stagedTopics are the four topics of the staged moves, in their stages.
var stagedTopics = []string{"audit", "clicks", "orders", "payments"}

// deadOn dead-letters, in place of the routing sink, the records of the
// topics it is told to while they are consumed from a cluster: it
// acknowledges them without handing them on, and counts them as the
// routing sink counts its dead letters (agent.Options.DeadLetters).
type deadOn struct {
	mu      sync.Mutex
	cluster string
	topics  map[string]bool
	counts  map[string]int64
	ids     map[string]bool // the values dead-lettered
}

func (d *deadOn) set(cluster string, topics ...string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.cluster, d.topics = cluster, map[string]bool{}
	for _, t := range topics {
		d.topics[t] = true
	}
}

func (d *deadOn) wrap(next record.Handler) record.Handler {
	return record.HandlerFunc(func(ctx context.Context, r *record.Record) error {
		d.mu.Lock()
		dead := d.topics[r.SourceTopic] && r.Cluster == d.cluster
		if dead {
			if d.counts == nil {
				d.counts = map[string]int64{}
			}
			d.counts[r.SourceTopic]++
			if d.ids == nil {
				d.ids = map[string]bool{}
			}
			d.ids[string(r.Value)] = true
		}
		d.mu.Unlock()
		if dead {
			r.Ack()
			return nil
		}
		return next.Handle(ctx, r)
	})
}

func (d *deadOn) deadLettered() map[string]int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return maps.Clone(d.counts)
}

// stagedFleet is three agents consuming the four staged topics from A
// under load.
type stagedFleet struct {
	d      *dc
	cli    *clientv3.Client
	l      *ledger
	ho     *handovers
	m      *topicMeter
	agents []*agent.Agent
	prods  map[string]*producer
	dead   map[string]*deadOn // by agent
}

func startStagedFleet(t *testing.T) *stagedFleet {
	t.Helper()
	f := &stagedFleet{d: startDC(t, withTopics(stagedTopics...)), l: newLedger(), ho: newHandovers(), m: newTopicMeter(),
		prods: map[string]*producer{}, dead: map[string]*deadOn{}}
	f.cli = testenv.EtcdClientT(t, f.d.etcd)
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		cfg := plannedConfig(f.d, id)
		cfg.Source.Topics = stagedTopics
		dl := &deadOn{}
		f.dead[id] = dl
		f.agents = append(f.agents, startFleetAgent(t, cfg, agent.Options{
			Handler:     f.m.wrap(dl.wrap(f.ho.wrap(id, f.l.handler(id)))),
			DeadLetters: dl.deadLettered,
		}))
	}
	waitBalanced(t, len(stagedTopics)*failoverPartitions, f.agents...)
	for i, topic := range stagedTopics {
		f.prods[topic] = startProducer(t, f.d.a.Brokers(), topic, int64(i)*10_000_000)
	}
	wait.For(t, 20*time.Second, "records of every topic flowing", func() error {
		for i := range stagedTopics {
			if id := fmt.Sprint(i*10_000_000 + 100); f.l.timesHandled(id) == 0 {
				return fmt.Errorf("record %s not handled (%d handled)", id, f.l.count())
			}
		}
		return nil
	})
	return f
}

// stages puts the staged move of stagedTopics to B in two stages.
func (f *stagedFleet) stages(t *testing.T, check time.Duration) {
	t.Helper()
	plan := state.StagePlan{To: "B", Check: check, Stages: []state.Stage{{Topics: []string{"audit", "clicks"}}, {Topics: []string{"orders", "payments"}}}}
	if err := operator(t, f.d.etcd).MoveInStages(t.Context(), plan); err != nil {
		t.Fatal(err)
	}
}

// waitStages waits until state/stages is in phase, and returns it.
func (f *stagedFleet) waitStages(t *testing.T, timeout time.Duration, stage int, phase string) state.StageState {
	t.Helper()
	var st state.StageState
	wait.For(t, timeout, fmt.Sprintf("state/stages at stage %d, %s", stage+1, phase), func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		resp, err := f.cli.Get(ctx, fleetKeys.StagesState())
		if err != nil || len(resp.Kvs) == 0 {
			return fmt.Errorf("state/stages: %v (%d keys)", err, len(resp.Kvs))
		}
		if st, err = state.ParseStageState(resp.Kvs[0].Value); err != nil {
			return err
		}
		if st.Stage != stage || st.Phase != phase {
			return fmt.Errorf("stage %d %s: %s", st.Stage+1, st.Phase, st.Reason)
		}
		return nil
	})
	return st
}

// stageSteps reads history/stages/.
func (f *stagedFleet) stageSteps(t *testing.T) []state.StageStep {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	resp, err := f.cli.Get(ctx, fleetKeys.StageHistory(), clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
	if err != nil {
		t.Fatal(err)
	}
	var out []state.StageStep
	for _, kv := range resp.Kvs {
		var s state.StageStep
		if err := json.Unmarshal(kv.Value, &s); err != nil {
			t.Fatalf("%s: %v", kv.Key, err)
		}
		out = append(out, s)
		t.Logf("step: stage %d %v %s at %s: %s (lag %d → %d, dead letters %d, leader %s)", s.Stage+1, s.Topics, s.Phase,
			s.At.Format("15:04:05.000"), s.Reason, s.LagBefore, s.LagAfter, s.DeadLetters, s.Leader)
	}
	return out
}

// placedOn waits until state/active places every topic of topics on
// cluster (the fleet being on A), and no topic switch is in progress.
func (f *stagedFleet) placedOn(t *testing.T, cluster string, topics ...string) {
	t.Helper()
	wait.For(t, 30*time.Second, fmt.Sprintf("%v on %s", topics, cluster), func() error {
		a, err := readActive(f.cli)
		if err != nil {
			return err
		}
		for _, topic := range topics {
			if c, moving := a.TopicCluster(topic); c != cluster || moving {
				return fmt.Errorf("%s on %s (moving %v): %+v", topic, c, moving, a.Topics)
			}
		}
		return nil
	})
}

// drain stops the producers once records written after now are handled
// and checks that every record on A was handled; it returns the
// duplicates.
func (f *stagedFleet) drain(t *testing.T) int {
	t.Helper()
	var flows []flow
	for _, topic := range stagedTopics {
		flows = append(flows, flow{f.prods[topic], topic})
	}
	dups, _ := drain(t, f.d, f.l, f.ho, true, flows...)
	return dups
}

// TestStagedMoveUnderLoad: four topics under load move to B in two
// stages, each held and checked for 2 s. The topics not in the stage
// moving are never paused: their largest delivery gap during the other
// stage's move and check is no larger than before the move (within this
// machine's noise), and their partitions are not restarted. Every step is
// in history/stages/ and kswitch status; each stage's topics move in one
// topic switch; 0 lost, 0 duplicates by fingerprint translation.
func TestStagedMoveUnderLoad(t *testing.T) {
	f := startStagedFleet(t)
	// The baseline: 3000 records handled once every topic flows.
	baseFrom, from := time.Now(), f.l.count()
	wait.For(t, 20*time.Second, "a baseline of delivery gaps", func() error {
		if n := f.l.count() - from; n < 3000 {
			return fmt.Errorf("%d handled", n)
		}
		return nil
	})
	began := time.Now()
	gens := map[string]map[string]int64{}
	for _, topic := range stagedTopics {
		gens[topic] = f.m.generations(topic)
	}
	check := 2 * time.Second
	f.stages(t, check)
	f.waitStages(t, 60*time.Second, 1, state.StageDone)
	f.placedOn(t, "B", stagedTopics...)
	status := statusText(t, operator(t, f.d.etcd), false)
	if !strings.Contains(status, "stages:  to B, stage 2 of 2 done") || !strings.Contains(status, "audit,clicks; *orders,payments") {
		t.Errorf("kswitch status shows no finished staged move:\n%s", status)
	}

	steps := f.stageSteps(t)
	phases := []string{}
	for _, s := range steps {
		phases = append(phases, fmt.Sprintf("%d:%s", s.Stage+1, s.Phase))
	}
	want := []string{"1:moving", "1:checking", "2:moving", "2:checking", "2:done"}
	if !slices.Equal(phases, want) {
		t.Fatalf("history/stages/ holds %v, want %v", phases, want)
	}
	// kswitch status lists each step, in order, under the move's line.
	t.Logf("kswitch status:\n%s", status)
	rest := status
	for _, s := range steps {
		line := fmt.Sprintf("%s  stage %d %s %s: %s", s.At.Format(time.RFC3339), s.Stage+1, strings.Join(s.Topics, ","), s.Phase, s.Reason)
		i := strings.Index(rest, line)
		if i < 0 {
			t.Errorf("kswitch status does not show the step %q after the ones before it:\n%s", line, status)
			break
		}
		rest = rest[i+len(line):]
	}
	if held := steps[2].At.Sub(steps[1].At); held < check {
		t.Errorf("stage 1 was checked for %v, under the check interval %v", held, check)
	}
	var switches []state.SwitchEvent
	for _, ev := range readHistory(t, f.cli) {
		if len(ev.Topics) > 0 {
			switches = append(switches, ev)
			t.Logf("topic switch epoch %d of %v in %v (%s)", ev.Epoch, ev.Topics, ev.Finished.Sub(ev.Started).Round(time.Millisecond), ev.Reason)
			for _, ps := range ev.Partitions {
				if ps.Method != "fingerprint" {
					t.Errorf("%s/%d translated by %s (%s)", ps.ToTopic, ps.Partition, ps.Method, ps.Detail)
				}
			}
		}
	}
	if len(switches) != 2 || !slices.Equal(switches[0].Topics, []string{"audit", "clicks"}) || !slices.Equal(switches[1].Topics, []string{"orders", "payments"}) ||
		!strings.HasPrefix(switches[0].Reason, "staged: stage 1 of 2") || !strings.HasPrefix(switches[1].Reason, "staged: stage 2 of 2") {
		for _, ev := range switches {
			t.Errorf("topic switch epoch %d of %v: %s", ev.Epoch, ev.Topics, ev.Reason)
		}
		t.Errorf("want one topic switch per stage, with the stage's topics and reason")
	}

	// The topics not moving: never restarted, no gap beyond the baseline's.
	if len(switches) != 2 {
		t.FailNow()
	}
	// Each topic's baseline is measured on the cluster it is consumed from
	// during the other stage: orders and payments on A before the move;
	// audit and clicks on B while stage 1 is checked, where they arrive
	// in the mirror's rounds (its fetch waits up to 100 ms), not as A's
	// producers write them.
	stage1, checking1, stage2, done := steps[0].At, steps[1].At, steps[2].At, steps[4].At
	type window struct {
		baseFrom, baseTo time.Time
		from, to         time.Time
		move             state.SwitchEvent
	}
	for topic, window := range map[string]window{
		"orders":   {baseFrom, began, stage1, stage2, switches[0]},
		"payments": {baseFrom, began, stage1, stage2, switches[0]},
		"audit":    {checking1, stage2, stage2, done, switches[1]},
		"clicks":   {checking1, stage2, stage2, done, switches[1]}} {
		base := f.m.gapIn(topic, window.baseFrom, window.baseTo)
		during := f.m.gapIn(topic, window.from, window.to)
		t.Logf("%s: largest delivery gap %v over %v before the other stage, %v during it (%v, its switch %v)", topic, base,
			window.baseTo.Sub(window.baseFrom).Round(time.Millisecond), during, window.to.Sub(window.from).Round(time.Millisecond),
			window.move.Finished.Sub(window.move.Started).Round(time.Millisecond))
		if !notPaused(during, base, window.move) {
			t.Errorf("%s's largest delivery gap grew from %v to %v while the other stage moved, as long as its switch: %s was paused", topic, base, during, topic)
		}
	}
	for _, topic := range []string{"orders", "payments"} {
		got := f.m.generations(topic)
		for part, g := range gens[topic] {
			if got[part] != g {
				t.Errorf("%s's %s was restarted by stage 1 (generation %d, then %d)", topic, part, g, got[part])
			}
		}
	}
	if dups := f.drain(t); dups != 0 {
		t.Errorf("%d duplicates through a staged move translated by fingerprint", dups)
	}
}

// TestStagedMoveSurvivesItsLeaderAndRollsBackAnUnhealthyStage: the
// leader is killed while stage 1 is being checked; the next leader
// continues the move from state/stages. Stage 2's payments is
// dead-lettered on B: its check fails, stage 2 is moved back to A and the
// move stops, stage 1 staying on B. 0 lost; records delivered twice are
// only those the killed leader handled without committing.
func TestStagedMoveSurvivesItsLeaderAndRollsBackAnUnhealthyStage(t *testing.T) {
	t.Parallel()
	f := startStagedFleet(t)
	for _, d := range f.dead {
		d.set("B", "payments")
	}
	// The check outlasts the killed leader's session and the hand-over of
	// its partitions, so that stage 1 is judged on what its partitions
	// do once they have owners again (a partition without progress for a
	// whole check fails it, which is what the check is for).
	f.stages(t, 12*time.Second)
	f.waitStages(t, 30*time.Second, 0, state.StageChecking)
	leader := leaderOf(t, f.agents...)
	t.Logf("stage 1 on B, being checked: killing the leader %s", leader.ID())
	leader.Abort()
	var rest []*agent.Agent
	for _, a := range f.agents {
		if a != leader {
			rest = append(rest, a)
		}
	}
	rolled := f.waitStages(t, 90*time.Second, 1, state.StageRolledBack)
	t.Logf("stage 2 rolled back: %s", rolled.Reason)
	if !strings.Contains(rolled.Reason, "dead-lettered") {
		t.Errorf("the rollback's reason %q does not name the dead letters", rolled.Reason)
	}
	f.placedOn(t, "B", "audit", "clicks")
	f.placedOn(t, "A", "orders", "payments")
	next := leaderOf(t, rest...)
	steps := f.stageSteps(t)
	phases := []string{}
	for _, s := range steps {
		phases = append(phases, fmt.Sprintf("%d:%s", s.Stage+1, s.Phase))
	}
	if want := []string{"1:moving", "1:checking", "2:moving", "2:checking", "2:rolled_back"}; !slices.Equal(phases, want) {
		t.Fatalf("history/stages/ holds %v, want %v", phases, want)
	}
	if steps[2].Leader != next.ID() || steps[1].Leader != leader.ID() {
		t.Errorf("stage 1 was checked by %s and passed by %s, want the killed %s and then %s", steps[1].Leader, steps[2].Leader, leader.ID(), next.ID())
	}
	var back *state.SwitchEvent
	for _, ev := range readHistory(t, f.cli) {
		if len(ev.Topics) > 0 && ev.To == "A" {
			back = &ev
		}
	}
	if back == nil || !slices.Equal(back.Topics, []string{"orders", "payments"}) || !strings.HasPrefix(back.Reason, "rolled back: stage 2 of 2") {
		t.Errorf("the rollback's topic switch: %+v", back)
	}
	// The agents stop dead-lettering; everything written is handled.
	for _, d := range f.dead {
		d.set("")
	}
	// Records of payments dead-lettered on B were acknowledged, not
	// handled: the ledger does not expect them, as a dead-letter
	// channel would hold them. Every other record is handled.
	var prods []*producer
	for _, p := range f.prods {
		prods = append(prods, p)
	}
	marks := []string{}
	for _, p := range prods {
		marks = append(marks, fmt.Sprint(p.next.Load()+50))
	}
	wait.For(t, 30*time.Second, "records produced after the rollback handled", func() error {
		for _, m := range marks {
			if f.l.timesHandled(m) == 0 {
				return fmt.Errorf("record %s not handled", m)
			}
		}
		return nil
	})
	for _, p := range prods {
		p.halt()
	}
	ids := map[string]bool{}
	for _, topic := range []string{"audit", "clicks", "orders"} {
		maps.Copy(ids, idsOn(t, f.d.a, topic))
	}
	waitAllHandled(t, f.l, ids, 30*time.Second)
	// payments, the stage rolled back: each record handled, or
	// dead-lettered on B (where a dead-letter channel holds it).
	dead := map[string]bool{}
	for _, d := range f.dead {
		d.mu.Lock()
		maps.Copy(dead, d.ids)
		d.mu.Unlock()
	}
	payments := idsOn(t, f.d.a, "payments")
	wait.For(t, 30*time.Second, "every record of payments handled or dead-lettered", func() error {
		missing := 0
		for id := range payments {
			if !dead[id] && f.l.timesHandled(id) == 0 {
				missing++
			}
		}
		if missing > 0 {
			return fmt.Errorf("%d of %d records of payments neither handled nor dead-lettered", missing, len(payments))
		}
		return nil
	})
	_, dups, dupFirst := f.l.result(0)
	t.Logf("%d records of audit, clicks and orders, 0 lost, %d duplicates (first handled by %v); payments: %d records, each handled or dead-lettered on B (%v)",
		len(ids), dups, dupFirst, len(payments), f.deadCounts())
	for id, n := range dupFirst {
		if id != leader.ID() && n > 0 {
			t.Errorf("%d duplicates of records first handled by %s, which was not killed", n, id)
		}
	}
}

func (f *stagedFleet) deadCounts() map[string]int64 {
	out := map[string]int64{}
	for _, d := range f.dead {
		for t, n := range d.deadLettered() {
			out[t] += n
		}
	}
	return out
}

// TestFailoverOverridesAStagedMove: A dies while stage 1 is on B being
// checked. The automatic failover moves every topic (stage 2's too) and
// ends the move as overridden, with the failover's epoch and reason in
// state/stages and history/stages/; audit and clicks, on B already, are
// not translated again.
func TestFailoverOverridesAStagedMove(t *testing.T) {
	t.Parallel()
	f := startStagedFleet(t)
	f.stages(t, time.Minute)
	f.waitStages(t, 30*time.Second, 0, state.StageChecking)
	f.d.a.Stop()
	st := f.waitStages(t, 30*time.Second, 0, state.StageOverridden)
	t.Logf("state/stages: %s", st.Reason)
	if !strings.Contains(st.Reason, "overridden by the fleet switch of epoch") || !strings.Contains(st.Reason, "failover") {
		t.Errorf("the override's reason %q names no failover", st.Reason)
	}
	waitFleetOn(t, f.cli, "B", 30*time.Second)
	if a, err := readActive(f.cli); err != nil || len(a.Topics) != 0 {
		t.Errorf("state/active after the failover: %+v (%v), want every topic with the fleet on B", a, err)
	}
	steps := f.stageSteps(t)
	if last := steps[len(steps)-1]; last.Phase != state.StageOverridden {
		t.Errorf("the last step in history/stages/ is %+v, want the override", last)
	}
	for _, ev := range readHistory(t, f.cli) {
		if len(ev.Topics) == 0 && ev.To == "B" {
			if !strings.Contains(ev.Reason, "overrides the staged move to B at stage 1 of 2") {
				t.Errorf("the failover's history entry does not say it overrode the staged move: %q", ev.Reason)
			}
			for _, ps := range ev.Partitions {
				if ps.Topic == "audit" || ps.Topic == "clicks" {
					t.Errorf("the failover translated %s/%d, on B already", ps.Topic, ps.Partition)
				}
			}
		}
	}
}

package agent_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/fleetview"
	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/state"
)

// committedSum is the sum of the fleet's committed offsets on cluster.
func committedSum(t *testing.T, cli *clientv3.Client, cluster string) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	ps, _, err := offsets.NewStore(cli, fleetKeys).List(ctx, cluster)
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, p := range ps {
		n += p.Offset
	}
	return n
}

// waitCommitting waits until the fleet's committed offsets on cluster grow
// by at least n: etcd accepts the agents' commits.
func waitCommitting(t *testing.T, cli *clientv3.Client, cluster string, n int64, what string) {
	t.Helper()
	from := committedSum(t, cli, cluster)
	wait.For(t, 10*time.Second, "commits accepted "+what, func() error {
		if got := committedSum(t, cli, cluster) - from; got < n {
			return fmt.Errorf("committed offsets grew by %d", got)
		}
		return nil
	})
}

// TestLeaderHealsTheAssignment: state/assignment deleted, overwritten with
// garbage, and overwritten with a well-formed assignment of a higher
// generation that gives every partition to an agent that does not exist.
// Each time the leader writes its own again within a loop turn (counted in
// kswitch_state_repairs_total), the agents' commits are accepted again and
// every partition is consumed. Then it is deleted and the leader stops:
// its successor starts above every generation an agent applied. Nothing is
// lost; the records delivered twice are those the ghost's generation took
// from their owners before they could commit them.
func TestLeaderHealsTheAssignment(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, agents, p := flowingFleet(t, d)
	leader := leaderOf(t, agents...)
	repairs := func() float64 {
		v, _ := metricValue(leader, "kswitch_state_repairs_total", map[string]string{"key": "assignment"})
		return v
	}
	ghost := `{"generation": 1000000, "cluster": "A", "owned": {"ghost": [` +
		`{"topic":"orders","partition":0},{"topic":"orders","partition":1},{"topic":"orders","partition":2},{"topic":"orders","partition":3}]}}`
	damaged := map[string]time.Time{}
	for _, damage := range []struct {
		name string
		do   func(ctx context.Context) error
	}{
		{"deleted", func(ctx context.Context) error { _, err := cli.Delete(ctx, fleetKeys.Assignment()); return err }},
		{"garbage", func(ctx context.Context) error {
			_, err := cli.Put(ctx, fleetKeys.Assignment(), "\x00 not json")
			return err
		}},
		{"a ghost owns everything", func(ctx context.Context) error { _, err := cli.Put(ctx, fleetKeys.Assignment(), ghost); return err }},
	} {
		waitCommitting(t, cli, "A", 20, "before: "+damage.name)
		before := repairs()
		damaged[damage.name] = time.Now()
		if err := damage.do(context.Background()); err != nil {
			t.Fatal(err)
		}
		wait.For(t, 5*time.Second, "the leader repairs state/assignment "+damage.name, func() error {
			if r := repairs(); r <= before {
				return fmt.Errorf("%v repairs", r)
			}
			return nil
		})
		waitConsuming(t, 10*time.Second, "A", agents...)
		waitCommitting(t, cli, "A", 20, "after: "+damage.name)
		t.Logf("state/assignment %s: repaired, the fleet consumes and commits", damage.name)
	}

	// Deleted once more, and the leader stops at once: it may repair it
	// first or not; its successor publishes above every generation
	// applied, which the survivors take.
	deletedAt := time.Now()
	if _, err := cli.Delete(context.Background(), fleetKeys.Assignment()); err != nil {
		t.Fatal(err)
	}
	rest := stopLeader(t, leader, agents)
	waitConsuming(t, 15*time.Second, "A", rest...)
	waitCommitting(t, cli, "A", 20, "under the next leader")
	p.halt()
	want := p.written()
	waitAllHandled(t, l, want, 20*time.Second)
	// Delivered again are only records whose commit the damage refused:
	// the ghost's generation took every partition from its owner at once
	// (not through revoking, as the leader moves partitions), so the
	// owners could not commit what they had handled since their last
	// commit; and from the last deletion until the next leader's first
	// generation every commit is refused (the commit fence is the
	// assignment's revision), the stopping leader's final one included,
	// while the next leader, finding no assignment, plans afresh and
	// moves partitions. A deletion or garbage the leader repairs costs
	// nothing: the agents keep the last good assignment meanwhile.
	ghostAt := damaged["a ghost owns everything"]
	dups := l.dupsFirstHandled()
	for id, at := range dups {
		ghost := !at.Before(ghostAt.Add(-time.Second)) && !at.After(ghostAt.Add(100*time.Millisecond))
		stopped := !at.Before(deletedAt.Add(-time.Second))
		if !ghost && !stopped {
			t.Errorf("record %s delivered again, first handled by %s %v from the ghost's write and %v from the deletion: not one whose commit the damage refused",
				id, l.firstHandler(id), at.Sub(ghostAt).Round(time.Millisecond), at.Sub(deletedAt).Round(time.Millisecond))
		}
	}
	t.Logf("%d records, 0 lost, %d duplicates, all first handled just before the ghost's generation or after the last deletion", len(want), len(dups))
	l.check(t)
}

// TestARegistrationWithoutALeaseIsNoMember: agents/<x> written by hand (no
// lease) is refused: the leader never plans with it, and every partition
// stays with the live agents.
func TestARegistrationWithoutALeaseIsNoMember(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l := newLedger()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2"} {
		agents = append(agents, startConsumer(t, d.config(id), l.handler(id)))
	}
	waitConsuming(t, 20*time.Second, "A", agents...)
	if _, err := cli.Put(context.Background(), fleetKeys.Agent("ghost"),
		`{"id":"ghost","http":"127.0.0.1:1","gossip":"127.0.0.1:2","version":"x","started":"2026-01-01T00:00:00Z"}`); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 5*time.Second, "the registration refused", func() error {
		if v, _ := metricValue(agents[0], "kswitch_refused_values_total", map[string]string{"kind": "registration"}); v < 1 {
			return fmt.Errorf("not refused yet")
		}
		return nil
	})
	// A planning round (a new agent) must not give the ghost anything.
	agents = append(agents, startConsumer(t, d.config("agent-3"), l.handler("agent-3")))
	waitBalanced(t, failoverPartitions, agents...)
	a, err := readAssignment(cli)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := a.Owned["ghost"]; ok {
		t.Errorf("generation %d gives partitions to the ghost: %v", a.Generation, a.Owned)
	}
	for _, ag := range agents {
		for _, r := range ag.Status().Agents {
			if r.ID == "ghost" {
				t.Errorf("%s lists the ghost as registered", ag.ID())
			}
		}
	}
}

// TestGhostRegistrationsAreNeverPlannedOn: registrations put by a stranger
// on leases that live are never given partitions, since membership is
// earned (coordinator's silence): ghost-1 on a lease of its own and
// ghost-2 on agent-1's session lease, with an acknowledgement forged on
// that lease, name an address that does not answer; ghost-3, on
// agent-1's lease, names agent-1's address, which answers as agent-1
// (refuted at once); agent-4 is a real agent whose acknowledgements etcd
// refuses. No assignment published after they appear places any of them;
// the leader's /status and kswitch status name them silent (ghost-3 at
// once, the others after silentAfter, 30 s), agent-4's /readyz says the
// leader plans without it, and every record is handled.
func TestGhostRegistrationsAreNeverPlannedOn(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, agents, p := flowingFleet(t, d)
	resp, err := cli.Get(t.Context(), fleetKeys.Agent("agent-1"))
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("agent-1's registration: %v %v", resp, err)
	}
	from := resp.Header.Revision
	agent1Lease := clientv3.LeaseID(resp.Kvs[0].Lease)
	cur, err := readAssignment(cli)
	if err != nil {
		t.Fatal(err)
	}
	own, err := cli.Grant(t.Context(), 120)
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range []struct {
		id, http string
		lease    clientv3.LeaseID
	}{{"ghost-1", "127.0.0.1:1", own.ID}, {"ghost-2", "127.0.0.1:1", agent1Lease}, {"ghost-3", agents[0].HTTPAddr(), agent1Lease}} {
		reg := fmt.Sprintf(`{"id":%q,"http":%q,"gossip":"127.0.0.1:2","version":"x","started":"2026-01-01T00:00:00Z"}`, g.id, g.http)
		if _, err := cli.Put(t.Context(), fleetKeys.Agent(g.id), reg, clientv3.WithLease(g.lease)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := cli.Put(t.Context(), fleetKeys.Ack("ghost-2"), strconv.FormatInt(cur.Generation, 10), clientv3.WithLease(agent1Lease)); err != nil {
		t.Fatal(err)
	}
	mute := startFleetAgent(t, d.config("agent-4"), agent.WithHooks(agent.Options{Handler: l.handler("agent-4")}, agent.Hooks{
		AckFails: func(int64) error { return errors.New("etcd refused the write (test)") },
	}))
	strangers := []string{"ghost-1", "ghost-2", "ghost-3", "agent-4"}
	silent := func(ids ...string) func() error {
		return func() error {
			st := leaderOf(t, agents...).Status().Coordinator
			for _, id := range ids {
				if st == nil || st.Silent[id] == "" {
					return fmt.Errorf("the leader's status does not name %s silent: %+v", id, st)
				}
			}
			return nil
		}
	}
	wait.For(t, 10*time.Second, "ghost-3 refuted by agent-1's answer", silent("ghost-3"))
	began := time.Now()
	wait.For(t, 50*time.Second, "the others named silent", silent(strangers...))
	t.Logf("named silent %v after they registered; leader status: %v", time.Since(began).Round(time.Millisecond),
		leaderOf(t, agents...).Status().Coordinator.Silent)
	if why := leaderOf(t, agents...).Status().Coordinator.Silent["ghost-3"]; !strings.Contains(why, `says it is agent "agent-1"`) {
		t.Errorf("ghost-3's reason: %q", why)
	}
	wait.For(t, 10*time.Second, "agent-4 unready, saying why", func() error {
		code, reason, err := readyz(mute)
		if err != nil || code != 503 || !strings.Contains(reason, "plans without this agent") {
			return fmt.Errorf("/readyz %d %q %v", code, reason, err)
		}
		return nil
	})
	status := statusText(t, operator(t, d.etcd), false)
	for _, id := range strangers {
		if !strings.Contains(status, "silent:  "+id+" registered") {
			t.Errorf("kswitch status does not name %s silent:\n%s", id, status)
		}
	}
	p.halt()
	waitAllHandled(t, l, p.written(), 20*time.Second)
	l.check(t)
	// Every assignment published since: none places a stranger.
	now, err := cli.Get(t.Context(), fleetKeys.Assignment())
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	published, last := 0, now.Kvs[0].ModRevision
	if a, err := state.ParseAssignment(now.Kvs[0].Value); err != nil || len(a.Owned) == 0 {
		t.Fatalf("state/assignment: %v %v", a, err)
	}
	// When nothing was published since (from >= last), the one in force,
	// checked below, is the one from before.
	if from < last {
		for wr := range cli.Watch(wctx, fleetKeys.Assignment(), clientv3.WithRev(from+1)) {
			if err := wr.Err(); err != nil {
				t.Fatal(err)
			}
			for _, ev := range wr.Events {
				published++
				from = ev.Kv.ModRevision
				a, err := state.ParseAssignment(ev.Kv.Value)
				if err != nil {
					continue
				}
				for _, id := range strangers {
					if len(a.OwnedBy(id)) > 0 {
						t.Errorf("generation %d places %s: %v", a.Generation, id, a.OwnedBy(id))
					}
				}
			}
			if from >= last {
				break
			}
		}
	}
	cur, err = state.ParseAssignment(now.Kvs[0].Value)
	for _, id := range strangers {
		if err != nil || len(cur.OwnedBy(id)) > 0 {
			t.Errorf("the assignment in force, generation %d, places %s (%v)", cur.Generation, id, err)
		}
	}
	t.Logf("%d assignments published after the strangers appeared; none places them", published)
}

// TestUnusableActiveStateIsRecoveredNotSwitchedAgain: while the fleet is
// pinned on B, state/active is overwritten with garbage and the leader
// changes. The new leader recovers B and the epoch from state/assignment
// and history/, writes them back, and switches nothing: no second switch
// "A → B" from A's old positions, no history entry overwritten.
func TestUnusableActiveStateIsRecoveredNotSwitchedAgain(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, agents, p := flowingFleet(t, d)
	if _, err := cli.Put(context.Background(), fleetKeys.Pin(), "B"); err != nil {
		t.Fatal(err)
	}
	waitConsuming(t, 20*time.Second, "B", agents...)
	pinned, err := readActive(cli)
	if err != nil {
		t.Fatal(err)
	}

	leader := leaderOf(t, agents...)
	if _, err := cli.Put(context.Background(), fleetKeys.Active(), "{not json"); err != nil {
		t.Fatal(err)
	}
	// The leader writes its own back at once.
	wait.For(t, 5*time.Second, "the leader repairs state/active", func() error {
		a, err := readActive(cli)
		if err != nil {
			return err
		}
		if a.Cluster != "B" || a.Epoch != pinned.Epoch {
			return fmt.Errorf("state/active %+v", a)
		}
		return nil
	})
	// Garbage again, and the leader stops before it can repair: the next
	// one recovers from state/assignment and history/.
	if _, err := cli.Put(context.Background(), fleetKeys.Active(), "{not json"); err != nil {
		t.Fatal(err)
	}
	rest := stopLeader(t, leader, agents)
	next := leaderOf(t, rest...)
	// The old leader follows state/active too, and may repair it in the
	// moment before it stops: then the new one finds it usable.
	var by string
	wait.For(t, 10*time.Second, "state/active recovered by "+next.ID()+" (or repaired by "+leader.ID()+" as it stopped)", func() error {
		a, err := readActive(cli)
		if err != nil {
			return err
		}
		if a.Cluster != "B" || a.Epoch != pinned.Epoch || (a.Leader != next.ID() && a.Leader != leader.ID()) {
			return fmt.Errorf("state/active %+v", a)
		}
		by = a.Leader
		return nil
	})
	t.Logf("state/active written back by %s", by)
	waitConsuming(t, 10*time.Second, "B", rest...)
	onB := idsOn(t, d.b, "A.orders")
	p.halt()
	waitAllHandled(t, l, onB, 20*time.Second)
	evs := readHistory(t, cli)
	logEvents(t, evs)
	if len(evs) != 1 || evs[0].Epoch != pinned.Epoch {
		t.Errorf("history has %d switches (want the pin's alone, epoch %d)", len(evs), pinned.Epoch)
	}
	if dups := l.duplicates(); dups != 0 {
		t.Errorf("%d duplicates: the fleet switched again from old positions", dups)
	}
	l.check(t)
}

// TestForgedActiveStatesInTheLeaderlessWindowMoveNothing: the leader dies
// and, before the next is elected (its lease lives on for the TTL),
// someone puts a well-formed state/active one epoch on. The new leader
// moves nothing: nothing is consumed on B and every record is handled.
//   - active on B, with no switch behind it (no history/ entry, the
//     assignment still on A): not believed; the leader recovers A from the
//     fleet's records and writes it back, and history/ stays empty (taken
//     as it was, B was consumed from offset 0: 10 526 duplicates in the
//     hostile pass);
//   - a switch in progress from A, where the fleet is, to B: believable
//     (a switch starts where the fleet is), but nothing calls for it (A is
//     reachable, B is not the primary, no pin names it), so the leader
//     abandons it instead of resuming it, and history/ records it
//     abandoned (before: resumed, 572 records consumed from B).
func TestForgedActiveStatesInTheLeaderlessWindowMoveNothing(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		phase     string
		from      string
		abandoned bool
	}{
		{name: "active", phase: state.PhaseActive},
		{name: "switching", phase: state.PhaseSwitching, from: "A", abandoned: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			d := startDC(t)
			cli := testenv.EtcdClientT(t, d.etcd)
			l, agents, p := flowingFleet(t, d)
			before, err := readActive(cli)
			if err != nil {
				t.Fatal(err)
			}
			leader := leaderOf(t, agents...)
			leader.Abort() // its lease lives on for the TTL: nobody leads meanwhile
			rest := slices.DeleteFunc(slices.Clone(agents), func(a *agent.Agent) bool { return a == leader })
			forged, err := json.Marshal(state.Active{Cluster: "B", From: tc.from, Epoch: before.Epoch + 1, Phase: tc.phase,
				Reason: "forged", Since: time.Now().UTC(), Leader: leader.ID(), Token: before.Token})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := cli.Put(context.Background(), fleetKeys.Active(), string(forged)); err != nil {
				t.Fatal(err)
			}
			if leader.Leading() {
				t.Fatal("the aborted agent still leads")
			}
			next := leaderOf(t, rest...)
			wait.For(t, 10*time.Second, "state/active on A again, written by "+next.ID(), func() error {
				a, err := readActive(cli)
				if err != nil {
					return err
				}
				if a.Cluster != "A" || a.Phase != state.PhaseActive || a.Leader != next.ID() {
					return fmt.Errorf("state/active %+v", a)
				}
				return nil
			})
			waitConsuming(t, 10*time.Second, "A", rest...)
			p.halt()
			waitAllHandled(t, l, p.written(), 20*time.Second)
			evs := readHistory(t, cli)
			switch {
			case !tc.abandoned && len(evs) != 0:
				logEvents(t, evs)
				t.Errorf("history/ holds %d switches, want none", len(evs))
			case tc.abandoned && (len(evs) != 1 || evs[0].Abandoned == "" || evs[0].To != "B"):
				logEvents(t, evs)
				t.Errorf("history/ holds %d switches, want the forged one, abandoned", len(evs))
			case tc.abandoned:
				t.Logf("history/: %s → %s abandoned: %s", evs[0].From, evs[0].To, evs[0].Abandoned)
			}
			if n := l.handledOn("B"); n != 0 {
				t.Errorf("%d records handled from B, where the fleet never switched", n)
			}
			l.check(t)
		})
	}
}

// TestForgedAcksMoveNoGeneration: a stranger puts, on a lease of its own,
// acks of 2^62 for agent-1, of 2^53 for agent-2 and for a ghost, then an
// agent joins. The acks are not on the named agents' registration leases, so
// they count for nothing: the join's generation is the next one, every
// agent applies it, and the fleet consumes everything. (Before, the next
// rebalance published 2^62 + 1, which every agent refuses: delivery was
// held for good, 35 046 of 45 000 records undelivered after 2 minutes.)
func TestForgedAcksMoveNoGeneration(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, agents, p := flowingFleet(t, d)
	before, err := readAssignment(cli)
	if err != nil {
		t.Fatal(err)
	}
	refusedBefore, _ := metricValue(leaderOf(t, agents...), refused.Name, map[string]string{"kind": "ack"})
	lease, err := cli.Grant(t.Context(), 60)
	if err != nil {
		t.Fatal(err)
	}
	for key, val := range map[string]string{fleetKeys.Ack("agent-1"): "4611686018427387904", fleetKeys.Ack("agent-2"): "9007199254740992",
		fleetKeys.Ack("ghost"): "9007199254740992"} {
		if _, err := cli.Put(t.Context(), key, val, clientv3.WithLease(lease.ID)); err != nil {
			t.Fatal(err)
		}
	}
	agents = append(agents, startConsumer(t, d.config("agent-4"), l.handler("agent-4")))
	waitBalanced(t, failoverPartitions, agents...)
	now, err := readAssignment(cli)
	if err != nil {
		t.Fatal(err)
	}
	if now.Generation <= before.Generation || now.Generation > before.Generation+20 {
		t.Errorf("generation %d after the join, was %d before the forged acks", now.Generation, before.Generation)
	}
	if v, _ := metricValue(leaderOf(t, agents...), refused.Name, map[string]string{"kind": "ack"}); v < refusedBefore+2 {
		t.Errorf("the leader counted %v refused acks, want agent-1's (over 2^53) and agent-2's (not on its lease)", v-refusedBefore)
	}
	p.halt()
	waitAllHandled(t, l, p.written(), 20*time.Second)
	l.check(t)
}

// TestAGenerationAtTheBoundStartsANewEpoch: someone puts a well-formed
// state/assignment of generation 2^53, the bound agents accept, under the
// current term's token. Agents apply it; the leader's repair would need
// 2^53 + 1, which every agent refuses (before: commits fenced, delivery
// held for good). Instead that term ends, and the next starts its
// generations again at 1, which agents take because its token is newer:
// a join is balanced, and every record is delivered.
func TestAGenerationAtTheBoundStartsANewEpoch(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, agents, p := flowingFleet(t, d)
	before, err := readAssignment(cli)
	if err != nil {
		t.Fatal(err)
	}
	forged := before
	forged.Generation = 1 << 53
	putAssignment(t, cli, forged)
	// A join needs a new generation: the bound's or a new term's.
	agents = append(agents, startConsumer(t, d.config("agent-4"), l.handler("agent-4")))
	waitBalanced(t, failoverPartitions, agents...)
	now, err := readAssignment(cli)
	if err != nil {
		t.Fatal(err)
	}
	if now.Token <= before.Token || now.Generation > 100 {
		t.Errorf("after the join: token %d generation %d; before the forged value: token %d generation %d",
			now.Token, now.Generation, before.Token, before.Generation)
	}
	p.halt()
	waitAllHandled(t, l, p.written(), 20*time.Second)
	l.check(t)
	t.Logf("forged generation 2^53 under token %d; the fleet went on under token %d at generation %d", before.Token, now.Token, now.Generation)
}

// TestAnAssignmentOfATermNobodyHoldsIsNotApplied: someone puts a
// state/assignment under a fencing token no leader holds (a later one than
// the current term's), giving every partition to agent-3. Agents do not
// apply it (no leader key of the fleet's election has that token) and
// the leader's repair replaces it: nothing is consumed under it.
func TestAnAssignmentOfATermNobodyHoldsIsNotApplied(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, agents, p := flowingFleet(t, d)
	before, err := readAssignment(cli)
	if err != nil {
		t.Fatal(err)
	}
	forged := before
	forged.Token, forged.Generation = before.Token+1000, before.Generation+1000
	forged.Owned, forged.Revoking = map[string][]state.TopicPartition{}, nil
	for _, tps := range before.Owned {
		forged.Owned["agent-3"] = append(forged.Owned["agent-3"], tps...)
	}
	slices.SortFunc(forged.Owned["agent-3"], state.TopicPartition.Compare)
	putAssignment(t, cli, forged)
	wait.For(t, 20*time.Second, "the leader's repair", func() error {
		a, err := readAssignment(cli)
		if err != nil || a.Token != before.Token || a.Generation <= forged.Generation {
			return fmt.Errorf("state/assignment token %d generation %d (%v)", a.Token, a.Generation, err)
		}
		return nil
	})
	waitBalanced(t, failoverPartitions, agents...)
	p.halt()
	waitAllHandled(t, l, p.written(), 20*time.Second)
	l.check(t)
	if n := l.handledUnder(forged.Generation); n > 0 {
		t.Errorf("%d records were consumed under the forged generation %d", n, forged.Generation)
	}
}

// putAssignment writes a as state/assignment, as a stranger would; a must
// be well formed (agents refuse anything else before the tests' point).
func putAssignment(t *testing.T, cli *clientv3.Client, a state.Assignment) {
	t.Helper()
	val, err := json.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := state.ParseAssignment(val); err != nil {
		t.Fatalf("the forged value must be well formed: %v", err)
	}
	if _, err := cli.Put(t.Context(), fleetKeys.Assignment(), string(val)); err != nil {
		t.Fatal(err)
	}
}

func readAssignment(cli *clientv3.Client) (state.Assignment, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, fleetKeys.Assignment())
	if err != nil {
		return state.Assignment{}, err
	}
	if len(resp.Kvs) == 0 {
		return state.Assignment{}, fmt.Errorf("no state/assignment")
	}
	return state.ParseAssignment(resp.Kvs[0].Value)
}

// TestASwitchBeforeAnythingWasConsumedKeepsNewest: a fleet started with
// initial_offset newest that has consumed nothing yet (its positions carry
// no timestamp and no fingerprints, and the replicator writes no
// offset-syncs) is pinned to B. It continues at B's end, as it would have
// started there: nothing written before it started is consumed, instead
// of all of B from the oldest offset.
func TestASwitchBeforeAnythingWasConsumedKeepsNewest(t *testing.T) {
	t.Parallel()
	d := startDC(t, withoutOffsetSyncs())
	cli := testenv.EtcdClientT(t, d.etcd)
	produce(t, d.a, "orders", 0, 200)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	if err := d.mirror.CaughtUp(ctx); err != nil {
		t.Fatal(err)
	}
	cancel()
	l := newLedger()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2"} {
		cfg := d.config(id)
		cfg.Source.InitialOffset = "newest"
		agents = append(agents, startConsumer(t, cfg, l.handler(id)))
	}
	waitConsuming(t, 20*time.Second, "A", agents...)
	waitCommitted(t, cli, "A", failoverPartitions)
	if _, err := cli.Put(context.Background(), fleetKeys.Pin(), "B"); err != nil {
		t.Fatal(err)
	}
	waitConsuming(t, 20*time.Second, "B", agents...)
	evs := readHistory(t, cli)
	logEvents(t, evs)
	for _, ev := range evs {
		for _, ps := range ev.Partitions {
			t.Logf("%s/%d: %s %d → %s %d by %s: %s", ps.Topic, ps.Partition, ps.FromTopic, ps.FromOffset, ps.ToTopic, ps.ToOffset, ps.Method, ps.Detail)
		}
	}
	produce(t, d.a, "orders", 1000, 1050)
	want := map[string]bool{}
	for i := 1000; i < 1050; i++ {
		want[strconv.Itoa(i)] = true
	}
	waitAllHandled(t, l, want, 20*time.Second)
	for i := range 200 {
		if l.timesHandled(strconv.Itoa(i)) > 0 {
			t.Fatalf("record %d, written before the fleet started with initial_offset newest, was consumed after the switch", i)
		}
	}
}

// waitCommitted waits until n partitions have a committed position on
// cluster.
func waitCommitted(t *testing.T, cli *clientv3.Client, cluster string, n int) {
	t.Helper()
	wait.For(t, 10*time.Second, "positions committed", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		ps, _, err := offsets.NewStore(cli, fleetKeys).List(ctx, cluster)
		if err != nil {
			return err
		}
		if len(ps) < n {
			return fmt.Errorf("%d of %d", len(ps), n)
		}
		return nil
	})
}

// outage runs 3 agents consuming a steady flow, stops etcd for `down`, then
// restarts it and waits until every record written is handled. It returns
// the ledger and when etcd stopped.
func etcdOutage(t testing.TB, down time.Duration, noHold bool, conf func(*config.Config), during func(stopped time.Time, agents []*agent.Agent, p *producer, l *ledger)) (*ledger, time.Time) {
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 4}})
	l := newLedger()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		cfg := consumeConfig(e, k, id)
		if conf != nil {
			conf(&cfg)
		}
		agents = append(agents, startFleetAgent(t, cfg, agent.WithHooks(agent.Options{Handler: l.handler(id)}, agent.Hooks{NoCommitHold: noHold})))
	}
	waitBalanced(t, 4, agents...)
	p := startProducer(t, k.Brokers(), "orders", 0)
	wait.For(t, 20*time.Second, "records flowing", func() error {
		if n := l.count(); n < 300 {
			return fmt.Errorf("%d handled", n)
		}
		return nil
	})
	stopped := time.Now()
	e.Stop()
	if during != nil {
		during(stopped, agents, p, l)
	}
	if rest := down - time.Since(stopped); rest > 0 {
		time.Sleep(rest) // the outage's length is the experiment, not a wait for a condition
	}
	if err := e.Restart(); err != nil {
		t.Fatal(err)
	}
	waitBalanced(t, 4, agents...)
	p.halt()
	want := p.written()
	wait.For(t, 60*time.Second, "every record handled after the outage", func() error {
		for id := range want {
			if l.timesHandled(id) == 0 {
				return fmt.Errorf("record %s not handled", id)
			}
		}
		return nil
	})
	return l, stopped
}

// TestDeliveryHeldWhileCommitsFail: when etcd stops answering, each agent
// stops handing records on once its commits have gone without success for
// the hold's bound (kswitch_delivery_held, /readyz 503), instead of going
// on until its session ends; after etcd returns, nothing is lost and the
// records delivered twice are only those handled between the last commit
// and the hold.
func TestDeliveryHeldWhileCommitsFail(t *testing.T) {
	t.Parallel()
	cfg := consumeConfig(testenv.StartEtcdT(t), testenv.StartKafkaT(t, "X", devstack.KafkaOptions{}), "x")
	bound := cfg.Source.CommitInterval
	l, stopped := etcdOutage(t, 3*cfg.Etcd.SessionTTL, false, nil, func(stopped time.Time, agents []*agent.Agent, p *producer, l *ledger) {
		// Held, or (on a machine too loaded to get there first) the
		// session ended, which stops delivery too.
		wait.For(t, 10*time.Second, "every agent holding delivery", func() error {
			for _, a := range agents {
				if v, _ := metricValue(a, "kswitch_delivery_held", nil); v != 1 && len(a.Owned()) > 0 {
					return fmt.Errorf("%s delivers", a.ID())
				}
			}
			return nil
		})
		t.Logf("every agent held delivery %v after etcd stopped (bound %v)", time.Since(stopped).Round(time.Millisecond), bound)
		handled := l.count()
		waitProduced(t, p, 200, "records written to Kafka while delivery is held")
		if n := l.count() - handled; n != 0 {
			t.Errorf("%d records handled while delivery was held", n)
		}
		if code, reason, err := readyz(agents[0]); err != nil || code != 503 {
			t.Errorf("/readyz %d %q %v while delivery is held", code, reason, err)
		}
	})
	// Delivered twice: what was handled after the last commit that
	// succeeded (at most a commit interval before etcd stopped) and
	// before the hold (the bound after the first commit that did not).
	dups := l.dupsFirstHandled()
	for id, at := range dups {
		if at.Before(stopped.Add(-cfg.Source.CommitInterval-time.Second)) || at.After(stopped.Add(cfg.Source.CommitInterval+bound+time.Second)) {
			t.Errorf("record %s delivered again, first handled %v from etcd's stop: outside the commit interval before it and the hold after it",
				id, at.Sub(stopped).Round(time.Millisecond))
		}
	}
	t.Logf("etcd down for %v: 0 lost, %d duplicates", 3*cfg.Etcd.SessionTTL, len(dups))
	// Not l.check: an agent whose session ended while etcd was down
	// consumes again, under a new session, from its committed offsets in
	// the generation it had applied, which the ledger's rule of offsets
	// increasing per agent and generation does not allow for.
}

// TestStrangerWritesUnderState: while records flow, a stranger writes at
// random under state/, agents/ and acks/ (garbage, deletions, well-formed
// values naming agents that do not exist, generations out of range), 60
// writes over about three seconds. The leader repairs what it owns, the
// agents refuse the rest, and once the stranger stops every partition is
// consumed again within two loop turns' worth of time and nothing is lost.
func TestStrangerWritesUnderState(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, agents, p := flowingFleet(t, d)
	rng := rand.New(rand.NewPCG(21, 15))
	values := []string{
		"", "\x00garbage", "{}", "null", `{"generation": -1}`, `{"generation": 9007199254740993, "cluster": "A"}`,
		`{"generation": 5000000, "cluster": "A", "owned": {"ghost": [{"topic":"orders","partition":1}]}}`,
		`{"cluster": "B", "epoch": 99, "phase": "switching"}`, `{"cluster": "Z", "epoch": 1, "phase": "active"}`,
		`{"id":"ghost","http":"127.0.0.1:1"}`, "18446744073709551615", "3",
	}
	keys := []string{fleetKeys.Assignment(), fleetKeys.Active(), fleetKeys.Agent("ghost"), fleetKeys.Ack("ghost"), fleetKeys.Ack("agent-1")}
	for range 60 {
		key, val := keys[rng.IntN(len(keys))], values[rng.IntN(len(values))]
		var err error
		if rng.IntN(4) == 0 {
			_, err = cli.Delete(context.Background(), key)
		} else {
			_, err = cli.Put(context.Background(), key, val)
		}
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond) // the stranger's pace: the experiment, not a wait
	}
	// Loop turns are at most a probe interval apart.
	waitConsuming(t, 2*d.config("x").Failover.ProbeInterval+5*time.Second, "A", agents...)
	waitCommitting(t, cli, "A", 20, "after the stranger")
	p.halt()
	want := p.written()
	waitAllHandled(t, l, want, 20*time.Second)
	a, err := readActive(cli)
	if err != nil || a.Cluster != "A" {
		t.Errorf("state/active %+v %v after the stranger, want A", a, err)
	}
	t.Logf("%d records, 0 lost, %d duplicates", len(want), l.duplicates())
}

// TestAnOlderTermsAssignmentIsIgnored: an assignment with a newer
// generation but an older leader term's fencing token (an old value put
// back by hand) is ignored by every agent, and the leader repairs it:
// nothing is consumed under its generation and nothing is lost.
func TestAnOlderTermsAssignmentIsIgnored(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, agents, p := flowingFleet(t, d)
	cur, err := readAssignment(cli)
	if err != nil {
		t.Fatal(err)
	}
	forged := cur
	forged.Generation, forged.Token = cur.Generation+1, cur.Token-1
	var all []state.TopicPartition
	for _, tps := range cur.Owned {
		all = append(all, tps...)
	}
	forged.Owned = map[string][]state.TopicPartition{"agent-1": all}
	val, err := json.Marshal(forged)
	if err != nil {
		t.Fatal(err)
	}
	refusedBefore := map[string]float64{}
	for _, a := range agents {
		refusedBefore[a.ID()], _ = metricValue(a, refused.Name, map[string]string{"kind": "assignment"})
	}
	if _, err := cli.Put(t.Context(), fleetKeys.Assignment(), string(val)); err != nil {
		t.Fatal(err)
	}
	// An agent busy applying when both the forged value and the leader's
	// repair arrive applies only the newest (applyNewest) and never reads
	// the forged one, so not every agent counts a refusal; none may
	// consume under it (checked below), and the leader must repair it.
	var refusers []string
	wait.For(t, 10*time.Second, "an agent refused it and the leader repaired it", func() error {
		refusers = refusers[:0]
		for _, a := range agents {
			if v, _ := metricValue(a, refused.Name, map[string]string{"kind": "assignment"}); v > refusedBefore[a.ID()] {
				refusers = append(refusers, a.ID())
			}
		}
		if len(refusers) == 0 {
			return errors.New("no agent refused it")
		}
		if now, err := readAssignment(cli); err != nil || now.Token != cur.Token || now.Generation <= forged.Generation {
			return fmt.Errorf("state/assignment generation %d token %d %v", now.Generation, now.Token, err)
		}
		return nil
	})
	t.Logf("refused by %v of %d agents (the others read only the repair)", refusers, len(agents))
	waitCommitting(t, cli, "A", 20, "after the repair")
	p.halt()
	waitAllHandled(t, l, p.written(), 20*time.Second)
	if n := l.handledUnder(forged.Generation); n != 0 {
		t.Errorf("%d records consumed under the forged generation %d", n, forged.Generation)
	}
	l.check(t)
}

// TestAStuckHandlerIsReported: a handler that stops acknowledging the
// records of one partition makes the agent unready, naming the partition
// and how long (kswitch_stuck_partitions); once it acknowledges again
// the agent is ready.
func TestAStuckHandlerIsReported(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 2}})
	var mu sync.Mutex
	var held []*record.Record
	stuck := true
	h := record.HandlerFunc(func(_ context.Context, r *record.Record) error {
		mu.Lock()
		defer mu.Unlock()
		if r.Partition == 0 && stuck {
			held = append(held, r)
			return nil
		}
		r.Ack()
		return nil
	})
	a := startFleetAgent(t, consumeConfig(e, k, "agent-1"), agent.Options{Handler: h, StuckAfter: time.Second})
	waitBalanced(t, 2, a)
	produce(t, k, "orders", 0, 20)
	wait.For(t, 10*time.Second, "the agent unready, naming the stuck partition", func() error {
		code, reason, err := readyz(a)
		if err != nil || code != 503 || !strings.Contains(reason, "orders/0") || !strings.Contains(reason, "not acknowledged for") {
			return fmt.Errorf("/readyz %d %q %v", code, reason, err)
		}
		if v, _ := metricValue(a, "kswitch_stuck_partitions", nil); v != 1 {
			return fmt.Errorf("kswitch_stuck_partitions %v", v)
		}
		return nil
	})
	_, reason, _ := readyz(a)
	t.Logf("/readyz: %s", reason)
	mu.Lock()
	stuck = false
	for _, r := range held {
		r.Ack()
	}
	mu.Unlock()
	wait.For(t, 10*time.Second, "the agent ready again", func() error {
		if code, reason, err := readyz(a); err != nil || code != 200 {
			return fmt.Errorf("/readyz %d %q %v", code, reason, err)
		}
		return nil
	})
}

// TestAStalledPartitionIsReported: a cluster that answers every fetch
// with nothing while records are written makes /readyz 503 naming the
// partitions, their offsets and ends; once it delivers again every record
// arrives and the agent is ready.
func TestAStalledPartitionIsReported(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 2}})
	var mu sync.Mutex
	seen := map[string]int{}
	h := record.HandlerFunc(func(_ context.Context, r *record.Record) error {
		mu.Lock()
		seen[fmt.Sprintf("%d@%d", r.Partition, r.Offset)]++
		mu.Unlock()
		r.Ack()
		return nil
	})
	handled := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(seen)
	}
	a := startFleetAgent(t, consumeConfig(e, k, "agent-1"), agent.Options{Handler: h, StuckAfter: time.Second})
	waitBalanced(t, 2, a)
	produce(t, k, "orders", 0, 10)
	wait.For(t, 10*time.Second, "the first 10 records handled", func() error {
		if n := handled(); n != 10 {
			return fmt.Errorf("%d handled", n)
		}
		return nil
	})
	k.Starve()
	wait.For(t, 10*time.Second, "a fetch answered empty (none waiting since before)", func() error {
		if k.Starved() < 2 {
			return fmt.Errorf("%d starved fetches", k.Starved())
		}
		return nil
	})
	produce(t, k, "orders", 10, 50)
	wait.For(t, 15*time.Second, "the agent unready, naming both stalled partitions", func() error {
		code, reason, err := readyz(a)
		if err != nil || code != 503 || !strings.Contains(reason, "2 partitions make no progress while records wait") ||
			!strings.Contains(reason, "orders/0 (offset ") || !strings.Contains(reason, "orders/1 (offset ") || !strings.Contains(reason, ", end ") {
			return fmt.Errorf("/readyz %d %q %v", code, reason, err)
		}
		if v, _ := metricValue(a, "kswitch_stalled_partitions", nil); v != 2 {
			return fmt.Errorf("kswitch_stalled_partitions %v", v)
		}
		return nil
	})
	_, reason, _ := readyz(a)
	t.Logf("/readyz: %s", reason)
	k.Recover()
	wait.For(t, 15*time.Second, "every record handled and the agent ready again", func() error {
		if n := handled(); n != 50 {
			return fmt.Errorf("%d of 50 handled", n)
		}
		if code, reason, err := readyz(a); err != nil || code != 200 {
			return fmt.Errorf("/readyz %d %q %v", code, reason, err)
		}
		if v, _ := metricValue(a, "kswitch_stalled_partitions", nil); v != 0 {
			return fmt.Errorf("kswitch_stalled_partitions %v", v)
		}
		return nil
	})
}

// TestStalledPartitionsAreListed: agent-1 and agent-2 own the two
// partitions and lose their link to A, agent-3 (idle) still reaches it.
// Two of three agents down is no quorum to move partitions, so they wait:
// the leader lists both in state/stalled, kswitch status's view shows
// them, and every agent's readiness says why (agent-3: it owns nothing
// while they have no consumer); or, when gossip brings agent-2's report
// late, agent-3 consumes one of them (see below). Once the link heals the
// list goes and every record arrives.
func TestStalledPartitionsAreListed(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 2}})
	cli := testenv.EtcdClientT(t, e)
	l := newLedger()
	link := devstack.NewLink()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2"} {
		agents = append(agents, startFleetAgent(t, consumeConfig(e, k, id), agent.WithHooks(agent.Options{Handler: l.handler(id)}, agent.Hooks{KafkaDialer: through(link, "A")})))
	}
	waitBalanced(t, 2, agents...)
	idle := startFleetAgent(t, consumeConfig(e, k, "agent-3"), agent.Options{Handler: l.handler("agent-3")})
	agents = append(agents, idle)
	produce(t, k, "orders", 0, 20)
	wait.For(t, 10*time.Second, "20 records handled", func() error {
		if missing, _, _ := l.result(20); len(missing) > 0 {
			return fmt.Errorf("%d of 20 not handled yet", len(missing))
		}
		return nil
	})
	if o := owned(agents...); o["agent-3"] != 0 {
		t.Fatalf("agent-3 owns partitions: %v", o)
	}
	link.Cut()
	produce(t, k, "orders", 20, 40)
	var v fleetview.FleetView
	wait.For(t, 30*time.Second, "state/stalled lists the partitions agent-3 does not own, every agent says why it is not ready", func() error {
		var err error
		if v, err = fleetview.ReadFleet(t.Context(), cli, fleetKeys); err != nil {
			return err
		}
		// The leader (agent-1) sees its own probe at once and the others'
		// through gossip. Should agent-2's report come after agent-1's
		// failure window has ended, the leader sees a quorum reaching A
		// for a moment and cuts agent-1 off alone: agent-3 then consumes
		// agent-1's partition, and only agent-2's stalls. Either way every
		// partition is consumed by an agent that reaches A or listed.
		byAgent3 := owned(agents...)["agent-3"]
		if v.Stalled == nil || len(v.Stalled.Partitions) != 2-byAgent3 || byAgent3 > 1 {
			return fmt.Errorf("stalled %+v, agent-3 owns %d", v.Stalled, byAgent3)
		}
		v.AskReady(t.Context(), time.Second)
		want := map[string]string{"agent-1": "cannot reach the active cluster A", "agent-2": "cannot reach the active cluster A",
			"agent-3": "this agent owns no partition while 2 have had no consumer for over 5s"}
		if byAgent3 > 0 {
			delete(want, "agent-3") // consuming: ready
			if r := v.Ready["agent-3"]; !r.Answered || !r.Ready {
				return fmt.Errorf("agent-3: %+v", r)
			}
		}
		for id, reason := range want {
			if r := v.Ready[id]; !r.Answered || r.Ready || !strings.Contains(r.Reason, reason) {
				return fmt.Errorf("%s: %+v", id, r)
			}
		}
		return nil
	})
	t.Logf("stalled: %s; agent-3: %s", v.Stalled.String(time.Now()), v.Ready["agent-3"].Reason)
	link.Heal()
	wait.For(t, 30*time.Second, "state/stalled gone, every record handled, every agent ready", func() error {
		v, err := fleetview.ReadFleet(t.Context(), cli, fleetKeys)
		if err != nil {
			return err
		}
		if v.Stalled != nil {
			return fmt.Errorf("stalled %+v", v.Stalled)
		}
		if missing, _, _ := l.result(40); len(missing) > 0 {
			return fmt.Errorf("%d of 40 not handled yet", len(missing))
		}
		v.AskReady(t.Context(), time.Second)
		for id, r := range v.Ready {
			if !r.Ready {
				return fmt.Errorf("%s: %+v", id, r)
			}
		}
		return nil
	})
	l.check(t)
}

// stopLeader stops leader cleanly and returns the other agents.
func stopLeader(t *testing.T, leader *agent.Agent, agents []*agent.Agent) []*agent.Agent {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := leader.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	return slices.DeleteFunc(slices.Clone(agents), func(a *agent.Agent) bool { return a == leader })
}

// written returns the ids p wrote and Kafka acknowledged, after halt.
func (p *producer) written() map[string]bool {
	ids := map[string]bool{}
	for i := p.started; i < p.next.Load(); i++ {
		ids[strconv.FormatInt(i, 10)] = true
	}
	return ids
}

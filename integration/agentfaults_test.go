//go:build integration

package integration

import (
	"fmt"
	"syscall"
	"testing"
	"time"
)

// TestAgentFaultsOnRealKafka kills agents and an etcd member while the
// fleet relays records from Kafka A to its channel on B: the leader agent
// (SIGKILL: its lease must expire or gossip declare it dead), one etcd
// member of three, and a follower agent, which is then started again.
// Nothing may be lost; a killed agent's records delivered but not yet
// committed are delivered again by the partition's next owner
// (at-least-once), and the suite counts them (timeline.handOvers).
func TestAgentFaultsOnRealKafka(t *testing.T) {
	rep := newReport("agent-and-etcd-faults")
	rep.Covers = "SIGKILL of the leader agent, of an etcd member, of a follower agent started again"
	defer func() {
		rep.Passed = !t.Failed()
		addReport(rep)
	}()
	timed := rep.timer(t)
	st := startStack(t, timed, prefixPolicy, false) // B only hosts the channel
	tl, etcd := st.tl, st.etcd
	conf := st.agentConfig()
	var agents []*agentProc
	for i := 1; i <= 3; i++ {
		agents = append(agents, startAgentWith(t, fmt.Sprintf("agent-%d", i), conf))
	}
	prod := startProducer(t, st.a.addr, "orders", produceRate)

	st.moving(t, "the fleet consumes every partition of A", time.Minute)

	// The leader's machine dies.
	var leader string
	waitFor(t, 10*time.Second, "the agents agree on a leader", func() (err error) {
		leader, _, err = agreedLeader(agents)
		return err
	})
	killed := time.Now()
	byID(agents, leader).signal(syscall.SIGKILL)
	_ = byID(agents, leader).wait(10 * time.Second)
	rest := remove(agents, leader)
	var next string
	waitFor(t, sessionTTL+5*time.Second, "a new leader after SIGKILL of the leader", func() (err error) {
		next, _, err = agreedLeader(rest)
		return err
	})
	timed("leader_killed_new_leader", time.Since(killed))
	st.moving(t, "every partition moves again after the leader died", 30*time.Second)
	timed("leader_killed_all_moving", time.Since(killed))
	t.Logf("SIGKILL of leader %s: %s leads", leader, next)

	// One etcd member of three dies: the fleet goes on.
	etcd.members[0].proc.signal(syscall.SIGKILL)
	_ = etcd.members[0].proc.wait(10 * time.Second)
	timed("etcd_member_killed_moving", st.moving(t, "the fleet consumes with one etcd member down", 30*time.Second))
	etcd.start(t, etcd.members[0], "existing")

	// A follower dies and comes back.
	follower := rest[0]
	if follower.id == next {
		follower = rest[1]
	}
	follower.signal(syscall.SIGKILL)
	_ = follower.wait(10 * time.Second)
	timed("follower_killed_moving", st.moving(t, "every partition moves again after a follower died", 30*time.Second))
	waitFor(t, sessionTTL+5*time.Second, "the dead follower owns nothing", func() error {
		if n := tl.owners()[follower.id]; n > 0 {
			return fmt.Errorf("%s owns %d partitions", follower.id, n)
		}
		return nil
	})
	restarted := time.Now()
	follower.restart(t)
	waitFor(t, 30*time.Second, "the restarted follower gets partitions", func() error {
		if n := tl.owners()[follower.id]; n == 0 {
			return fmt.Errorf("assignment owners: %v", tl.owners())
		}
		return nil
	})
	timed("follower_restarted_owns", time.Since(restarted))
	st.moving(t, "every partition moves after the rebalance", 30*time.Second)

	// Verdict.
	r := st.relayVerdict(t, prod)
	rep.verdict = r.verdict
	// Every duplicate must be a redelivery after a death: per partition,
	// the duplicated offsets form runs that each start at the last commit
	// of an owner that died (killed, or its session expired).
	if !r.ok() {
		errorf(t, "lost %d %v; duplicates not explained by a death %v; deliveries the committed offsets do not explain %v",
			r.LostCount, r.Lost, r.BadDuplicates, r.PositionMismatch)
	}
	timed("scenario", time.Since(st.began))
}

//go:build chaos

package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/IBM/sarama"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/keys"
)

// fleetName is the fleet of a chaos run (the agents' configuration).
const fleetName = "chaos"

// dupSecondsPerFault is the duplicate allowance of one fault in
// at_least_once: the records the producer writes in that many seconds.
// A fault that kills, stops or cuts off an agent, etcd or a cluster makes
// a partition's next owner (or the same agent after a retry) deliver again
// what was handled and not committed: at most about 1.25 commit intervals
// (200 ms) of the owner's share (the commit hold), far less than 2 s of
// the whole fleet's rate. A mirror held explains nothing by itself: what
// it causes is counted by the switches (below).
const dupSecondsPerFault = 2.0

// Violation is a broken invariant.
type Violation struct {
	Invariant string
	// At is when the first bad record was sent (or the problem seen),
	// from the start of the run.
	At     time.Duration
	Record string // the first bad record or key
	Detail string
}

// Result is what the checker found.
type Result struct {
	Seed       uint64
	Violations []Violation

	Acked, Unknown        int   // records the producer had acknowledged, and sends of unknown outcome
	OnC, Distinct         int   // records of the producer on C, and distinct among them
	Lost                  int   // acknowledged, not on C
	Duplicates            int   // copies beyond the first
	DuplicateBudget       int   // what the faults and switches explain
	SwitchRedeliveries    int64 // of the budget: rewound + lagged in history/
	Reordered             int   // first copies after a later record of their source partition
	ReorderedCounted      float64
	Terms                 int // fencing tokens claimed
	Switches              int
	Settled               time.Duration // from the producer's stop to all on C and committed
	FaultsApplied         int
	LeaderKillsUnresolved int
	CommitsChecked        int // agents' commits in etcd's history checked against their fence
	DeliveriesAttributed  int // records on C whose producer session was attributed to an agent
	DeliveredUnowned      int // of those, delivered by an agent that did not hold their partition
	ReadyzChecked         int // /readyz answers checked against the partitions' positions
}

// Failed reports whether an invariant broke.
func (r *Result) Failed() bool { return len(r.Violations) > 0 }

type seqKey struct {
	src srcKey
	seq int64
}

// check settles the run and checks every invariant from outside: C read
// back to its end, etcd, the agents' HTTP (gathered while the run went).
func (r *run) check(ctx context.Context, stopped time.Time) (*Result, error) {
	res := &Result{Seed: r.cfg.Seed}
	acked, err := r.acked(res)
	if err != nil {
		return nil, err
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: r.stack.info.Etcd, DialTimeout: 2 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("chaos: etcd client: %w", err)
	}
	defer cli.Close()

	missing, behind, err := r.settle(ctx, cli, res, acked, stopped)
	if err != nil {
		return nil, err
	}
	got := r.obs.arrivals()
	slices.SortStableFunc(got, func(a, b arrival) int {
		if a.cPart != b.cPart {
			return int(a.cPart - b.cPart)
		}
		return int(a.cOff - b.cOff)
	})
	res.OnC = len(got)

	r.checkLost(res, acked, got, missing)
	r.checkRecovery(res, stopped, missing, behind)
	if err := r.checkDuplicates(ctx, cli, res, got); err != nil {
		return nil, err
	}
	r.checkOrder(res, got)
	r.checkLeaders(ctx, cli, res)
	if err := r.obs.fleet.hist.caughtUp(ctx, cli); err != nil {
		res.Violations = append(res.Violations, Violation{Invariant: "history", At: time.Since(r.start), Record: err.Error(),
			Detail: "the checker could not read etcd's history to its end"})
	}
	r.obs.fleet.hist.checkCommits(r, res)
	r.checkDeliveries(res, got)
	r.obs.fleet.checkReadiness(res)
	r.checkExits(res)
	r.checkHarness(res)
	r.report(res)
	return res, nil
}

// acked returns the records the producer had acknowledged, from its
// account of the run (/produced): every record it sent but those of
// unknown outcome. It counts both in res.
func (r *run) acked(res *Result) (map[seqKey]bool, error) {
	var produced []producedSource
	if err := r.stack.get("/produced", &produced); err != nil {
		return nil, err
	}
	acked := map[seqKey]bool{}
	for _, s := range produced {
		unknown := map[int64]bool{}
		for _, u := range s.Unknown {
			unknown[u] = true
		}
		res.Unknown += len(s.Unknown)
		for seq := range s.Next {
			if !unknown[seq] {
				acked[seqKey{srcKey{s.Origin, s.Partition}, seq}] = true
			}
		}
	}
	res.Acked = len(acked)
	return acked, nil
}

// settle waits, until settleBound after the producer stopped, for every
// acknowledged record to be on C and every position of the active cluster
// committed to its end, and sets res.Settled when they are. It returns the
// records still missing and the positions still behind (with why C or
// etcd could not be read, when they could not).
func (r *run) settle(ctx context.Context, cli *clientv3.Client, res *Result, acked map[seqKey]bool, stopped time.Time) ([]seqKey, []string, error) {
	deadline := stopped.Add(settleBound)
	var missing []seqKey
	var behind []string
	for {
		rerr := r.obs.readC(ctx, 10*time.Second)
		missing = missingOf(acked, r.obs.arrivals())
		var berr error
		behind, berr = r.behind(ctx, cli)
		if rerr == nil && berr == nil && len(missing) == 0 && len(behind) == 0 {
			res.Settled = time.Since(stopped)
			break
		}
		if time.Now().After(deadline) {
			if rerr != nil {
				behind = append(behind, rerr.Error())
			}
			if berr != nil {
				behind = append(behind, berr.Error())
			}
			break
		}
		select {
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		case <-time.After(2 * time.Second):
		}
	}
	if res.Settled > 0 {
		r.say("settled: %v after the producer stopped", res.Settled.Round(100*time.Millisecond))
	} else {
		r.say("not settled within %v: %d acknowledged records not on C, %d positions behind", settleBound, len(missing), len(behind))
	}
	return missing, behind, nil
}

// checkRecovery: everything on C and committed within settleBound of the
// producer's stop. Records that never came are the "lost" violation's;
// this one is about positions that did not reach their ends.
func (r *run) checkRecovery(res *Result, stopped time.Time, missing []seqKey, behind []string) {
	if res.Settled != 0 || len(behind) == 0 {
		return
	}
	first := behind[0]
	res.Violations = append(res.Violations, Violation{Invariant: "recovery", At: stopped.Sub(r.start), Record: first,
		Detail: fmt.Sprintf("not settled within %v of the producer's stop (%v after the last heal at the latest): %d acknowledged records not on C; positions behind: %s",
			settleBound, settleBound+quiet, len(missing), strings.Join(behind, "; "))})
}

// checkExits: no agent process ended without being killed.
func (r *run) checkExits(res *Result) {
	r.obs.mu.Lock()
	defer r.obs.mu.Unlock()
	for _, c := range r.obs.crashed {
		res.Violations = append(res.Violations, Violation{Invariant: "agent-exit", Record: c, Detail: "an agent process ended without being killed"})
	}
}

// checkHarness: the stack and the processes applied and healed every fault,
// and no operator action had an outcome the product does not promise (a
// bad value written by the CLI or put in force, faults_ops.go). It also
// counts the faults applied.
func (r *run) checkHarness(res *Result) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range r.harness {
		v := Violation{Invariant: "harness", Record: e.Error(), Detail: "the stack or a process refused a fault or its healing"}
		if oe := (*opError)(nil); errors.As(e, &oe) {
			v.Invariant, v.Detail = "operator", "a bad value was accepted or not refused (faults_ops.go)"
		}
		res.Violations = append(res.Violations, v)
	}
	res.FaultsApplied = len(r.applied)
}

// missingOf returns the acknowledged records not in got, in order.
func missingOf(acked map[seqKey]bool, got []arrival) []seqKey {
	seen := make(map[seqKey]bool, len(got))
	for _, a := range got {
		seen[seqKey{a.src, a.seq}] = true
	}
	var out []seqKey
	for k := range acked {
		if !seen[k] {
			out = append(out, k)
		}
	}
	slices.SortFunc(out, func(a, b seqKey) int {
		if c := strings.Compare(a.src.String(), b.src.String()); c != 0 {
			return c
		}
		return int(a.seq - b.seq)
	})
	return out
}

// checkLost: every acknowledged record is on C.
func (r *run) checkLost(res *Result, acked map[seqKey]bool, got []arrival, missing []seqKey) {
	res.Lost = len(missing)
	if len(missing) == 0 {
		return
	}
	// When was each missing record sent? About when its predecessor on
	// C was (the value of a missing record is nowhere to be read).
	sentOf := map[srcKey][]arrival{}
	for _, a := range got {
		sentOf[a.src] = append(sentOf[a.src], a)
	}
	estimate := func(k seqKey) time.Duration {
		best := time.Duration(0)
		for _, a := range sentOf[k.src] {
			if a.seq < k.seq {
				best = max(best, a.sent.Sub(r.start))
			}
		}
		return best
	}
	first := missing[0]
	for _, k := range missing[1:] {
		if estimate(k) < estimate(first) {
			first = k
		}
	}
	var some []string
	for _, k := range missing[:min(10, len(missing))] {
		some = append(some, fmt.Sprintf("%s#%d", k.src, k.seq))
	}
	res.Violations = append(res.Violations, Violation{Invariant: "lost", At: estimate(first),
		Record: fmt.Sprintf("%s seq %d (sent about %.1fs: after its predecessor on C)", first.src, first.seq, estimate(first).Seconds()),
		Detail: fmt.Sprintf("%d of %d acknowledged records are not on C, e.g. %s", len(missing), len(acked), strings.Join(some, " "))})
}

// checkDuplicates: at_least_once, duplicates within what the faults and
// switches explain; exactly_once, none.
func (r *run) checkDuplicates(ctx context.Context, cli *clientv3.Client, res *Result, got []arrival) error {
	count := map[seqKey]int{}
	var dups []arrival
	for _, a := range got {
		k := seqKey{a.src, a.seq}
		count[k]++
		if count[k] > 1 {
			dups = append(dups, a)
		}
	}
	res.Distinct, res.Duplicates = len(count), len(dups)
	events, err := r.switches(ctx, cli)
	if err != nil {
		return err
	}
	res.Switches = len(events)
	perPartitionSecond := float64(r.cfg.Rate) / float64(r.stack.info.Partitions)
	for _, ev := range events {
		for _, p := range ev.Partitions {
			switch {
			case p.Rewound < 0: // unknown: the timestamp translation's margin (5 s)
				res.SwitchRedeliveries += int64(5 * perPartitionSecond)
			default:
				res.SwitchRedeliveries += p.Rewound
			}
			res.SwitchRedeliveries += p.Lagged
		}
	}
	budget := int(res.SwitchRedeliveries)
	r.mu.Lock()
	for _, s := range r.applied {
		if strings.HasPrefix(s.text, "inject") && !strings.Contains(s.text, string(MirrorHold)) {
			budget += int(dupSecondsPerFault * float64(r.cfg.Rate))
		}
	}
	r.mu.Unlock()
	if r.cfg.Mode == ExactlyOnce {
		budget = 0
	}
	res.DuplicateBudget = budget
	if len(dups) <= budget {
		return nil
	}
	slices.SortStableFunc(dups, func(a, b arrival) int { return a.seenAt.Compare(b.seenAt) })
	bad := dups[budget]
	rule := fmt.Sprintf("at_least_once: at most %v s of the producer's rate (%d records) per fault injected, plus each switch's rewound + lagged records in history/ (%d)",
		dupSecondsPerFault, int(dupSecondsPerFault*float64(r.cfg.Rate)), res.SwitchRedeliveries)
	if r.cfg.Mode == ExactlyOnce {
		rule = "exactly_once: none, read read_committed"
	}
	res.Violations = append(res.Violations, Violation{Invariant: "duplicates", At: bad.seenAt.Sub(r.start),
		Record: fmt.Sprintf("%s seq %d again at C %s/%d@%d (read at %.1fs)", bad.src, bad.seq, r.stack.info.OutTopic, bad.cPart, bad.cOff, bad.seenAt.Sub(r.start).Seconds()),
		Detail: fmt.Sprintf("%d duplicates, %d explained (%s)", len(dups), budget, rule)})
	return nil
}

// switchEvent is the part of a history/ entry the checker reads.
type switchEvent struct {
	Epoch      int64 `json:"epoch"`
	Partitions []struct {
		Rewound int64 `json:"rewound"`
		Lagged  int64 `json:"lagged"`
	} `json:"partitions"`
}

func (r *run) switches(ctx context.Context, cli *clientv3.Client) ([]switchEvent, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, keys.New(fleetName).SwitchHistory(), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("chaos: read history/: %w", err)
	}
	var out []switchEvent
	for _, kv := range resp.Kvs {
		var ev switchEvent
		if err := json.Unmarshal(kv.Value, &ev); err != nil {
			return nil, fmt.Errorf("chaos: %s: %w", kv.Key, err)
		}
		out = append(out, ev)
	}
	return out, nil
}

// checkOrder: per source partition, the first copies on C come in the
// order of their numbers; the exceptions allowed are those the agents
// counted in kswitch_routing_reordered_total (overtakings inside sarama's
// producer), summed over every agent process (a process's count is its
// highest scraped value: one that rose within a second of a SIGKILL is
// missed).
func (r *run) checkOrder(res *Result, got []arrival) {
	last := map[srcKey]int64{}
	seen := map[seqKey]bool{}
	var first *arrival
	for i, a := range got {
		k := seqKey{a.src, a.seq}
		if seen[k] {
			continue
		}
		seen[k] = true
		if l, ok := last[a.src]; ok && a.seq < l {
			res.Reordered++
			if first == nil {
				first = &got[i]
			}
			continue
		}
		last[a.src] = a.seq
	}
	r.obs.mu.Lock()
	for _, n := range r.obs.reorders {
		res.ReorderedCounted += n
	}
	r.obs.mu.Unlock()
	if float64(res.Reordered) <= res.ReorderedCounted {
		return
	}
	res.Violations = append(res.Violations, Violation{Invariant: "order", At: first.sent.Sub(r.start),
		Record: fmt.Sprintf("%s seq %d at C %s/%d@%d, after a later record of its source partition", first.src, first.seq, r.stack.info.OutTopic, first.cPart, first.cOff),
		Detail: fmt.Sprintf("%d first copies out of order, %v counted by kswitch_routing_reordered_total", res.Reordered, res.ReorderedCounted)})
}

// checkLeaders: one leader per term. Every /leader answer naming itself
// gave a fencing token; no token may be claimed by two agents, and the
// election key etcd created at that revision must hold the claimant's id.
func (r *run) checkLeaders(ctx context.Context, cli *clientv3.Client, res *Result) {
	r.obs.mu.Lock()
	claims := append([]leaderClaim(nil), r.obs.claims...)
	r.obs.mu.Unlock()
	byToken := map[int64][]leaderClaim{}
	for _, c := range claims {
		if !slices.ContainsFunc(byToken[c.token], func(x leaderClaim) bool { return x.agent == c.agent }) {
			byToken[c.token] = append(byToken[c.token], c)
		}
	}
	res.Terms = len(byToken)
	tokens := slices.Sorted(func(yield func(int64) bool) {
		for t := range byToken {
			if !yield(t) {
				return
			}
		}
	})
	prefix := keys.New(fleetName).Election()
	for _, t := range tokens {
		cs := byToken[t]
		if len(cs) > 1 {
			res.Violations = append(res.Violations, Violation{Invariant: "one-leader-per-term", At: cs[1].at.Sub(r.start),
				Record: fmt.Sprintf("term %d claimed by %s and %s", t, cs[0].agent, cs[1].agent), Detail: "two agents answered /leader self for one fencing token"})
			continue
		}
		gctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		resp, err := cli.Get(gctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(t))
		cancel()
		if err != nil {
			res.Violations = append(res.Violations, Violation{Invariant: "one-leader-per-term", At: cs[0].at.Sub(r.start),
				Record: fmt.Sprintf("term %d", t), Detail: fmt.Sprintf("etcd at revision %d: %v", t, err)})
			continue
		}
		owner := ""
		for _, kv := range resp.Kvs {
			if kv.CreateRevision == t {
				owner = string(kv.Value)
			}
		}
		if owner != cs[0].agent {
			res.Violations = append(res.Violations, Violation{Invariant: "one-leader-per-term", At: cs[0].at.Sub(r.start),
				Record: fmt.Sprintf("term %d claimed by %s", t, cs[0].agent),
				Detail: fmt.Sprintf("etcd's election key created at revision %d names %q", t, owner)})
		}
	}
}

// behind lists the partitions of the active cluster whose committed
// position in etcd is short of the partition's end, or why that cannot be
// told (a switch under way, a cluster that does not answer).
func (r *run) behind(ctx context.Context, cli *clientv3.Client) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	k := keys.New(fleetName)
	resp, err := cli.Get(ctx, k.Active())
	if err != nil {
		return nil, fmt.Errorf("etcd state/active: %w", err)
	}
	if len(resp.Kvs) == 0 {
		return []string{"no state/active"}, nil
	}
	var active struct {
		Cluster string `json:"cluster"`
		Phase   string `json:"phase"`
	}
	if err := json.Unmarshal(resp.Kvs[0].Value, &active); err != nil {
		return nil, fmt.Errorf("state/active: %w", err)
	}
	if active.Phase != "active" {
		return []string{fmt.Sprintf("state/active: %s to %s", active.Phase, active.Cluster)}, nil
	}
	other := map[string]string{"A": "B", "B": "A"}[active.Cluster]
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	sc.Net.DialTimeout, sc.Net.ReadTimeout = time.Second, 2*time.Second
	kc, err := sarama.NewClient(r.stack.info.Clusters[active.Cluster], sc)
	if err != nil {
		return nil, fmt.Errorf("a client of %s: %w", active.Cluster, err)
	}
	defer kc.Close()
	var out []string
	for _, topic := range []string{r.stack.info.Topic, other + "." + r.stack.info.Topic} {
		parts, err := kc.Partitions(topic) // partitions may have been added (partitions-add)
		if err != nil {
			return nil, fmt.Errorf("%s's partitions of %s: %w", active.Cluster, topic, err)
		}
		for _, p := range parts {
			end, err := kc.GetOffset(topic, p, sarama.OffsetNewest)
			if err != nil {
				return nil, fmt.Errorf("%s's end of %s/%d: %w", active.Cluster, topic, p, err)
			}
			resp, err := cli.Get(ctx, k.Offset(active.Cluster, topic, p))
			if err != nil {
				return nil, fmt.Errorf("etcd offsets: %w", err)
			}
			committed := int64(-1)
			if len(resp.Kvs) == 1 {
				var v struct {
					Offset int64 `json:"offset"`
				}
				if err := json.Unmarshal(resp.Kvs[0].Value, &v); err != nil {
					return nil, fmt.Errorf("%s: %w", resp.Kvs[0].Key, err)
				}
				committed = v.Offset
			}
			if end > 0 && committed < end {
				out = append(out, fmt.Sprintf("%s:%s/%d committed %d of %d", active.Cluster, topic, p, committed, end))
			}
		}
	}
	return out, nil
}

// report prints the result and, for each violation, the seed, the
// timeline with a marker and the first bad record.
func (r *run) report(res *Result) {
	w := r.cfg.Out
	fmt.Fprintf(w, "\nchaos result (seed %d, %v, %s):\n", r.cfg.Seed, r.cfg.Duration, r.cfg.Mode)
	fmt.Fprintf(w, "  faults applied (injections and heals) %d\n", res.FaultsApplied)
	fmt.Fprintf(w, "  acknowledged records                   %d (%d sends of unknown outcome)\n", res.Acked, res.Unknown)
	fmt.Fprintf(w, "  on C                                   %d (%d distinct)\n", res.OnC, res.Distinct)
	fmt.Fprintf(w, "  lost                                   %d\n", res.Lost)
	fmt.Fprintf(w, "  duplicates                             %d (explained: %d; switches' rewound+lagged %d over %d switches)\n", res.Duplicates, res.DuplicateBudget, res.SwitchRedeliveries, res.Switches)
	fmt.Fprintf(w, "  out of order (first copies)            %d (counted by the agents: %v)\n", res.Reordered, res.ReorderedCounted)
	fmt.Fprintf(w, "  terms seen (/leader)                   %d\n", res.Terms)
	fmt.Fprintf(w, "  agents' commits checked (etcd history) %d\n", res.CommitsChecked)
	fmt.Fprintf(w, "  records on C attributed to an agent    %d (%d delivered without holding their partition)\n", res.DeliveriesAttributed, res.DeliveredUnowned)
	fmt.Fprintf(w, "  /readyz answers checked                %d\n", res.ReadyzChecked)
	if res.Settled > 0 {
		fmt.Fprintf(w, "  settled after the producer stopped     %v (bound %v)\n", res.Settled.Round(100*time.Millisecond), settleBound)
	}
	for _, v := range res.Violations {
		fmt.Fprintf(w, "\nVIOLATION %s (seed %d): %s\n  first bad: %s\n", v.Invariant, r.cfg.Seed, v.Detail, v.Record)
		r.timelineWithMarker(w, v.At, "first bad: "+v.Record)
	}
	if !res.Failed() {
		fmt.Fprintf(w, "PASS: every invariant held (seed %d)\n", r.cfg.Seed)
	}
}

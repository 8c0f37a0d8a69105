package coordinator

import (
	"maps"
	"slices"

	"github.com/kswitch/kswitch/state"
)

// Balance returns the assignment the fleet should converge to: every
// partition with exactly one of agents, per-agent counts differing by at
// most one, and as few partitions as possible taken from their owner in
// current.
//
// Stickiness matters because every move costs a revoke → ack → assign round
// trip during which the partition is not consumed, and a restart at the
// committed offset (re-delivering what was in flight). So a partition stays
// with its owner unless the owner is gone or keeping it would break the
// balance; the freed and the new partitions fill the agents with room,
// those with the fewest of their topic first. Within those counts each
// topic is spread over the agents (see below).
//
// The leader must reach the same answer every time it looks at the same
// state (a new leader, or a retried publish, must not reshuffle), so the
// result depends only on the sets given, never on their order. Partitions
// of current that are not in partitions (deleted topics) are ignored, as
// are agents of current not in agents. Only agents given at least one
// partition appear in the result; its lists are sorted.
func Balance(partitions []state.TopicPartition, agents []string, current map[string][]state.TopicPartition) map[string][]state.TopicPartition {
	out := map[string][]state.TopicPartition{}
	agents = sortedUnique(agents)
	if len(agents) == 0 {
		return out
	}
	parts := sortedPartitions(partitions)
	held := heldBy(parts, agents, current)
	b := newBalancer(parts, quotas(held, len(parts)))
	// Each topic is spread over the agents within one partition, its
	// extras (the remainder of its partitions over the agents) on
	// different agents, as far as that takes nothing from an owner more
	// than the quotas do: every agent keeps min(held, quota). Then a
	// topic, or several, that later move alone to another cluster (a
	// topic pin, a staged move) leave every agent about as loaded as
	// before, and the other topics' partitions need not move to even it
	// out.
	for i := range agents {
		if len(held[i]) <= b.quota[i] {
			for _, tp := range held[i] {
				b.keep(i, tp)
			}
		}
	}
	for i := range agents {
		if len(held[i]) > b.quota[i] {
			b.keepSome(i, held[i])
		}
	}
	for _, tp := range parts {
		if !b.kept[tp] {
			b.place(tp)
		}
	}
	for i, a := range agents {
		if len(b.lists[i]) > 0 {
			slices.SortFunc(b.lists[i], state.TopicPartition.Compare)
			out[a] = b.lists[i]
		}
	}
	return out
}

// heldBy returns, for each of agents, what it has in current and may
// keep: partitions of parts, sorted. A partition listed under two agents
// (never in a valid assignment) is held by the first by id.
func heldBy(parts []state.TopicPartition, agents []string, current map[string][]state.TopicPartition) [][]state.TopicPartition {
	exists := setOf(parts)
	held := make([][]state.TopicPartition, len(agents))
	claimed := map[state.TopicPartition]bool{}
	for i, a := range agents {
		for _, tp := range sortedPartitions(current[a]) {
			if exists[tp] && !claimed[tp] {
				claimed[tp] = true
				held[i] = append(held[i], tp)
			}
		}
	}
	return held
}

// quotas returns how many of n partitions each agent ends with: floor(n/k)
// or, for exactly n mod k of them, ceil(n/k). An agent keeps min(held,
// quota) partitions, so the extra one is worth a kept partition only to
// agents holding more than the floor: it goes to those holding most.
func quotas(held [][]state.TopicPartition, n int) []int {
	k := len(held)
	base, extra := n/k, n%k
	order := make([]int, k)
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(i, j int) int { return len(held[j]) - len(held[i]) })
	quota := make([]int, k)
	for rank, i := range order {
		quota[i] = base
		if rank < extra {
			quota[i]++
		}
	}
	return quota
}

// balancer builds Balance's lists, agent by agent (by index).
type balancer struct {
	quota    []int // by agent; its length is the number of agents
	perTopic map[string]int
	lists    [][]state.TopicPartition
	owned    []map[string]int // owned[i][topic]: lists[i]'s partitions of topic
	atCeil   map[string]int   // agents holding more than the topic's floor
	kept     map[state.TopicPartition]bool
}

func newBalancer(parts []state.TopicPartition, quota []int) *balancer {
	k := len(quota)
	b := &balancer{quota: quota, perTopic: map[string]int{}, lists: make([][]state.TopicPartition, k),
		owned: make([]map[string]int, k), atCeil: map[string]int{}, kept: map[state.TopicPartition]bool{}}
	for _, tp := range parts {
		b.perTopic[tp.Topic]++
	}
	for i := range b.owned {
		b.owned[i] = map[string]int{}
	}
	return b
}

// keep gives tp to agent i.
func (b *balancer) keep(i int, tp state.TopicPartition) {
	b.lists[i] = append(b.lists[i], tp)
	b.kept[tp] = true
	if b.owned[i][tp.Topic]++; b.owned[i][tp.Topic] == b.perTopic[tp.Topic]/len(b.quota)+1 {
		b.atCeil[tp.Topic]++
	}
}

// keepSome lets agent i, holding more than its quota, choose what it
// keeps: first up to each topic's floor, then a topic's extra while the
// topic has extras left, then anything (partition numbers first, then
// topics: a mix).
func (b *balancer) keepSome(i int, held []state.TopicPartition) {
	slices.SortStableFunc(held, func(x, y state.TopicPartition) int {
		if x.Partition != y.Partition {
			return int(x.Partition) - int(y.Partition)
		}
		return x.Compare(y)
	})
	floor := func(tp state.TopicPartition) int { return b.perTopic[tp.Topic] / len(b.quota) }
	for _, pass := range []func(state.TopicPartition) bool{
		func(tp state.TopicPartition) bool { return b.owned[i][tp.Topic] < floor(tp) },
		func(tp state.TopicPartition) bool {
			return b.owned[i][tp.Topic] == floor(tp) && b.atCeil[tp.Topic] < b.perTopic[tp.Topic]%len(b.quota)
		},
		func(state.TopicPartition) bool { return true },
	} {
		for _, tp := range held {
			if len(b.lists[i]) < b.quota[i] && !b.kept[tp] && pass(tp) {
				b.keep(i, tp)
			}
		}
	}
}

// place gives tp, which nobody kept, to an agent with room: the one with
// the fewest of its topic, then the fewest partitions, then the first by
// id.
func (b *balancer) place(tp state.TopicPartition) {
	best := -1
	for i := range b.lists {
		if len(b.lists[i]) >= b.quota[i] {
			continue
		}
		if best < 0 || b.owned[i][tp.Topic] < b.owned[best][tp.Topic] ||
			b.owned[i][tp.Topic] == b.owned[best][tp.Topic] && len(b.lists[i]) < len(b.lists[best]) {
			best = i
		}
	}
	b.keep(best, tp)
}

// Moves counts the partitions present in both from and to whose agent
// differs: the partitions a rebalance from one to the other takes away from
// a consumer. Partitions only in one of them (created, deleted) are not
// moves. Each partition is expected at most once per map.
func Moves(from, to map[string][]state.TopicPartition) int {
	owner := map[state.TopicPartition]string{}
	for a, tps := range to {
		for _, tp := range tps {
			owner[tp] = a
		}
	}
	moves := 0
	for a, tps := range from {
		for _, tp := range tps {
			if o, ok := owner[tp]; ok && o != a {
				moves++
			}
		}
	}
	return moves
}

// PlanInput is what the leader knows when it plans one generation.
type PlanInput struct {
	// Current is the last published assignment (zero value: none yet,
	// Generation 0). It is trusted to be valid, as ParseAssignment checks.
	Current state.Assignment
	// Partitions are all source partitions of Cluster.
	Partitions []state.TopicPartition
	// Cluster is the cluster to consume from.
	Cluster string
	// Live are the agents that are registered (their session lease
	// holds): every agent that may be consuming. A live agent keeps what
	// it consumes until it acknowledges its release.
	Live []string
	// CutOff are live agents that get no partitions (alone cut off from
	// Cluster, see the leader): what they own is revoked like any
	// partition that moves, never handed to another agent before they
	// acknowledge the release. They may still be consuming (a probe that
	// timed out on a loaded machine, records fetched before the cut), and
	// their commits are still accepted until the release. Agents not in
	// Live are ignored.
	CutOff []string
	// Acks maps agent id → the last generation it acknowledged, that is
	// applied fully: released what it was revoking, committed, started what
	// it owns.
	Acks map[string]int64
}

// Plan computes the generation that follows in.Current, or reports that
// none is needed (changed false, next == in.Current).
//
// The guarantee it keeps: a partition never has two consumers. A live agent
// that may consume a partition (it owns it, or is revoking it and has not
// acknowledged) keeps it, owned or revoking, in the next generation; nobody
// else gets it until that agent has acknowledged a generation in which it
// no longer owns it, or until it is no longer live (its lease has ended, so
// etcd fencing refuses its commits). Moving a partition therefore takes two
// generations: revoke, then, once acknowledged, assign.
//
// A cluster switch (in.Cluster differs from a published Current.Cluster)
// publishes a generation in which nobody owns anything: every live owner
// revokes all it consumes on the old cluster. The next generations assign
// on the new cluster as the releases are acknowledged; between the two the
// caller translates the committed offsets to the new cluster.
//
// With every live agent acknowledging each generation, iterating Plan
// reaches, in at most two changed generations, Owned == Balance(...) over
// the live agents not cut off, with nothing revoking, and then reports no
// change.
//
// When changed, next has Generation = Current.Generation+1 and Cluster =
// in.Cluster; Leader, Token and Published are for the caller to fill.
// Owned and Revoking are non-nil, hold only agents with partitions, and
// their lists are sorted.
func Plan(in PlanInput) (next state.Assignment, changed bool) {
	cur := in.Current
	gen := cur.Generation
	live := setOf(in.Live)
	// Partitions go only to the live agents that are not cut off.
	ready := slices.DeleteFunc(slices.Clone(in.Live), func(a string) bool { return slices.Contains(in.CutOff, a) })
	acked := func(a string) bool { return in.Acks[a] >= gen }
	switching := gen > 0 && in.Cluster != cur.Cluster
	exists := setOf(in.Partitions)
	owned := map[string][]state.TopicPartition{}
	revoking := map[string][]state.TopicPartition{}
	taken := map[state.TopicPartition]bool{}
	take := func(m map[string][]state.TopicPartition, a string, tp state.TopicPartition) {
		taken[tp] = true
		m[a] = append(m[a], tp)
	}

	// Releases still in progress stand, whatever else changed: the agent
	// may still be consuming, and it may still commit. Deleted partitions
	// included: the agent must still stop them.
	for _, r := range slices.Sorted(maps.Keys(cur.Revoking)) {
		if !live[r] || acked(r) {
			continue
		}
		for _, tp := range cur.Revoking[r] {
			if !taken[tp] {
				take(revoking, r, tp)
			}
		}
	}

	holders := slices.Sorted(maps.Keys(cur.Owned))
	target := balancedTarget(in, holders, live, ready)

	// A live owner keeps what the target leaves it and releases the rest.
	// A partition that no longer exists is released too rather than
	// dropped: were it dropped and then seen again (a metadata glitch),
	// it could be assigned elsewhere before the owner had stopped it.
	for _, o := range holders {
		if !live[o] {
			continue
		}
		for _, tp := range cur.Owned[o] {
			switch {
			case taken[tp]:
			case !switching && exists[tp] && target[tp] == o:
				take(owned, o, tp)
			default:
				take(revoking, o, tp)
			}
		}
	}

	// Free partitions: never owned, owner gone, or release acknowledged.
	// None is assigned in the switch generation: offsets are translated
	// to the new cluster before anyone starts there.
	if !switching {
		for _, tp := range sortedPartitions(in.Partitions) {
			if a, ok := target[tp]; ok && !taken[tp] {
				take(owned, a, tp)
			}
		}
	}

	sortLists(owned, revoking)
	if cur.Cluster == in.Cluster && sameOwners(cur.Owned, owned) && sameOwners(cur.Revoking, revoking) {
		return cur, false
	}
	return state.Assignment{
		Generation: gen + 1,
		Cluster:    in.Cluster,
		Owned:      owned,
		Revoking:   revoking,
	}, true
}

// balancedTarget returns who should own each partition: Balance over the
// ready agents, with what the live holders own as its sticky base.
func balancedTarget(in PlanInput, holders []string, live map[string]bool, ready []string) map[state.TopicPartition]string {
	holding := map[string][]state.TopicPartition{}
	for _, o := range holders {
		if live[o] {
			holding[o] = in.Current.Owned[o]
		}
	}
	target := map[state.TopicPartition]string{}
	for a, tps := range Balance(in.Partitions, ready, holding) {
		for _, tp := range tps {
			target[tp] = a
		}
	}
	return target
}

// sortLists sorts every list of the given assignment maps.
func sortLists(ms ...map[string][]state.TopicPartition) {
	for _, m := range ms {
		for _, tps := range m {
			slices.SortFunc(tps, state.TopicPartition.Compare)
		}
	}
}

// setOf returns the set of the elements of s.
func setOf[T comparable](s []T) map[T]bool {
	m := make(map[T]bool, len(s))
	for _, v := range s {
		m[v] = true
	}
	return m
}

// sameOwners reports whether a and b give the same partitions to the same
// agents, ignoring list order and agents without partitions.
func sameOwners(a, b map[string][]state.TopicPartition) bool {
	count := func(m map[string][]state.TopicPartition) int {
		n := 0
		for _, tps := range m {
			if len(tps) > 0 {
				n++
			}
		}
		return n
	}
	if count(a) != count(b) {
		return false
	}
	for agent, tps := range a {
		if len(tps) == 0 {
			continue
		}
		if !slices.Equal(sortedPartitions(tps), sortedPartitions(b[agent])) {
			return false
		}
	}
	return true
}

// sortedPartitions returns a sorted copy of tps without duplicates.
func sortedPartitions(tps []state.TopicPartition) []state.TopicPartition {
	s := slices.Clone(tps)
	slices.SortFunc(s, state.TopicPartition.Compare)
	return slices.Compact(s)
}

// sortedUnique returns a sorted copy of ss without duplicates.
func sortedUnique(ss []string) []string {
	s := slices.Clone(ss)
	slices.Sort(s)
	return slices.Compact(s)
}

// SectionsInput is what the leader knows when it plans a generation over
// several clusters: the fleet's own and those topics are placed on.
type SectionsInput struct {
	// Current is the last published assignment, as for Plan.
	Current state.Assignment
	// Cluster is the assignment's own cluster: the fleet's.
	Cluster string
	// Partitions are, by cluster, the source partitions to consume there.
	// A cluster absent here gets none: every section of Current that is
	// not listed is released.
	Partitions map[string][]state.TopicPartition
	// Live, as for Plan.
	Live []string
	// CutOff are, by cluster, the live agents that get no partitions
	// there (Plan's CutOff).
	CutOff map[string][]string
	// Acks, as for Plan.
	Acks map[string]int64
}

// PlanSections plans the generation that follows in.Current over every
// cluster of in.Partitions and every section of in.Current: Plan, once
// per cluster, on that cluster's section, under one generation. So
// whatever Plan guarantees holds in each cluster, and a partition that
// moves between clusters (its topic placed elsewhere) is released in the
// section it leaves before it is assigned in the other: the caller leaves
// it out of both until its position is translated.
//
// Unlike Plan, a change of in.Cluster is not a switch: the sections keep
// their owners, the assignment's own cluster is relabelled. A fleet switch
// releases the cluster it leaves by listing no partitions there.
//
// When changed, next has Generation = Current.Generation+1, Cluster =
// in.Cluster and Placed holding only sections with partitions.
func PlanSections(in SectionsInput) (next state.Assignment, changed bool) {
	cur := in.Current
	clusters := map[string]bool{in.Cluster: true}
	for c := range in.Partitions {
		clusters[c] = true
	}
	if cur.Generation > 0 {
		for _, c := range cur.Sections() {
			clusters[c] = true
		}
	}
	next = state.Assignment{Generation: cur.Generation + 1, Cluster: in.Cluster}
	changed = cur.Cluster != in.Cluster
	for _, c := range slices.Sorted(maps.Keys(clusters)) {
		sec := cur.Section(c)
		if cur.Generation == 0 {
			sec = state.Placement{}
		}
		was := state.Assignment{Generation: cur.Generation, Cluster: c, Owned: sec.Owned, Revoking: sec.Revoking}
		p, ch := Plan(PlanInput{Current: was, Partitions: in.Partitions[c], Cluster: c, Live: in.Live, CutOff: in.CutOff[c], Acks: in.Acks})
		changed = changed || ch
		owned, revoking := nonEmpty(p.Owned), nonEmpty(p.Revoking)
		if c == in.Cluster {
			next.Owned, next.Revoking = owned, revoking
			continue
		}
		if len(owned) > 0 || len(revoking) > 0 {
			if next.Placed == nil {
				next.Placed = map[string]state.Placement{}
			}
			next.Placed[c] = state.Placement{Owned: owned, Revoking: revoking}
		}
	}
	if !changed {
		return cur, false
	}
	if next.Owned == nil {
		next.Owned = map[string][]state.TopicPartition{}
	}
	if next.Revoking == nil {
		next.Revoking = map[string][]state.TopicPartition{}
	}
	return next, true
}

// nonEmpty returns m without the agents that have no partitions, nil when
// none has any.
func nonEmpty(m map[string][]state.TopicPartition) map[string][]state.TopicPartition {
	var out map[string][]state.TopicPartition
	for a, tps := range m {
		if len(tps) > 0 {
			if out == nil {
				out = map[string][]state.TopicPartition{}
			}
			out[a] = tps
		}
	}
	return out
}

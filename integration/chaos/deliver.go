//go:build chaos

package chaos

import (
	"fmt"
	"slices"
	"time"

	"github.com/kswitch/kswitch/state"
)

// producerSession is the producer that wrote a record to C: its batch's
// producer id and epoch. An agent process's idempotent producer (or, in
// exactly_once, one owner's transactional producer of a stream, whose
// epoch each new owner bumps) writes under one session; a restarted
// agent, and a new owner, under another.
type producerSession struct {
	id    int64
	epoch int16
}

// ownSlack widens the window in which an agent must have owned a record's
// partition, on both sides: the record's write time is the stack's clock
// in milliseconds, an assignment's time is when the leader published it
// or the checker's watch delivered it (a loaded driver delivers it after
// the agents acted on it).
const ownSlack = time.Second

// ownership is one agent's hold on one partition: from the assignment that
// gave it (owned or revoking) to the first one that did not (to zero:
// still held). Times are when the watch delivered them.
type ownership struct {
	agent    string
	part     clusterPart
	from, to time.Time
	gen      int64 // the generation that ended it
}

// ownerships returns every agent's holds on every partition, from the
// assignments' history. Called with h.mu held.
func (h *history) ownerships() []ownership {
	type key struct {
		agent string
		part  clusterPart
	}
	open := map[key]time.Time{}
	var out []ownership
	for _, at := range h.assignments {
		now := map[key]bool{}
		for _, c := range at.a.Sections() {
			sec := at.a.Section(c)
			for _, m := range []map[string][]state.TopicPartition{sec.Owned, sec.Revoking} {
				for agent, tps := range m {
					for _, tp := range tps {
						now[key{agent, clusterPart{c, tp.Topic, tp.Partition}}] = true
					}
				}
			}
		}
		for k, from := range open {
			if !now[k] {
				out = append(out, ownership{agent: k.agent, part: k.part, from: from, to: at.seen, gen: at.a.Generation})
				delete(open, k)
			}
		}
		for k := range now {
			if _, ok := open[k]; !ok {
				// The leader's clock when it wrote the value, if
				// earlier than the watch's delivery: an agent may act
				// on it before the checker's watch delivers it.
				open[k] = at.seen
				if p := at.a.Published; !p.IsZero() && p.Before(at.seen) {
					open[k] = p
				}
			}
		}
	}
	for k, from := range open {
		out = append(out, ownership{agent: k.agent, part: k.part, from: from})
	}
	return out
}

// checkDeliveries: a record reaches C only through an agent that held its
// partition at some moment between the record's write to the source and
// its arrival on C (widened by ownSlack on both sides). The agent of a record is read
// from C: its producer session, attributed to the agent that held the
// partitions of most of the session's records in that way (sessions whose
// records no agent explains for more than half are not judged). A record
// delivered by an agent that had released its partition before the record
// was even written was consumed again after the release: a second agent
// delivering the partition. In-flight records of an agent stopped and
// continued after its partitions moved were written while it held them,
// and pass.
func (r *run) checkDeliveries(res *Result, got []arrival) {
	h := r.obs.fleet.hist
	h.mu.Lock()
	own := h.ownerships()
	h.mu.Unlock()
	bySrc := map[srcKey][]ownership{}
	for _, o := range own {
		for _, src := range r.sourcesOf(o.part) {
			bySrc[src] = append(bySrc[src], o)
		}
	}
	held := func(agent string, a arrival) bool {
		from := a.sent.Add(-ownSlack)
		return slices.ContainsFunc(bySrc[a.src], func(o ownership) bool {
			return o.agent == agent && !o.from.After(a.seenAt.Add(ownSlack)) && (o.to.IsZero() || !o.to.Before(from))
		})
	}
	tally := map[producerSession]map[string]int{}
	total := map[producerSession]int{}
	for _, a := range got {
		if a.producer.id < 0 {
			continue
		}
		if tally[a.producer] == nil {
			tally[a.producer] = map[string]int{}
		}
		total[a.producer]++
		seen := map[string]bool{}
		for _, o := range bySrc[a.src] {
			if !seen[o.agent] && held(o.agent, a) {
				seen[o.agent] = true
				tally[a.producer][o.agent]++
			}
		}
	}
	agentOf := map[producerSession]string{}
	for p, t := range tally {
		best, n := "", 0
		for agent, c := range t {
			if c > n || (c == n && agent < best) {
				best, n = agent, c
			}
		}
		if 2*n > total[p] {
			agentOf[p] = best
		}
	}
	var bad []arrival
	for _, a := range got {
		agent, ok := agentOf[a.producer]
		if !ok {
			continue
		}
		res.DeliveriesAttributed++
		if !held(agent, a) {
			bad = append(bad, a)
		}
	}
	res.DeliveredUnowned = len(bad)
	if len(bad) == 0 {
		return
	}
	slices.SortStableFunc(bad, func(x, y arrival) int { return x.seenAt.Compare(y.seenAt) })
	a := bad[0]
	agent := agentOf[a.producer]
	last := "never held it"
	for _, o := range bySrc[a.src] {
		if o.agent == agent && !o.to.IsZero() && o.to.Before(a.sent) {
			last = fmt.Sprintf("released %s at %.1fs (generation %d)", o.part, o.to.Sub(r.start).Seconds(), o.gen)
		}
	}
	res.Violations = append(res.Violations, Violation{Invariant: "delivered-unowned", At: a.seenAt.Sub(r.start),
		Record: fmt.Sprintf("%s seq %d at C %s/%d@%d, written at %.1fs, read at %.1fs, by %s (producer id %d epoch %d)",
			a.src, a.seq, r.stack.info.OutTopic, a.cPart, a.cOff, a.sent.Sub(r.start).Seconds(), a.seenAt.Sub(r.start).Seconds(), agent, a.producer.id, a.producer.epoch),
		Detail: fmt.Sprintf("%d records delivered by an agent that did not hold their partition between their write and their arrival; %s %s",
			len(bad), agent, last)})
}

// sourcesOf returns the source partitions whose records part carries: A's
// orders/n is A:orders/n, B's A.orders/n (the mirror's copy) is A:orders/n
// too.
func (r *run) sourcesOf(part clusterPart) []srcKey {
	if part.topic == r.stack.info.Topic {
		return []srcKey{{part.cluster, part.partition}}
	}
	for _, origin := range []string{"A", "B"} {
		if part.topic == origin+"."+r.stack.info.Topic {
			return []srcKey{{origin, part.partition}}
		}
	}
	return nil
}

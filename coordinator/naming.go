package coordinator

import (
	"slices"
	"strings"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/state"
	"github.com/kswitch/kswitch/translate"
)

// Naming maps source topics between clusters. A logical topic (orders) is
// every physical copy of it on a source cluster: the local topic, written
// by producers there, and each copy MirrorMaker 2 makes of another source
// cluster's local topic. Under the prefix policy, orders on the primary A
// is orders (origin A) plus B.orders (origin B, copied back from the
// standby), and on B it is A.orders (origin A) plus orders (origin B).
// Copies of copies keep every alias: in a chain A → B → D, D holds A's
// orders as B.A.orders. Under the identity policy (one way) a copy keeps
// its name, and its origin is upstream. A physical topic is named by its
// logical name and its origin; partition numbers are the same on every
// cluster.
//
// When a stream reaches a cluster along several paths (a star that also
// copies B into D holds A's orders as A.orders and as B.A.orders), one copy
// is the stream's there: the one along the fewest flows, ties going to
// the more preferred clusters (Copy says which).
type Naming struct {
	sources []string // in order of preference
	// into lists the flows into each cluster, their sources in order of
	// preference.
	into map[string][]config.Replication
	// flows are the flows by their ends.
	flows map[[2]string]config.Replication
}

// NewNaming returns the naming of cfg's clusters.
func NewNaming(cfg config.Config) Naming {
	n := Naming{sources: cfg.Sources(), into: map[string][]config.Replication{}, flows: map[[2]string]config.Replication{}}
	for _, r := range cfg.Flows() {
		n.into[r.To] = append(n.into[r.To], r)
		n.flows[[2]string{r.From, r.To}] = r
	}
	for _, in := range n.into {
		slices.SortStableFunc(in, func(a, b config.Replication) int { return n.rank(a.From) - n.rank(b.From) })
	}
	return n
}

// rank is cluster's place in the order of preference (len(sources) for
// one that is not a source).
func (n Naming) rank(cluster string) int {
	if i := slices.Index(n.sources, cluster); i >= 0 {
		return i
	}
	return len(n.sources)
}

// Stream is a physical topic's identity on every cluster: its logical
// name and the cluster whose producers write it (its origin).
type Stream struct {
	Logical, Origin string
}

// TopicOn returns the physical name on cluster of s: the logical name on
// its origin, else the name its copy along the fewest flows has there
// (every flow's naming applied in turn). A cluster no flow brings the
// stream to has it under its logical name.
func (n Naming) TopicOn(cluster string, s Stream) string {
	name := s.Logical
	for _, r := range n.path(s.Origin, cluster) {
		name = r.RemoteTopic(name)
	}
	return name
}

// path returns the flows along which a stream written on origin reaches
// cluster with the fewest hops, nil when it is origin or unreachable.
// Breadth first, each cluster's flows out taken in the order of
// preference of their targets, so ties go to preferred clusters.
func (n Naming) path(origin, cluster string) []config.Replication {
	if origin == cluster {
		return nil
	}
	via := map[string]config.Replication{origin: {}}
	for queue := []string{origin}; len(queue) > 0; queue = queue[1:] {
		at := queue[0]
		for _, to := range n.sources {
			r, ok := n.flows[[2]string{at, to}]
			if _, seen := via[to]; !ok || seen {
				continue
			}
			via[to] = r
			if to == cluster {
				var hops []config.Replication
				for c := cluster; c != origin; c = via[c].From {
					hops = append(hops, via[c])
				}
				slices.Reverse(hops)
				return hops
			}
			queue = append(queue, to)
		}
	}
	return nil
}

// Stream returns what physical topic is on cluster: a copy when a flow
// into cluster names it so (its alias, then the name of a stream on that
// flow's source that did not start on cluster; every topic, under the
// identity policy), else a local topic (a copy made under an alias no flow
// here has is taken for a local topic whose name has a dot; discovery
// matches the logical name against the configured topics and regex).
func (n Naming) Stream(cluster, topic string) Stream {
	return n.stream(cluster, topic, len(n.sources))
}

// stream is Stream following at most depth identity flows (a loop of
// them is refused by config.Validate, and bounded here).
func (n Naming) stream(cluster, topic string, depth int) Stream {
	for _, r := range n.into[cluster] {
		if r.Policy == "identity" {
			if depth == 0 {
				break
			}
			if s := n.stream(r.From, topic, depth-1); s.Origin != cluster {
				return s
			}
			continue
		}
		if rest, ok := strings.CutPrefix(topic, r.SourceAlias+"."); ok && rest != "" {
			if s := n.stream(r.From, rest, depth); s.Origin != cluster {
				return s
			}
		}
	}
	return Stream{Logical: topic, Origin: cluster}
}

// Copy reports whether topic on cluster is its stream's copy there, not a
// second one that came along a longer path: the fleet consumes only the
// first, as both hold the same records.
func (n Naming) Copy(cluster, topic string) bool {
	return n.TopicOn(cluster, n.Stream(cluster, topic)) == topic
}

// Logical returns the logical name of topic as found on cluster.
func (n Naming) Logical(cluster, topic string) string {
	return n.Stream(cluster, topic).Logical
}

// PartitionOn maps a partition of a topic on cluster `from` to cluster
// `to`: the same stream's physical topic there.
func (n Naming) PartitionOn(from, to string, tp state.TopicPartition) state.TopicPartition {
	return state.TopicPartition{Topic: n.TopicOn(to, n.Stream(from, tp.Topic)), Partition: tp.Partition}
}

// Flow says how a switch from `from` to `to` translates the positions of
// stream s with MirrorMaker 2's data: along the flow from → to when s's
// copy on `to` is made from its copy on `from` (Forward), against the flow
// to → from when it is the other way round (Backward). ok is false when no
// flow joins the two copies directly (a chain's ends, two replicas of the
// same source): the records themselves translate (fingerprints,
// timestamps).
func (n Naming) Flow(from, to string, s Stream) (r config.Replication, dir translate.Direction, ok bool) {
	onFrom, onTo := n.TopicOn(from, s), n.TopicOn(to, s)
	if r, ok := n.flows[[2]string{from, to}]; ok && r.RemoteTopic(onFrom) == onTo {
		return r, translate.Forward, true
	}
	if r, ok := n.flows[[2]string{to, from}]; ok && r.RemoteTopic(onTo) == onFrom {
		return r, translate.Backward, true
	}
	return config.Replication{}, translate.Forward, false
}

// FromStandby reports whether s is written by producers on a standby:
// records of an outage, consumed from their start when the fleet has no
// position for them (source.initial_offset applies to the primary's
// topics and their copies only).
func (n Naming) FromStandby(s Stream) bool {
	return len(n.sources) > 1 && slices.Contains(n.sources[1:], s.Origin)
}

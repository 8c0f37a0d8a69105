package coordinator

import (
	"strings"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/state"
)

// Naming maps source topics between clusters. A logical topic (orders) is
// every physical copy of it on a source cluster: the local topic, written
// by producers there, and each copy MirrorMaker 2 makes of another source
// cluster's local topic. Under the prefix policy, orders on the primary A
// is orders (origin A) plus B.orders (origin B, copied back from the
// standby), and on B it is A.orders (origin A) plus orders (origin B).
// Under the identity policy (one-way replication) a topic has the same
// name on both clusters and its origin is the primary. A physical topic
// is named by its logical name and its origin; partition numbers are the
// same on every cluster.
type Naming struct {
	primary, standby string
	// into is the flow into each cluster (config.Replication), resolved
	// once: every name lookup needs it.
	into map[string]config.Replication
}

// NewNaming returns the naming of cfg's clusters.
func NewNaming(cfg config.Config) Naming {
	p, _ := cfg.Primary()
	s, _, _ := cfg.Standby()
	n := Naming{primary: p, standby: s, into: make(map[string]config.Replication, len(cfg.Clusters))}
	for name := range cfg.Clusters {
		n.into[name] = cfg.Replication(name)
	}
	return n
}

// Stream is a physical topic's identity on every cluster: its logical
// name and the cluster whose producers write it (its origin).
type Stream struct {
	Logical, Origin string
}

// TopicOn returns the physical name on cluster of s: the logical name on
// its origin, else the name the flow into cluster gives a copy of it.
func (n Naming) TopicOn(cluster string, s Stream) string {
	if cluster == s.Origin {
		return s.Logical
	}
	return n.into[cluster].RemoteTopic(s.Logical)
}

// Stream returns what physical topic is on cluster. A topic that is not a
// copy by the flow into cluster is local there (a copy made under another
// alias is taken for a local topic whose name has a dot; discovery
// matches the logical name against the configured topics and regex).
func (n Naming) Stream(cluster, topic string) Stream {
	r := n.into[cluster]
	switch {
	case r.From == "":
		// The primary without a flow back (no standby, or identity):
		// every topic is local.
		return Stream{Logical: topic, Origin: cluster}
	case r.Policy == "identity":
		// A one-way replica: every topic is the primary's.
		return Stream{Logical: topic, Origin: r.From}
	}
	if logical, ok := strings.CutPrefix(topic, r.SourceAlias+"."); ok && logical != "" {
		return Stream{Logical: logical, Origin: r.From}
	}
	return Stream{Logical: topic, Origin: cluster}
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
// stream s: along the flow into `to` forward (from is the stream's origin
// upstream), or along the flow into `from` backward (to is the origin).
// A stream whose origin is neither (not possible with one primary and one
// standby) is translated forward without MirrorMaker 2's data.
func (n Naming) Flow(from, to string, s Stream) (into string, forward bool) {
	if s.Origin == to {
		return from, false
	}
	return to, true
}

// FromStandby reports whether s is written by producers on the standby:
// records of an outage, consumed from their start when the fleet has no
// position for them (source.initial_offset applies to the primary's
// topics and their copies only).
func (n Naming) FromStandby(s Stream) bool { return n.standby != "" && s.Origin == n.standby }

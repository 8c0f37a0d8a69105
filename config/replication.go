package config

import (
	"cmp"
	"maps"
	"slices"
)

// Primary returns the cluster with role primary. On a validated Config there
// is exactly one; otherwise it returns the first by name, or "" and the zero
// Cluster when there is none.
func (c Config) Primary() (string, Cluster) {
	name, cl, _ := c.withRole(RolePrimary)
	return name, cl
}

// Standby returns the most preferred standby (Sources' second), and false
// when the configuration has none (a fleet without failover).
func (c Config) Standby() (string, Cluster, bool) {
	if s := c.Sources(); len(s) > 1 {
		return s[1], c.Clusters[s[1]], true
	}
	return "", Cluster{}, false
}

// Sources returns the source clusters in order of preference: the primary,
// then the standbys by priority (lower first; equal priorities, which
// Validate refuses among several standbys, by name).
func (c Config) Sources() []string {
	var standbys []string
	for _, name := range slices.Sorted(maps.Keys(c.Clusters)) {
		if c.Clusters[name].Role == RoleStandby {
			standbys = append(standbys, name)
		}
	}
	slices.SortStableFunc(standbys, func(a, b string) int { return cmp.Compare(c.Clusters[a].Priority, c.Clusters[b].Priority) })
	var out []string
	if p, _, ok := c.withRole(RolePrimary); ok {
		out = append(out, p)
	}
	return append(out, standbys...)
}

// IsSource reports whether cluster is consumed from (primary or standby).
func (c Config) IsSource(cluster string) bool {
	r := c.Clusters[cluster].Role
	return r == RolePrimary || r == RoleStandby
}

func (c Config) withRole(r Role) (string, Cluster, bool) {
	for _, name := range slices.Sorted(maps.Keys(c.Clusters)) {
		if cl := c.Clusters[name]; cl.Role == r {
			return name, cl, true
		}
	}
	return "", Cluster{}, false
}

// Flow is one MirrorMaker 2 flow in the file's replication list: the
// source cluster From copied into the source cluster To. Empty fields take
// MirrorMaker 2's defaults (Replication).
type Flow struct {
	From string `yaml:"from"`
	To   string `yaml:"to"`
	// Policy names the copies on To: prefix (MirrorMaker 2's default,
	// orders of alias A is A.orders) or identity (the same name; one way
	// only, and To's only flow in).
	Policy string `yaml:"policy"`
	// SourceAlias is MirrorMaker 2's alias of From. Default From.
	SourceAlias string `yaml:"source_alias"`
	// OffsetSyncsOn is where the flow's offset-syncs topic lives: source
	// (MirrorMaker 2's default) or target.
	OffsetSyncsOn    string `yaml:"offset_syncs_on"`
	OffsetSyncsTopic string `yaml:"offset_syncs_topic"`
	CheckpointsTopic string `yaml:"checkpoints_topic"`
}

// Replication describes one MirrorMaker 2 flow between two source
// clusters, with every default resolved.
type Replication struct {
	// From is the cluster the flow copies from; "" when there is none.
	From string
	// To is the cluster the flow copies into.
	To string
	// Policy is "prefix" or "identity".
	Policy string
	// SourceAlias is MirrorMaker 2's alias of From.
	SourceAlias string
	// OffsetSyncsTopic and OffsetSyncsCluster locate the offset-syncs.
	OffsetSyncsTopic   string
	OffsetSyncsCluster string
	// CheckpointsTopic is on the cluster the flow copies into.
	CheckpointsTopic string
}

// Flows returns MirrorMaker 2's flows between the source clusters, every
// default resolved, in the order of the file's replication list. Without
// one, the clusters' own fields describe the flows of a two-cluster fleet:
// into each standby from the primary (the standby's fields), and back from
// the most preferred standby into the primary (the primary's fields,
// under the standby's prefix policy only: identity copies both ways would
// loop).
func (c Config) Flows() []Replication {
	if len(c.Replication) > 0 {
		out := make([]Replication, 0, len(c.Replication))
		for _, f := range c.Replication {
			out = append(out, f.resolve())
		}
		return out
	}
	srcs := c.Sources()
	if len(srcs) < 2 {
		return nil
	}
	primary := srcs[0]
	var out []Replication
	for _, s := range srcs[1:] {
		out = append(out, c.Clusters[s].flowInto(primary, s, c.Clusters[s].ReplicationPolicy).resolve())
	}
	if policy := c.Clusters[srcs[1]].ReplicationPolicy; policy == "" || policy == "prefix" {
		out = append(out, c.Clusters[primary].flowInto(srcs[1], primary, "prefix").resolve())
	}
	return out
}

// Flow returns the flow from → to, and false when there is none.
func (c Config) Flow(from, to string) (Replication, bool) {
	for _, r := range c.Flows() {
		if r.From == from && r.To == to {
			return r, true
		}
	}
	return Replication{}, false
}

// flowInto is the flow from → to that cl's replication fields describe
// (cl is to's definition).
func (cl Cluster) flowInto(from, to, policy string) Flow {
	return Flow{From: from, To: to, Policy: policy, SourceAlias: cl.SourceAlias, OffsetSyncsOn: cl.OffsetSyncsOn,
		OffsetSyncsTopic: cl.OffsetSyncsTopic, CheckpointsTopic: cl.CheckpointsTopic}
}

// resolve fills f's defaults: the prefix policy, From's name as its
// alias, offset-syncs on the source, MirrorMaker 2's topic names.
func (f Flow) resolve() Replication {
	r := Replication{From: f.From, To: f.To, Policy: f.Policy, SourceAlias: f.SourceAlias,
		OffsetSyncsTopic: f.OffsetSyncsTopic, OffsetSyncsCluster: f.From, CheckpointsTopic: f.CheckpointsTopic}
	if r.Policy == "" {
		r.Policy = "prefix"
	}
	if r.SourceAlias == "" {
		r.SourceAlias = f.From
	}
	// MirrorMaker 2 names the topic after the cluster at the other end:
	// on the source it is mm2-offset-syncs.<target>.internal, with
	// offset-syncs.topic.location=target it is
	// mm2-offset-syncs.<source alias>.internal on the target.
	if f.OffsetSyncsOn == "target" {
		r.OffsetSyncsCluster = f.To
	}
	if r.OffsetSyncsTopic == "" {
		if f.OffsetSyncsOn == "target" {
			r.OffsetSyncsTopic = "mm2-offset-syncs." + r.SourceAlias + ".internal"
		} else {
			r.OffsetSyncsTopic = "mm2-offset-syncs." + f.To + ".internal"
		}
	}
	if r.CheckpointsTopic == "" {
		r.CheckpointsTopic = r.SourceAlias + ".checkpoints.internal"
	}
	return r
}

// RemoteTopic is the name on the flow's target of topic, a topic of r.From.
func (r Replication) RemoteTopic(topic string) string {
	if r.Policy == "identity" {
		return topic
	}
	return r.SourceAlias + "." + topic
}

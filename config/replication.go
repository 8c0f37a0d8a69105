package config

import (
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

// Standby returns the cluster with role standby, and false when the
// configuration has none (a fleet without failover).
func (c Config) Standby() (string, Cluster, bool) {
	return c.withRole(RoleStandby)
}

func (c Config) withRole(r Role) (string, Cluster, bool) {
	for _, name := range slices.Sorted(maps.Keys(c.Clusters)) {
		if cl := c.Clusters[name]; cl.Role == r {
			return name, cl, true
		}
	}
	return "", Cluster{}, false
}

// Replication describes one MirrorMaker 2 flow into a cluster, with every
// default resolved.
type Replication struct {
	// From is the cluster the flow copies from; "" when there is none
	// (the primary of a fleet without a standby, or under the identity
	// policy, which is one way).
	From string
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

// Replication returns the settings of the flow into cluster into from the
// other source cluster, defaults resolved: into the standby from the
// primary; into the primary from the standby (prefix policy only). The
// policy is the standby's (default prefix), the alias From's name,
// MirrorMaker 2's default topic names, offset-syncs on From.
func (c Config) Replication(into string) Replication {
	primary, _ := c.Primary()
	standby, sb, hasStandby := c.Standby()
	t := c.Clusters[into]
	r := Replication{
		Policy: sb.ReplicationPolicy, SourceAlias: t.SourceAlias,
		OffsetSyncsTopic: t.OffsetSyncsTopic, CheckpointsTopic: t.CheckpointsTopic,
		From: primary,
	}
	if r.Policy == "" {
		r.Policy = "prefix"
	}
	if into == primary {
		r.From = standby
		if !hasStandby || r.Policy != "prefix" {
			return Replication{Policy: r.Policy}
		}
	}
	r.OffsetSyncsCluster = r.From
	if r.SourceAlias == "" {
		r.SourceAlias = r.From
	}
	// MirrorMaker 2 names the topic after the cluster at the other end:
	// on the source it is mm2-offset-syncs.<target>.internal, with
	// offset-syncs.topic.location=target it is
	// mm2-offset-syncs.<source alias>.internal on the target.
	if t.OffsetSyncsOn == "target" {
		r.OffsetSyncsCluster = into
	}
	if r.OffsetSyncsTopic == "" {
		if t.OffsetSyncsOn == "target" {
			r.OffsetSyncsTopic = "mm2-offset-syncs." + r.SourceAlias + ".internal"
		} else {
			r.OffsetSyncsTopic = "mm2-offset-syncs." + into + ".internal"
		}
	}
	if r.CheckpointsTopic == "" {
		r.CheckpointsTopic = r.SourceAlias + ".checkpoints.internal"
	}
	return r
}

// RemoteTopic is the name on the flow's target of topic, a local topic of
// r.From.
func (r Replication) RemoteTopic(topic string) string {
	if r.Policy == "identity" {
		return topic
	}
	return r.SourceAlias + "." + topic
}

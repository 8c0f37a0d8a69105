package coordinator

import (
	"strings"

	"github.com/kswitch/kswitch/internal/config"
)

// Naming maps source topics between clusters. A topic's logical name is
// its name on the primary; on a standby filled by MirrorMaker 2 it has the
// name its replication policy gives it (A.orders with the default prefix
// policy, orders with the identity policy). Partition numbers are the same
// on every cluster.
type Naming struct {
	cfg     config.Config
	primary string
}

// NewNaming returns the naming of cfg's clusters.
func NewNaming(cfg config.Config) Naming {
	p, _ := cfg.Primary()
	return Naming{cfg: cfg, primary: p}
}

// TopicOn returns the name of logical topic on cluster.
func (n Naming) TopicOn(cluster, logical string) string {
	if cluster == n.primary {
		return logical
	}
	return n.cfg.Replication(cluster).RemoteTopic(logical)
}

// Logical returns the logical name of topic as found on cluster, and false
// when topic is not a replica of a primary topic there (another source's
// replica, or a local topic under the prefix policy).
func (n Naming) Logical(cluster, topic string) (string, bool) {
	if cluster == n.primary {
		return topic, true
	}
	r := n.cfg.Replication(cluster)
	if r.Policy == "identity" {
		return topic, true
	}
	return strings.CutPrefix(topic, r.SourceAlias+".")
}

// PartitionOn maps a logical partition to cluster.
func (n Naming) PartitionOn(cluster string, tp TopicPartition) TopicPartition {
	return TopicPartition{Topic: n.TopicOn(cluster, tp.Topic), Partition: tp.Partition}
}

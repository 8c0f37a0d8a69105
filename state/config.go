package state

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/keys"
)

// MaxConfigValueSize is the largest value accepted under config/ or at
// state/config; a larger one is refused unread.
const MaxConfigValueSize = 256 << 10

// ConfigSource is the part of the source section that may change at run time.
// The consumer group and the intervals stay the file's: changing them
// under a running fleet would orphan committed positions.
type ConfigSource struct {
	Topics        []string `yaml:"topics" json:"topics"`
	TopicRegex    string   `yaml:"topic_regex" json:"topic_regex"`
	InitialOffset string   `yaml:"initial_offset" json:"initial_offset"`
}

// ConfigOverrides is what the dynamic layer changes in the file's configuration.
type ConfigOverrides struct {
	// ConfigSource, when set, replaces the file's topics, topic_regex and
	// initial_offset.
	Source *ConfigSource `json:"source,omitempty"`
	// Clusters replace (or add to) the file's clusters of the same name,
	// each as a whole, except for the role and the replication fields,
	// which are the file's (a definition may leave them out).
	Clusters map[string]config.Cluster `json:"clusters,omitempty"`
}

// Apply returns file with o applied, validated as a whole.
//
// The primary is the file's, and so are the MirrorMaker 2 settings of the
// file's clusters (they decide how topics and offsets map between the
// clusters). The standby may change: a file's standby may become a sink
// and a sink (of the file, or added here) the standby, so that a new
// replica takes over the next failover. Whether the fleet can change its
// standby now (it must be consuming the primary) is the leader's check
// (coordinator.Leader.CheckConfig), not a property of the layer.
func (o ConfigOverrides) Apply(file config.Config) (config.Config, error) {
	var errs []error
	clusters := map[string]config.Cluster{}
	for _, name := range slices.Sorted(maps.Keys(o.Clusters)) {
		cl, path := o.Clusters[name], "clusters/"+name
		old, ok := file.Clusters[name]
		if ok {
			inherit(&cl, old)
		}
		clusters[name] = cl
		switch {
		case !ok && cl.Role == config.RolePrimary:
			errs = append(errs, fmt.Errorf("%s: role primary: the primary is the file's; a cluster added at run time is a standby or a sink", path))
		case ok && cl.Role != old.Role && (cl.Role == config.RolePrimary || old.Role == config.RolePrimary):
			errs = append(errs, fmt.Errorf("%s: role %q: the primary is the file's (%s is %s) and cannot change at run time", path, cl.Role, name, old.Role))
		case ok && (cl.ReplicationPolicy != old.ReplicationPolicy || cl.SourceAlias != old.SourceAlias ||
			cl.OffsetSyncsTopic != old.OffsetSyncsTopic || cl.OffsetSyncsOn != old.OffsetSyncsOn || cl.CheckpointsTopic != old.CheckpointsTopic):
			errs = append(errs, fmt.Errorf("%s: replication_policy, source_alias, offset_syncs_topic, offset_syncs_on and checkpoints_topic are the file's and cannot change at run time", path))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return config.Config{}, err
	}
	c := file.Clone()
	if o.Source != nil {
		c.Source.Topics = slices.Clone(o.Source.Topics)
		c.Source.TopicRegex = o.Source.TopicRegex
		c.Source.InitialOffset = o.Source.InitialOffset
	}
	if len(clusters) > 0 {
		if c.Clusters == nil {
			c.Clusters = map[string]config.Cluster{}
		}
		for name, cl := range clusters {
			cl.Brokers = slices.Clone(cl.Brokers)
			c.Clusters[name] = cl
		}
	}
	if err := c.Validate(); err != nil {
		return config.Config{}, err
	}
	return c, nil
}

// inherit fills the role and replication fields a dynamic definition of a
// file's cluster leaves empty with the file's: they cannot change at run
// time, so a definition need not repeat them.
func inherit(cl *config.Cluster, file config.Cluster) {
	for _, f := range []struct{ dyn, file *string }{
		{&cl.ReplicationPolicy, &file.ReplicationPolicy}, {&cl.SourceAlias, &file.SourceAlias},
		{&cl.OffsetSyncsTopic, &file.OffsetSyncsTopic}, {&cl.OffsetSyncsOn, &file.OffsetSyncsOn},
		{&cl.CheckpointsTopic, &file.CheckpointsTopic},
	} {
		if *f.dyn == "" {
			*f.dyn = *f.file
		}
	}
	if cl.Role == "" {
		cl.Role = file.Role
	}
}

// Equal reports whether o and p change the same things the same way.
func (o ConfigOverrides) Equal(p ConfigOverrides) bool {
	a, _ := json.Marshal(o)
	b, _ := json.Marshal(p)
	return bytes.Equal(a, b)
}

// ConfigVersion is a dynamic configuration the leader accepted: the value of
// state/config.
type ConfigVersion struct {
	// Number counts accepted versions; 0 is the file alone.
	Number int64 `json:"version"`
	// Revision is the etcd revision the layer was read at.
	Revision int64 `json:"revision"`
	// At is when the leader accepted it.
	At time.Time `json:"at"`
	// Leader is the agent that accepted it.
	Leader string `json:"leader"`
	// Changed lists what differs from the previous version: "source",
	// "clusters/<name>".
	Changed []string `json:"changed"`
	// ConfigOverrides is the layer in force.
	Overrides ConfigOverrides `json:"overrides"`
}

// ConfigRefusal is a desired layer the leader refused: the value of
// state/config-refused.
type ConfigRefusal struct {
	// Revision is the etcd revision the refused layer was read at.
	Revision int64 `json:"revision"`
	// At is when it was refused.
	At time.Time `json:"at"`
	// Reason lists the problems, one per line.
	Reason string `json:"reason"`
	// InForce is the number of the version that stays in force.
	InForce int64 `json:"in_force"`
}

// ParseConfigVersion decodes a state/config value.
func ParseConfigVersion(b []byte) (ConfigVersion, error) {
	if len(b) > MaxConfigValueSize {
		return ConfigVersion{}, fmt.Errorf("%d bytes, over the limit of %d", len(b), MaxConfigValueSize)
	}
	var v ConfigVersion
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(&v); err != nil {
		return ConfigVersion{}, fmt.Errorf("not a configuration version: %w", err)
	}
	if v.Number <= 0 {
		return ConfigVersion{}, fmt.Errorf("version number %d: must be positive", v.Number)
	}
	return v, nil
}

// ConfigState is what etcd says of the dynamic configuration: the version in
// force and the last refusal.
type ConfigState struct {
	// ConfigVersion is the version in force; its Number is 0 when there is none.
	Version ConfigVersion
	// ConfigRefusal is the last refused layer, nil when the last layer seen was
	// accepted.
	Refusal *ConfigRefusal
	// ModRevision is the mod revision of state/config (0: absent), for
	// writes that must not overtake a version they have not seen.
	ModRevision int64
}

// ErrMalformed marks a value in etcd that does not decode.
var ErrMalformed = errors.New("malformed value")

// ReadConfigState reads state/config and state/config-refused at one revision.
// A value that does not decode is left out of the ConfigState returned, with an
// error wrapping ErrMalformed.
func ReadConfigState(ctx context.Context, c *clientv3.Client, k keys.Fleet) (ConfigState, error) {
	resp, err := c.Txn(ctx).Then(clientv3.OpGet(k.StateConfig()), clientv3.OpGet(k.ConfigRefusal())).Commit()
	if err != nil {
		return ConfigState{}, fmt.Errorf("state: reading %s: %w", k.StateConfig(), err)
	}
	var s ConfigState
	var errs []error
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
		s.ModRevision = kvs[0].ModRevision
		if s.Version, err = ParseConfigVersion(kvs[0].Value); err != nil {
			errs = append(errs, fmt.Errorf("state: %s: %w: %w", k.StateConfig(), ErrMalformed, err))
		}
	}
	if kvs := resp.Responses[1].GetResponseRange().Kvs; len(kvs) > 0 {
		var r ConfigRefusal
		if err := json.Unmarshal(kvs[0].Value, &r); err != nil {
			errs = append(errs, fmt.Errorf("state: %s: %w: %w", k.ConfigRefusal(), ErrMalformed, err))
		} else {
			s.Refusal = &r
		}
	}
	return s, errors.Join(errs...)
}

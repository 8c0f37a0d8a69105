// Package dynconfig is the dynamic layer of the fleet's configuration: the
// source topics and cluster definitions that operators change in etcd
// while the fleet runs, over the static file every agent starts with.
//
// The layer has two halves. Operators write the desired values under
// config/ (config/source, config/clusters/<name>), with `kswitch config
// apply` or plain etcdctl. No agent acts on those keys directly: the
// leader's Gate reads them at one revision, validates the whole result
// (strict YAML, the merged configuration's own validation, brokers of a
// changed cluster answering a metadata request) and then publishes a
// numbered Version at state/config, fenced by its term, or records a
// Refusal at state/config-refused and keeps the version in force. Every
// agent follows state/config (Follow) and applies each version it sees,
// in order. A bad write therefore never reaches an agent, and all agents
// apply the same versions.
package dynconfig

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/keys"
)

// MaxValueSize is the largest value accepted under config/ or at
// state/config; a larger one is refused unread.
const MaxValueSize = 256 << 10

// Source is the part of the source section that may change at run time.
// The consumer group and the intervals stay the file's: changing them
// under a running fleet would orphan committed positions.
type Source struct {
	Topics        []string `yaml:"topics" json:"topics"`
	TopicRegex    string   `yaml:"topic_regex" json:"topic_regex"`
	InitialOffset string   `yaml:"initial_offset" json:"initial_offset"`
}

// Overrides is what the dynamic layer changes in the file's configuration.
type Overrides struct {
	// Source, when set, replaces the file's topics, topic_regex and
	// initial_offset.
	Source *Source `json:"source,omitempty"`
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
func (o Overrides) Apply(file config.Config) (config.Config, error) {
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
func (o Overrides) Equal(p Overrides) bool {
	a, _ := json.Marshal(o)
	b, _ := json.Marshal(p)
	return bytes.Equal(a, b)
}

// Layer is the desired dynamic layer, the keys under config/, as read at
// one revision.
type Layer struct {
	// Source is the value of config/source, nil when absent.
	Source []byte
	// Clusters are the values of config/clusters/<name> by name.
	Clusters map[string][]byte
	// Revision is the etcd revision the layer was read at.
	Revision int64
	// Unknown are keys under config/ that are neither; Decode refuses
	// them, so that a typo (config/cluster/B) never looks accepted.
	Unknown []string
}

// Read reads the desired layer at one revision.
func Read(ctx context.Context, c *clientv3.Client, k keys.Fleet) (Layer, error) {
	resp, err := c.Get(ctx, k.Config(), clientv3.WithPrefix())
	if err != nil {
		return Layer{}, fmt.Errorf("dynconfig: reading %s: %w", k.Config(), err)
	}
	l := Layer{Clusters: map[string][]byte{}, Revision: resp.Header.Revision}
	for _, kv := range resp.Kvs {
		key := string(kv.Key)
		val := kv.Value
		if val == nil {
			val = []byte{} // present and empty: refused, not absent
		}
		switch name, isCluster := strings.CutPrefix(key, k.ConfigClusters()); {
		case key == k.ConfigSource():
			l.Source = val
		case isCluster:
			l.Clusters[name] = val
		default:
			l.Unknown = append(l.Unknown, key)
		}
	}
	return l, nil
}

// Decode turns the layer into overrides of file, strictly: every key must
// hold one valid YAML document of its kind. Values are decoded over the
// file's values, so config/source may name only the fields it changes.
// Errors name the key.
func (l Layer) Decode(k keys.Fleet, file config.Config) (Overrides, error) {
	var o Overrides
	var errs []error
	if len(l.Unknown) > 0 {
		errs = append(errs, fmt.Errorf("unknown keys under %s: %s (known: source, clusters/<name>)",
			k.Config(), strings.Join(l.Unknown, ", ")))
	}
	if l.Source != nil {
		key := k.ConfigSource()
		s := Source{Topics: slices.Clone(file.Source.Topics), TopicRegex: file.Source.TopicRegex, InitialOffset: file.Source.InitialOffset}
		switch {
		case len(l.Source) > MaxValueSize:
			errs = append(errs, fmt.Errorf("%s: %d bytes, over the limit of %d", key, len(l.Source), MaxValueSize))
		case len(bytes.TrimSpace(l.Source)) == 0:
			errs = append(errs, fmt.Errorf("%s: empty; delete the key to use the file's source", key))
		default:
			if err := config.DecodeOver(l.Source, key, &s); err != nil {
				errs = append(errs, err)
			} else {
				o.Source = &s
			}
		}
	}
	for _, name := range slices.Sorted(maps.Keys(l.Clusters)) {
		key, val := k.ConfigCluster(name), l.Clusters[name]
		if err := keys.ValidName(name); err != nil {
			errs = append(errs, fmt.Errorf("%s: cluster name %v", key, err))
			continue
		}
		switch {
		case len(val) > MaxValueSize:
			errs = append(errs, fmt.Errorf("%s: %d bytes, over the limit of %d", key, len(val), MaxValueSize))
			continue
		case len(bytes.TrimSpace(val)) == 0:
			errs = append(errs, fmt.Errorf("%s: empty; delete the key to use the file's definition", key))
			continue
		}
		cl, err := config.ParseCluster(val, key)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if o.Clusters == nil {
			o.Clusters = map[string]config.Cluster{}
		}
		o.Clusters[name] = cl
	}
	if err := errors.Join(errs...); err != nil {
		return Overrides{}, err
	}
	return o, nil
}

// Version is a dynamic configuration the leader accepted: the value of
// state/config.
type Version struct {
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
	// Overrides is the layer in force.
	Overrides Overrides `json:"overrides"`
}

// Refusal is a desired layer the leader refused: the value of
// state/config-refused.
type Refusal struct {
	// Revision is the etcd revision the refused layer was read at.
	Revision int64 `json:"revision"`
	// At is when it was refused.
	At time.Time `json:"at"`
	// Reason lists the problems, one per line.
	Reason string `json:"reason"`
	// InForce is the number of the version that stays in force.
	InForce int64 `json:"in_force"`
}

// ParseVersion decodes a state/config value.
func ParseVersion(b []byte) (Version, error) {
	if len(b) > MaxValueSize {
		return Version{}, fmt.Errorf("%d bytes, over the limit of %d", len(b), MaxValueSize)
	}
	var v Version
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(&v); err != nil {
		return Version{}, fmt.Errorf("not a configuration version: %w", err)
	}
	if v.Number <= 0 {
		return Version{}, fmt.Errorf("version number %d: must be positive", v.Number)
	}
	return v, nil
}

// State is what etcd says of the dynamic configuration: the version in
// force and the last refusal.
type State struct {
	// Version is the version in force; its Number is 0 when there is none.
	Version Version
	// Refusal is the last refused layer, nil when the last layer seen was
	// accepted.
	Refusal *Refusal
	// ModRevision is the mod revision of state/config (0: absent), for
	// writes that must not overtake a version they have not seen.
	ModRevision int64
}

// ErrMalformed marks a value in etcd that does not decode.
var ErrMalformed = errors.New("malformed value")

// ReadState reads state/config and state/config-refused at one revision.
// A value that does not decode is left out of the State returned, with an
// error wrapping ErrMalformed.
func ReadState(ctx context.Context, c *clientv3.Client, k keys.Fleet) (State, error) {
	resp, err := c.Txn(ctx).Then(clientv3.OpGet(k.StateConfig()), clientv3.OpGet(k.ConfigRefusal())).Commit()
	if err != nil {
		return State{}, fmt.Errorf("dynconfig: reading %s: %w", k.StateConfig(), err)
	}
	var s State
	var errs []error
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
		s.ModRevision = kvs[0].ModRevision
		if s.Version, err = ParseVersion(kvs[0].Value); err != nil {
			errs = append(errs, fmt.Errorf("dynconfig: %s: %w: %w", k.StateConfig(), ErrMalformed, err))
		}
	}
	if kvs := resp.Responses[1].GetResponseRange().Kvs; len(kvs) > 0 {
		var r Refusal
		if err := json.Unmarshal(kvs[0].Value, &r); err != nil {
			errs = append(errs, fmt.Errorf("dynconfig: %s: %w: %w", k.ConfigRefusal(), ErrMalformed, err))
		} else {
			s.Refusal = &r
		}
	}
	return s, errors.Join(errs...)
}

// changed lists what differs between two overrides, as Version.Changed.
func changed(old, new Overrides) []string {
	var out []string
	a, _ := json.Marshal(old.Source)
	b, _ := json.Marshal(new.Source)
	if !bytes.Equal(a, b) {
		out = append(out, "source")
	}
	names := map[string]bool{}
	for n := range old.Clusters {
		names[n] = true
	}
	for n := range new.Clusters {
		names[n] = true
	}
	for _, n := range slices.Sorted(maps.Keys(names)) {
		a, _ := json.Marshal(clusterOrNil(old.Clusters, n))
		b, _ := json.Marshal(clusterOrNil(new.Clusters, n))
		if !bytes.Equal(a, b) {
			out = append(out, "clusters/"+n)
		}
	}
	return out
}

func clusterOrNil(m map[string]config.Cluster, n string) *config.Cluster {
	if c, ok := m[n]; ok {
		return &c
	}
	return nil
}

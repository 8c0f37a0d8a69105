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

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

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
func (l Layer) Decode(k keys.Fleet, file config.Config) (state.ConfigOverrides, error) {
	var o state.ConfigOverrides
	var errs []error
	if len(l.Unknown) > 0 {
		errs = append(errs, fmt.Errorf("unknown keys under %s: %s (known: source, clusters/<name>)",
			k.Config(), strings.Join(l.Unknown, ", ")))
	}
	if l.Source != nil {
		key := k.ConfigSource()
		s := state.ConfigSource{Topics: slices.Clone(file.Source.Topics), TopicRegex: file.Source.TopicRegex, InitialOffset: file.Source.InitialOffset}
		switch {
		case len(l.Source) > state.MaxConfigValueSize:
			errs = append(errs, fmt.Errorf("%s: %d bytes, over the limit of %d", key, len(l.Source), state.MaxConfigValueSize))
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
		case len(val) > state.MaxConfigValueSize:
			errs = append(errs, fmt.Errorf("%s: %d bytes, over the limit of %d", key, len(val), state.MaxConfigValueSize))
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
		return state.ConfigOverrides{}, err
	}
	return o, nil
}

// changed lists what differs between two overrides, as Version.Changed.
func changed(old, new state.ConfigOverrides) []string {
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

package fleet

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/routing"
)

// RoutingLayer is what etcd holds of a fleet's routing (its dynamic
// layer, over each agent's file): the routes value and the channels, each
// with the revision it was written at.
type RoutingLayer struct {
	// Revision is the etcd revision of the read.
	Revision int64
	// Routes is the routes value (mode, rules, default, dead_letter);
	// nil when absent.
	Routes   []byte
	RoutesAt int64
	// Channels are the channels/<name> values, by name.
	Channels   map[string][]byte
	ChannelsAt map[string]int64
}

// Version is the number of the version the layer makes: the revision of
// its newest key (what the agents report as the routes version in
// force).
func (l RoutingLayer) Version() int64 {
	v := l.RoutesAt
	for _, at := range l.ChannelsAt {
		v = max(v, at)
	}
	return v
}

// RoutingChange is what ApplyRoutes writes: the routes value (nil: left
// as it is) and channels, each written whole; the channels it does not
// name are kept.
type RoutingChange struct {
	Routes   []byte
	Channels map[string][]byte
}

// ErrRoutingChanged is ApplyRoutes' error when a key it was to write
// changed after it was read: nothing was written; apply again.
var ErrRoutingChanged = errors.New("the routes or channels in etcd changed while applying; nothing written: apply again")

// Routing reads the fleet's routing layer from etcd, at one revision.
func (o *Operator) Routing(ctx context.Context) (RoutingLayer, error) {
	k := o.keys
	resp, err := o.etcd.Txn(ctx).Then(clientv3.OpGet(k.Routes()), clientv3.OpGet(k.Channels(), clientv3.WithPrefix())).Commit()
	if err != nil {
		return RoutingLayer{}, fmt.Errorf("fleet %s: read %s and %s: %w", o.name, k.Routes(), k.Channels(), err)
	}
	l := RoutingLayer{Revision: resp.Header.Revision, Channels: map[string][]byte{}, ChannelsAt: map[string]int64{}}
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
		l.Routes, l.RoutesAt = kvs[0].Value, kvs[0].ModRevision
		if l.Routes == nil {
			l.Routes = []byte{}
		}
	}
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		name := strings.TrimPrefix(string(kv.Key), k.Channels())
		l.Channels[name], l.ChannelsAt[name] = kv.Value, kv.ModRevision
	}
	return l, nil
}

// CompileRouting compiles routes and channels (a fleet's routing layer in
// etcd, or a change laid over it) over cfg's routing section as every
// agent of the fleet named fleet does; it needs no etcd. The channels'
// clusters are checked against cfg.Clusters; without any (checked false)
// each cluster a channel names is taken as one at the default Kafka
// version, and only the rest is checked. Errors name the etcd keys of
// fleet.
func CompileRouting(cfg config.Config, fleet string, routes []byte, channels map[string][]byte) (v *routing.Version, checked bool, err error) {
	if err := keys.ValidName(fleet); err != nil {
		return nil, true, fmt.Errorf("fleet: name %q: %w", fleet, err)
	}
	spec, _, err := routing.Merge(cfg.Routing, keys.New(fleet), routes, channels)
	if err != nil {
		return nil, true, err
	}
	clusters, checked := cfg.Clusters, len(cfg.Clusters) > 0
	if !checked {
		clusters = map[string]config.Cluster{}
		for _, ch := range spec.Channels {
			if ch.Cluster != "" {
				clusters[ch.Cluster] = config.Cluster{Version: config.DefaultKafkaVersion}
			}
		}
	}
	v, err = routing.Compile(spec, clusters)
	return v, checked, err
}

// CheckRoutes lays change over the routing layer etcd holds and compiles
// the result as every agent will (CompileRouting, against cfg.Clusters,
// which must name the agents' clusters). It returns the version the
// change would put in force, and the layer it was checked against.
func (o *Operator) CheckRoutes(ctx context.Context, cfg config.Config, change RoutingChange) (*routing.Version, RoutingLayer, error) {
	if len(cfg.Clusters) == 0 {
		return nil, RoutingLayer{}, fmt.Errorf("fleet %s: routes are checked against the agents' clusters: the configuration names none", o.name)
	}
	l, err := o.Routing(ctx)
	if err != nil {
		return nil, RoutingLayer{}, err
	}
	routes := l.Routes
	if change.Routes != nil {
		routes = change.Routes
	}
	chans := maps.Clone(l.Channels)
	maps.Copy(chans, change.Channels)
	v, _, err := CompileRouting(cfg, o.name, routes, chans)
	if err != nil {
		return nil, l, err
	}
	return v, l, nil
}

// ApplyRoutes checks change (CheckRoutes) and, if the version it makes is
// valid, writes it in one transaction that writes nothing if a key it
// writes changed since the check read it (ErrRoutingChanged). It returns
// the version written, its number (the transaction's revision) and the
// keys written. Every agent follows these keys and puts the version in
// force between two records; one whose configuration differs and finds it
// invalid keeps its version and says so in its /status.
func (o *Operator) ApplyRoutes(ctx context.Context, cfg config.Config, change RoutingChange) (v *routing.Version, revision int64, wrote []string, err error) {
	if change.Routes == nil && len(change.Channels) == 0 {
		return nil, 0, nil, fmt.Errorf("fleet %s: the change names no routes and no channel: nothing to write", o.name)
	}
	v, l, err := o.CheckRoutes(ctx, cfg, change)
	if err != nil {
		return nil, 0, nil, err
	}
	k := o.keys
	var cmps []clientv3.Cmp
	var ops []clientv3.Op
	if change.Routes != nil {
		cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(k.Routes()), "=", l.RoutesAt))
		ops = append(ops, clientv3.OpPut(k.Routes(), string(change.Routes)))
		wrote = append(wrote, k.Routes())
	}
	for _, name := range slices.Sorted(maps.Keys(change.Channels)) {
		cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(k.Channel(name)), "=", l.ChannelsAt[name]))
		ops = append(ops, clientv3.OpPut(k.Channel(name), string(change.Channels[name])))
		wrote = append(wrote, k.Channel(name))
	}
	resp, err := o.etcd.Txn(ctx).If(cmps...).Then(ops...).Commit()
	if err != nil {
		return nil, 0, nil, fmt.Errorf("fleet %s: write %s: %w", o.name, strings.Join(wrote, ", "), err)
	}
	if !resp.Succeeded {
		return nil, 0, nil, ErrRoutingChanged
	}
	return v, resp.Header.Revision, wrote, nil
}

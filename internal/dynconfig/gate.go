package dynconfig

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/etcdwatch"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// DefaultReachTimeout bounds the check that a changed cluster's brokers
// answer.
const DefaultReachTimeout = 5 * time.Second

// Gate is the leader's half of the dynamic layer: it follows config/,
// validates each desired layer in full and publishes the versions it
// accepts at state/config, or the reason it refused one at
// state/config-refused. Its writes are fenced by the leader's term.
type Gate struct {
	// File is the leader's validated file configuration, the base of every
	// version.
	File config.Config
	// Etcd is the fleet's etcd client.
	Etcd *clientv3.Client
	// Log receives accepted and refused versions.
	Log *zap.Logger
	// Reach checks that a cluster whose definition a version changes
	// answers a metadata request. Default: a client from internal/kafka
	// with ReachTimeout.
	Reach func(ctx context.Context, name string, c config.Cluster) error
	// ReachTimeout bounds Reach. Default DefaultReachTimeout.
	ReachTimeout time.Duration
	// OnRefused, when set, is called with each refusal (for metrics).
	OnRefused func(state.ConfigRefusal)
	// Check, when set, is asked about each merged configuration that
	// validates, with the one in force: the leader refuses what the fleet
	// cannot take now (a new standby while it does not consume the
	// primary).
	Check func(next, current config.Config) error
	// Live returns the ids of the live agents, whose acknowledgements an
	// accepted version waits for before its history event is written.
	// Without it the event is written when the leader's own agent (term.ID)
	// has acknowledged.
	Live func() []string
	// AckTimeout bounds the wait for acknowledgements; the event then
	// names the agents that did not acknowledge. Default 60s.
	AckTimeout time.Duration
}

// Run follows config/ for the length of term and returns ctx.Err() when
// ctx ends, or an error wrapping election.ErrNotLeader once the term is
// over.
func (g *Gate) Run(ctx context.Context, term election.Term) error {
	k := keys.New(g.File.Fleet)
	timeout := g.File.Etcd.RequestTimeout
	changes := make(chan struct{}, 1)
	notify := func() {
		select {
		case changes <- struct{}{}:
		default:
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = etcdwatch.Follow(ctx, g.Etcd, etcdwatch.Target{Key: k.Config(), Prefix: true, Timeout: timeout}, notifier(notify))
	}()
	defer func() { <-done }()

	accepted := make(chan state.ConfigVersion, 16)
	recorderDone := make(chan struct{})
	go func() {
		defer close(recorderDone)
		g.record(ctx, k, term, accepted)
	}()
	defer func() { <-recorderDone }()

	var tried [32]byte // the last layer refused, not to be probed again
	retry := time.NewTimer(time.Hour)
	retry.Stop()
	defer retry.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-changes:
		case <-retry.C:
		}
		v, err := g.check(ctx, k, term, &tried)
		if v.Number > 0 {
			select {
			case accepted <- v:
			default:
				g.Log.Warn("too many configuration versions in a row: no history event for this one", zap.Int64("version", v.Number))
			}
		}
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case errors.Is(err, election.ErrNotLeader):
			return err
		case err != nil:
			g.Log.Warn("dynamic configuration not checked; trying again in 1s", zap.Error(err))
			retry.Reset(time.Second)
		}
	}
}

// notifier is an etcdwatch.Follower that only says something changed:
// the gate reads the whole layer at one revision each time, so a change
// and the keys it needs, written in one transaction, are seen together.
type notifier func()

func (n notifier) Reset([]*mvccpb.KeyValue, int64) { n() }
func (n notifier) Apply([]*clientv3.Event)         { n() }

// check reads the desired layer and the version in force, and publishes a
// new version or a refusal when they differ. It returns the version it
// published, if any, and an error only when etcd could not be read or
// written.
func (g *Gate) check(ctx context.Context, k keys.Fleet, term election.Term, tried *[32]byte) (state.ConfigVersion, error) {
	timeout := g.File.Etcd.RequestTimeout
	rctx, cancel := context.WithTimeout(ctx, timeout)
	cur, err := state.ReadConfigState(rctx, g.Etcd, k)
	if errors.Is(err, state.ErrMalformed) {
		// Not written by a leader; the next accepted version replaces it.
		g.Log.Warn("a configuration state value in etcd is unreadable; the next write replaces it", zap.Error(err))
		err = nil
	}
	var layer Layer
	if err == nil {
		layer, err = Read(rctx, g.Etcd, k)
	}
	cancel()
	if err != nil {
		return state.ConfigVersion{}, err
	}
	sum := fingerprint(layer)
	if sum == *tried && cur.Refusal != nil {
		return state.ConfigVersion{}, nil // refused already; nothing new
	}
	overrides, problem := g.validate(ctx, k, layer, cur.Version)
	if problem == nil && overrides.Equal(cur.Version.Overrides) {
		if cur.Refusal == nil {
			return state.ConfigVersion{}, nil
		}
		// The layer is back to the version in force: the refusal is history.
		return state.ConfigVersion{}, g.write(ctx, term, nil, clientv3.OpDelete(k.ConfigRefusal()))
	}
	if problem != nil {
		*tried = sum
		r := state.ConfigRefusal{Revision: layer.Revision, At: time.Now().UTC(), Reason: problem.Error(), InForce: cur.Version.Number}
		g.Log.Warn("dynamic configuration refused; the version in force stays",
			zap.Int64("revision", r.Revision), zap.Int64("version_in_force", r.InForce), zap.String("reason", r.Reason))
		if g.OnRefused != nil {
			g.OnRefused(r)
		}
		val, _ := json.Marshal(r)
		return state.ConfigVersion{}, g.write(ctx, term, nil, clientv3.OpPut(k.ConfigRefusal(), string(val)))
	}
	*tried = [32]byte{}
	v := state.ConfigVersion{Number: cur.Version.Number + 1, Revision: layer.Revision, At: time.Now().UTC(), Leader: term.ID,
		Changed: changed(cur.Version.Overrides, overrides), Overrides: overrides}
	val, err := json.Marshal(v)
	if err != nil {
		return state.ConfigVersion{}, err
	}
	// Compared with the version read, so a version is never published over
	// one this check has not seen.
	cmp := clientv3.Compare(clientv3.ModRevision(k.StateConfig()), "=", cur.ModRevision)
	if err := g.write(ctx, term, []clientv3.Cmp{cmp},
		clientv3.OpPut(k.StateConfig(), string(val)), clientv3.OpDelete(k.ConfigRefusal())); err != nil {
		return state.ConfigVersion{}, err
	}
	g.Log.Info("dynamic configuration accepted", zap.Int64("version", v.Number),
		zap.Int64("revision", v.Revision), zap.Strings("changed", v.Changed))
	return v, nil
}

// validate decodes layer over the file, validates the merged configuration
// and checks that every cluster whose definition changes from the version
// in force answers. The problems are joined, one per line.
func (g *Gate) validate(ctx context.Context, k keys.Fleet, layer Layer, inForce state.ConfigVersion) (state.ConfigOverrides, error) {
	o, err := layer.Decode(k, g.File)
	if err != nil {
		return state.ConfigOverrides{}, err
	}
	merged, err := o.Apply(g.File)
	if err != nil {
		return state.ConfigOverrides{}, err
	}
	current, err := inForce.Overrides.Apply(g.File)
	if err != nil {
		current = g.File // the version in force is not valid here: check everything new
	}
	if g.Check != nil {
		if err := g.Check(merged, current); err != nil {
			return state.ConfigOverrides{}, err
		}
	}
	var errs []error
	for _, name := range slices.Sorted(maps.Keys(merged.Clusters)) {
		cl := merged.Clusters[name]
		if old, ok := current.Clusters[name]; ok && reflect.DeepEqual(old, cl) {
			continue
		}
		if err := g.reach(ctx, name, cl); err != nil {
			errs = append(errs, fmt.Errorf("%s: brokers %s did not answer within %s: %v",
				k.ConfigCluster(name), strings.Join(cl.Brokers, ","), g.reachTimeout(), err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return state.ConfigOverrides{}, err
	}
	return o, nil
}

func (g *Gate) reachTimeout() time.Duration {
	if g.ReachTimeout > 0 {
		return g.ReachTimeout
	}
	return DefaultReachTimeout
}

func (g *Gate) reach(ctx context.Context, name string, cl config.Cluster) error {
	if g.Reach != nil {
		ctx, cancel := context.WithTimeout(ctx, g.reachTimeout())
		defer cancel()
		return g.Reach(ctx, name, cl)
	}
	return Reach(ctx, name, cl, g.reachTimeout())
}

// Reach checks that cluster name's brokers answer a metadata request
// within timeout. The request runs on the caller's goroutine: with a
// timeout, internal/kafka bounds dialing, reads, writes and the metadata
// request and turns its retries off, so it returns within about timeout;
// ctx only stops it from starting.
func Reach(ctx context.Context, name string, cl config.Cluster, timeout time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c, err := kafka.NewClientWith(name, cl, kafka.Options{Timeout: timeout})
	if err != nil {
		return err
	}
	return c.Close()
}

// write commits ops fenced by term and cmps.
func (g *Gate) write(ctx context.Context, term election.Term, cmps []clientv3.Cmp, ops ...clientv3.Op) error {
	wctx, cancel := context.WithTimeout(ctx, g.File.Etcd.RequestTimeout)
	defer cancel()
	_, err := term.Txn(wctx, cmps, ops...)
	if errors.Is(err, election.ErrConditionFailed) {
		return fmt.Errorf("dynconfig: %s changed while the layer was checked: %w", keys.New(g.File.Fleet).StateConfig(), err)
	}
	return err
}

// fingerprint identifies a layer's content (not its revision); an absent
// config/source differs from an empty one.
func fingerprint(l Layer) [32]byte {
	h := sha256.New()
	fmt.Fprintf(h, "%t%q|", l.Source != nil, l.Source)
	for _, n := range slices.Sorted(maps.Keys(l.Clusters)) {
		fmt.Fprintf(h, "%q=%q|", n, l.Clusters[n])
	}
	for _, u := range l.Unknown {
		fmt.Fprintf(h, "%q|", u)
	}
	var out [32]byte
	copy(out[:], h.Sum(nil))
	return out
}

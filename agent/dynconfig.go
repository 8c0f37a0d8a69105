package agent

import (
	"context"
	"maps"
	"reflect"
	"slices"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/coordinator"
	"github.com/kswitch/kswitch/internal/dynconfig"
	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/state"
)

// ConfigStatus is the dynamic configuration part of /status.
type ConfigStatus struct {
	// Version is the number of the version in force; 0 is the file alone.
	Version int64 `json:"version"`
	// Accepted is when the leader accepted it.
	Accepted time.Time `json:"accepted,omitzero"`
	// Changed is what it changed from the version before.
	Changed []string `json:"changed,omitempty"`
	// Refused is why this agent refused the newest version it saw, when
	// it did; the version in force stays.
	Refused string `json:"refused,omitempty"`
	// LastRefusal is the leader's refusal of the dynamic layer now in
	// etcd, when it refused it (state/config-refused).
	LastRefusal *state.ConfigRefusal `json:"last_refusal,omitempty"`
}

// configUpdate is a dynamic configuration version handed to the worker.
type configUpdate struct {
	version int64
	cfg     config.Config
}

// dynConfig is the agent's dynamic configuration: what dynconfig.Follow
// hands it, and whom it hands it on to.
type dynConfig struct {
	mu           sync.Mutex
	version      state.ConfigVersion
	cfg          config.Config // the file with version applied
	refused      string
	fleetRefusal *state.ConfigRefusal
	// worker receives the versions while a worker runs (nil between
	// sessions; a new worker starts from cfg).
	worker chan configUpdate
}

func (d *dynConfig) status() ConfigStatus {
	d.mu.Lock()
	defer d.mu.Unlock()
	return ConfigStatus{Version: d.version.Number, Accepted: d.version.At, Changed: d.version.Changed, Refused: d.refused,
		LastRefusal: d.fleetRefusal}
}

// current returns the configuration in force (the file with the dynamic
// version applied).
func (d *dynConfig) current() config.Config {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.cfg
}

// attach registers a worker's channel and returns the version and
// configuration it starts from; detach unregisters it.
func (d *dynConfig) attach(ch chan configUpdate) (int64, config.Config) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.worker = ch
	return d.version.Number, d.cfg
}

func (d *dynConfig) detach(ch chan configUpdate) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.worker == ch {
		d.worker = nil
	}
}

// configApplier is the agent's dynconfig.Applier.
type configApplier struct{ a *Agent }

func (c configApplier) Apply(v state.ConfigVersion, cfg config.Config) {
	a, d := c.a, &c.a.dyn
	d.mu.Lock()
	same := d.version.Number == v.Number && reflect.DeepEqual(d.cfg, cfg)
	d.version, d.cfg, d.refused = v, cfg, ""
	w := d.worker
	d.mu.Unlock()
	a.metrics.configVersion.Set(float64(v.Number))
	if same {
		return
	}
	if v.Number > 0 {
		a.log.Info("dynamic configuration version in force", zap.Int64("version", v.Number), zap.Strings("changed", v.Changed))
	}
	a.prober.setClusters(cfg.Clusters)
	if err := a.leader.SetConfig(cfg); err != nil { // validated by dynconfig; not expected
		a.log.Error("leader refused a validated configuration", zap.Error(err))
	}
	if a.opts.OnConfig != nil {
		a.opts.OnConfig(cfg)
	}
	if w != nil {
		offerLatest(w, configUpdate{version: v.Number, cfg: cfg})
	}
}

// offerLatest puts v in ch, a channel of capacity 1 read by one
// goroutine, replacing a value not yet taken: the reader gets the latest.
// It never blocks.
func offerLatest[T any](ch chan T, v T) {
	for {
		select {
		case ch <- v:
			return
		default:
		}
		select {
		case <-ch: // replace what the reader has not taken yet
		default:
		}
	}
}

func (c configApplier) Refuse(v state.ConfigVersion, err error) {
	c.a.dyn.mu.Lock()
	c.a.dyn.refused = err.Error()
	c.a.dyn.mu.Unlock()
	c.a.metrics.badValues.WithLabelValues(refused.Config).Inc()
}

// followConfig follows the versions the leader accepts, and its last
// refusal, until ctx ends.
func (a *Agent) followConfig(ctx context.Context) {
	var wg sync.WaitGroup
	wg.Go(func() {
		_ = dynconfig.FollowRefusal(ctx, a.client, a.keys, a.cfg.Etcd.RequestTimeout, func(r *state.ConfigRefusal) {
			a.dyn.mu.Lock()
			a.dyn.fleetRefusal = r
			a.dyn.mu.Unlock()
		})
	})
	_ = dynconfig.Follow(ctx, a.client, a.cfg, a.cfg.Etcd.RequestTimeout, a.log, configApplier{a})
	wg.Wait()
}

// reconfigure applies a dynamic configuration version. When the
// definition of the cluster being consumed changed (brokers moved, new
// credentials), every partition is drained and committed, the connection
// is reopened with the new definition and the partitions restart at
// their committed offsets: nothing is lost, and nothing is consumed twice
// but what the handler had not acknowledged within the drain timeout.
// Partitions of an unchanged cluster keep flowing untouched. A warm
// connection to a changed cluster is dropped. The version is then
// acknowledged.
func (w *worker) reconfigure(ctx context.Context, u configUpdate) {
	old := w.clusters
	w.clusters, w.initial, w.configVersion = u.cfg.Clusters, u.cfg.Source.InitialOffset, u.version
	w.naming = coordinator.NewNaming(u.cfg) // a new standby names its replicas its own way
	if w.warm != nil && !reflect.DeepEqual(old[w.warm.name], w.clusters[w.warm.name]) {
		w.dropWarm()
	}
	for _, name := range slices.Sorted(maps.Keys(w.conns)) {
		if reflect.DeepEqual(old[name], w.clusters[name]) {
			continue
		}
		var cps []cpart
		for cp := range w.parts {
			if cp.Cluster == name {
				cps = append(cps, cp)
			}
		}
		slices.SortFunc(cps, cpart.Compare)
		w.log.Info("the definition of a cluster being consumed changed: draining, committing and reconnecting",
			zap.String("cluster", name), zap.Strings("brokers", w.clusters[name].Brokers),
			zap.Int64("config_version", u.version), zap.Int("partitions", len(cps)))
		if len(cps) > 0 {
			w.release(ctx, cps, w.applied)
		}
		w.conns[name].close()
		delete(w.conns, name)
		for _, cp := range cps {
			if !slices.Contains(w.pending, cp) {
				w.pending = append(w.pending, cp)
			}
		}
	}
	slices.SortFunc(w.pending, cpart.Compare)
	w.startPending(ctx)
	w.publishOwned()
	w.ackConfig(ctx)
}

// ackConfig acknowledges the dynamic configuration version applied, on
// the session's lease, for the leader's history event.
func (w *worker) ackConfig(ctx context.Context) {
	actx, cancel := context.WithTimeout(ctx, w.cfg.Etcd.RequestTimeout)
	defer cancel()
	if _, err := w.etcd.Put(actx, w.keys.ConfigAck(w.id), dynconfig.AckValue(w.configVersion), clientv3.WithLease(w.lease)); err != nil {
		w.log.Warn("cannot acknowledge the configuration version", zap.Int64("config_version", w.configVersion), zap.Error(err))
	}
}

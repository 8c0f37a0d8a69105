package coordinator

import (
	"context"
	"encoding/json"
	"reflect"
	"slices"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/state"
)

// The leader's view of every source cluster (state/clusters): its place
// in the order of preference and its health, from the agents' views each
// turn, and how far it is behind the active cluster, from a check beside
// the loop (behindChecker). kswitch status, the status page and the
// metrics show it.

// behindEvery is how often the leader checks how far each reachable
// source cluster is behind the active one: every failback_stable (30 s by
// default), the scale on which a cluster's state changes the fleet's
// decisions, and at most every 10 s. Each check opens a client of the
// cluster and translates every partition's position, as the failback
// gate does every 2 s while it waits; every 2 s in every fleet of the
// agent tests (six at once), it slowed them enough to fail a bound.
func behindEvery(stable time.Duration) time.Duration { return max(stable, 10*time.Second) }

// clustersEvery bounds how often state/clusters is written.
const clustersEvery = time.Second

// behindCheck is one cluster's last check.
type behindCheck struct {
	epoch   int64 // of the active cluster checked against
	behind  int
	lacking int64
	checked time.Time
}

// behindChecker checks, every behindEvery, how far each cluster the loop
// names is behind the active cluster. It owns one goroutine (run), on the
// term's WaitGroup, ended with the term; the loop hands it the clusters
// to check (set) and reads its results (get).
type behindChecker struct {
	l   *Leader
	log *zap.Logger

	mu       sync.Mutex
	active   state.Active
	clusters []string
	results  map[string]behindCheck
}

func newBehindChecker(l *Leader, log *zap.Logger) *behindChecker {
	return &behindChecker{l: l, log: log, results: map[string]behindCheck{}}
}

// set names the active state and the clusters to check against it.
func (b *behindChecker) set(active state.Active, clusters []string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.active, b.clusters = active, clusters
}

// get returns cluster's last check against the active epoch, false when
// there is none.
func (b *behindChecker) get(cluster string, epoch int64) (behindCheck, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	c, ok := b.results[cluster]
	return c, ok && c.epoch == epoch
}

// run checks until ctx ends.
func (b *behindChecker) run(ctx context.Context) {
	tick := time.NewTicker(behindEvery(b.l.cfg.Failover.FailbackStable))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		b.mu.Lock()
		active, clusters := b.active, slices.Clone(b.clusters)
		b.mu.Unlock()
		if active.Phase != state.PhaseActive {
			continue
		}
		for _, c := range clusters {
			_, _, behind, lacking := b.l.checkCaughtUp(ctx, active, c, b.log)
			if ctx.Err() != nil {
				return
			}
			b.mu.Lock()
			b.results[c] = behindCheck{epoch: active.Epoch, behind: behind, lacking: lacking, checked: time.Now()}
			b.mu.Unlock()
		}
	}
}

// clusterHealth is the health of each source cluster in order of
// preference, from the live agents' views at the last observe; not yet
// how far each is behind (Behind and Lacking -1).
func clusterHealth(sources, live []string, views AgentViews, h *health) []state.ClusterHealth {
	out := make([]state.ClusterHealth, 0, len(sources))
	for i, c := range sources {
		ch := state.ClusterHealth{Name: c, Place: i, Agents: len(live), Up: h.quorumUpNow(c), Behind: -1, Lacking: -1}
		for _, a := range live {
			if v, ok := views[a][c]; ok && v.Reachable {
				ch.Reached++
			}
		}
		if ch.Up {
			ch.Since = h.upSince[c]
		} else {
			for _, since := range h.downSince[c] {
				if ch.Since.IsZero() || since.Before(ch.Since) {
					ch.Since = since
				}
			}
		}
		out = append(out, ch)
	}
	return out
}

// reportClusters hands the behind checker the clusters to check (every
// source cluster a quorum reaches, but the active one) and writes
// state/clusters when the view changed, at most every clustersEvery.
func (r *leaderRun) reportClusters(ctx context.Context, now time.Time, conf *dynamic, live []string, views AgentViews) {
	a := r.t.active
	clusters := clusterHealth(conf.sources, live, views, r.h)
	var check []string
	for i := range clusters {
		ch := &clusters[i]
		if ch.Name == a.Cluster || !ch.Up {
			continue
		}
		check = append(check, ch.Name)
		if b, ok := r.behind.get(ch.Name, a.Epoch); ok {
			ch.Behind, ch.Lacking, ch.Checked = b.behind, b.lacking, b.checked
		}
	}
	r.behind.set(a, check)
	if r.metrics != nil {
		r.metrics.clusters(clusters)
	}
	cs := state.ClusterState{Active: a.Cluster, Clusters: clusters, Leader: r.t.ID}
	if last := r.lastClusters; (last != nil && reflect.DeepEqual(*last, cs)) || now.Sub(r.clustersAt) < clustersEvery {
		return
	}
	r.clustersAt = now
	val, err := json.Marshal(state.ClusterState{Active: cs.Active, Clusters: cs.Clusters, Leader: cs.Leader, Updated: now.UTC()})
	if err != nil {
		return
	}
	wctx, cancel := context.WithTimeout(ctx, r.cfg.Etcd.RequestTimeout)
	defer cancel()
	if _, err := r.t.Txn(wctx, nil, clientv3.OpPut(r.keys.Clusters(), string(val))); err != nil {
		r.log.Debug("cannot record the clusters' health in state/clusters", zap.Error(err))
		return
	}
	r.lastClusters = &cs
}

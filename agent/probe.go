package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"reflect"
	"sync"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/coordinator"
	"github.com/kswitch/kswitch/internal/kafka"
)

// maxProbeError bounds the error text gossiped per cluster: memberlist's
// node metadata holds at most 512 bytes for all clusters together.
const maxProbeError = 48

// prober probes every source cluster (primary and standby) every probe
// interval: a metadata request and a ListOffsets on one partition, each
// bounded by failover.probe_timeout. One goroutine per cluster, so one
// cluster's trouble never delays another's verdict. Results are read with
// views.
type prober struct {
	cfg    config.Config
	log    *zap.Logger
	dialer func(cluster string) kafka.Dialer
	// changed is called (from a probe goroutine) when a cluster's
	// reachability flipped; it must not block.
	changed func()
	// reconf hands run the latest cluster definitions (setClusters).
	reconf chan map[string]config.Cluster

	mu    sync.Mutex
	views map[string]coordinator.ClusterView
	// loops numbers each cluster's current probe loop, so that a loop
	// replaced by a changed definition cannot record a stale result.
	loops map[string]int
}

func newProber(cfg config.Config, log *zap.Logger, dialer func(string) kafka.Dialer, changed func()) *prober {
	return &prober{cfg: cfg, log: log, dialer: dialer, changed: changed,
		reconf: make(chan map[string]config.Cluster, 1), views: map[string]coordinator.ClusterView{}, loops: map[string]int{}}
}

// sourceClusters returns the clusters that are probed: primary and
// standby.
func sourceClusters(all map[string]config.Cluster) map[string]config.Cluster {
	out := map[string]config.Cluster{}
	for name, c := range all {
		if c.Role == config.RolePrimary || c.Role == config.RoleStandby {
			out[name] = c
		}
	}
	return out
}

// setClusters hands the prober new cluster definitions (a dynamic
// configuration version): the loops of changed clusters restart with a
// fresh client, those of new clusters start and those of removed ones
// stop. It never blocks; the latest definitions win.
func (p *prober) setClusters(clusters map[string]config.Cluster) { offerLatest(p.reconf, clusters) }

// run probes until ctx ends.
func (p *prober) run(ctx context.Context) {
	type loop struct {
		def    config.Cluster
		cancel context.CancelFunc
	}
	running := map[string]*loop{}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer func() {
		for _, l := range running {
			l.cancel()
		}
	}()
	apply := func(all map[string]config.Cluster) {
		want := sourceClusters(all)
		for name, l := range running {
			if def, ok := want[name]; !ok || !reflect.DeepEqual(def, l.def) {
				l.cancel()
				delete(running, name)
			}
		}
		p.mu.Lock()
		for name := range p.views {
			if _, ok := want[name]; !ok {
				delete(p.views, name)
				p.loops[name]++
			}
		}
		p.mu.Unlock()
		for name, def := range want {
			if running[name] != nil {
				continue
			}
			lctx, cancel := context.WithCancel(ctx)
			running[name] = &loop{def: def, cancel: cancel}
			p.mu.Lock()
			p.loops[name]++
			gen := p.loops[name]
			p.mu.Unlock()
			wg.Go(func() { p.probeLoop(lctx, name, def, gen) })
		}
	}
	apply(p.cfg.Clusters)
	for {
		select {
		case <-ctx.Done():
			return
		case all := <-p.reconf:
			apply(all)
		}
	}
}

// downProbeInterval is the probe interval of a cluster whose last probe
// failed, when failover.probe_interval is longer.
const downProbeInterval = 100 * time.Millisecond

func (p *prober) probeLoop(ctx context.Context, name string, def config.Cluster, gen int) {
	var client sarama.Client
	defer func() {
		if client != nil {
			client.Close()
		}
	}()
	t := time.NewTimer(p.cfg.Failover.ProbeInterval)
	defer t.Stop()
	lastOK := time.Now() // the last contact, or the start of probing
	// attempt probes with client, made first when nil; a failed client is
	// closed (a timed-out sarama connection stays broken until it is
	// closed: the next attempt starts afresh).
	attempt := func() error {
		var err error
		if client == nil {
			var d kafka.Dialer
			if p.dialer != nil {
				d = p.dialer(name)
			}
			client, err = kafka.NewClientWith(name, def, kafka.Options{Dialer: d, Timeout: p.cfg.Failover.ProbeTimeout})
			if err != nil {
				return err
			}
		}
		if err = p.probe(client, name); err != nil {
			client.Close()
			client = nil
		}
		return err
	}
	for {
		began := time.Now()
		reused := client != nil
		err := attempt()
		if err != nil && reused && time.Since(began) < p.cfg.Failover.ProbeTimeout/2 && ctx.Err() == nil {
			// A connection that failed fast (closed, reset) says little:
			// a fresh one tells a cluster that refuses connections (a
			// hard failure) from a passing fault, at once.
			err = attempt()
		}
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			lastOK = time.Now()
		}
		p.record(name, gen, time.Since(began), time.Since(lastOK), err)
		// A cluster that fails is probed more often, so that its return
		// is seen within downProbeInterval (failback_stable counts from
		// there). A hung cluster's probe takes probe_timeout anyway; one
		// that refuses connections costs a refused dial.
		next := p.cfg.Failover.ProbeInterval
		if err != nil {
			next = min(next, downProbeInterval)
		}
		t.Reset(next)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// refusedOnly reports whether err says the brokers refused the connection
// and nothing timed out: nothing listens at their addresses.
func refusedOnly(err error) bool {
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return false
	}
	var ne net.Error
	return !errors.Is(err, os.ErrDeadlineExceeded) && !errors.Is(err, context.DeadlineExceeded) && !(errors.As(err, &ne) && ne.Timeout())
}

// probe asks for metadata, then the end offset of the first partition of
// the first topic it finds, so that a broker that answers metadata but
// cannot serve partitions counts as down.
func (p *prober) probe(c sarama.Client, name string) error {
	if err := c.RefreshMetadata(); err != nil {
		return fmt.Errorf("metadata: %w", err)
	}
	topics, err := c.Topics()
	if err != nil {
		return fmt.Errorf("topics: %w", err)
	}
	for _, t := range topics {
		if len(t) > 1 && t[:2] == "__" {
			continue
		}
		if _, err := c.GetOffset(t, 0, sarama.OffsetNewest); err != nil {
			return fmt.Errorf("list offsets %s/0: %w", t, err)
		}
		return nil
	}
	return nil // a cluster without topics answers metadata: reachable
}

func (p *prober) record(name string, gen int, latency, failing time.Duration, err error) {
	v := coordinator.ClusterView{Reachable: err == nil, Refused: err != nil && refusedOnly(err)}
	if err == nil {
		v.LatencyMs = max(1, latency.Milliseconds())
	} else {
		v.FailingMs = failing.Milliseconds()
		msg := err.Error()
		if len(msg) > maxProbeError {
			msg = msg[:maxProbeError]
		}
		v.Error = msg
	}
	p.mu.Lock()
	if p.loops[name] != gen {
		p.mu.Unlock()
		return // replaced by a loop with a newer definition
	}
	prev, seen := p.views[name]
	p.views[name] = v
	p.mu.Unlock()
	if !seen || prev.Reachable != v.Reachable || prev.Refused != v.Refused {
		if err != nil {
			p.log.Warn("cluster unreachable", zap.String("cluster", name), zap.Error(err))
		} else {
			p.log.Info("cluster reachable", zap.String("cluster", name), zap.Duration("latency", latency))
		}
		p.changed()
	}
}

// view returns this agent's current view of every probed cluster.
func (p *prober) view() map[string]coordinator.ClusterView {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[string]coordinator.ClusterView, len(p.views))
	for k, v := range p.views {
		out[k] = v
	}
	return out
}

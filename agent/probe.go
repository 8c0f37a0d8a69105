package agent

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/coordinator"
	"github.com/kswitch/kswitch/internal/config"
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

	mu    sync.Mutex
	views map[string]coordinator.ClusterView
}

func (p *prober) clusters() []string {
	var out []string
	for name, c := range p.cfg.Clusters {
		if c.Role == config.RolePrimary || c.Role == config.RoleStandby {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// run probes until ctx ends.
func (p *prober) run(ctx context.Context) {
	var wg sync.WaitGroup
	for _, name := range p.clusters() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.probeLoop(ctx, name)
		}()
	}
	wg.Wait()
}

func (p *prober) probeLoop(ctx context.Context, name string) {
	var client sarama.Client
	defer func() {
		if client != nil {
			client.Close()
		}
	}()
	t := time.NewTicker(p.cfg.Failover.ProbeInterval)
	defer t.Stop()
	for {
		began := time.Now()
		var err error
		if client == nil {
			var d kafka.Dialer
			if p.dialer != nil {
				d = p.dialer(name)
			}
			client, err = kafka.NewClientWith(name, p.cfg.Clusters[name], kafka.Options{Dialer: d, Timeout: p.cfg.Failover.ProbeTimeout})
		}
		if err == nil {
			err = p.probe(client, name)
			if err != nil {
				// A timed-out sarama connection stays broken until it
				// is closed: start afresh next time.
				client.Close()
				client = nil
			}
		}
		p.record(name, time.Since(began), err)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
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

func (p *prober) record(name string, latency time.Duration, err error) {
	v := coordinator.ClusterView{Reachable: err == nil}
	if err == nil {
		v.LatencyMs = max(1, latency.Milliseconds())
	} else {
		msg := err.Error()
		if len(msg) > maxProbeError {
			msg = msg[:maxProbeError]
		}
		v.Error = msg
	}
	p.mu.Lock()
	prev, seen := p.views[name]
	p.views[name] = v
	p.mu.Unlock()
	if !seen || prev.Reachable != v.Reachable {
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

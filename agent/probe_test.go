package agent

import (
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// TestProbeSeesAReturningClusterWithinTheDownInterval: a cluster that
// failed is probed every downProbeInterval, so its return is reported long
// before the next failover.probe_interval (failback_stable counts from
// that report).
func TestProbeSeesAReturningClusterWithinTheDownInterval(t *testing.T) {
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 1}})
	cfg := config.Default()
	cfg.Clusters = map[string]config.Cluster{"A": {Brokers: k.Brokers(), Role: config.RolePrimary, Version: config.DefaultKafkaVersion}}
	cfg.Failover.ProbeInterval = 10 * time.Second
	cfg.Failover.ProbeTimeout = time.Second
	k.Stop() // the first probe fails: connections refused
	p := newProber(cfg, zap.NewNop(), nil, func() {})
	ctx := t.Context()
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.run(ctx)
	}()
	t.Cleanup(func() { <-done }) // after t.Context ends
	reachable := func(want bool) func() error {
		return func() error {
			v, ok := p.view()["A"]
			if !ok || v.Reachable != want {
				return fmt.Errorf("view of A %+v (seen %v), want reachable %v", v, ok, want)
			}
			return nil
		}
	}
	wait.For(t, 5*time.Second, "the first probe of A, refused", reachable(false))
	if err := k.Restart(); err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	// Every downProbeInterval, a probe: a refused dial until A listens,
	// then metadata and one ListOffsets within probe_timeout. Far from
	// the 10 s probe interval.
	wait.For(t, 3*time.Second, "A reachable again well within the probe interval", reachable(true))
	t.Logf("A seen again %v after its restart (probe interval %v)", time.Since(back).Round(time.Millisecond), cfg.Failover.ProbeInterval)
}

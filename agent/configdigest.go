package agent

import (
	"context"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/state"
)

// newConfigDisagreeGauge registers kswitch_agents_config_disagree on reg.
func newConfigDisagreeGauge(reg prometheus.Registerer) prometheus.Gauge {
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kswitch_agents_config_disagree",
		Help: "Registered agents whose configuration digest (routing, source, clusters, failover) differs from the fleet's; set by the leader, 0 on the others.",
	})
	reg.MustRegister(g)
	return g
}

// flagConfigDisagreement is leader work: until ctx ends it compares the
// registered agents' configuration digests whenever the registrations
// change, keeps kswitch_agents_config_disagree, and logs each change of
// the disagreeing set once (Warn naming the agents, the parts and the
// digests; Info when they agree again). The gauge is 0 when it returns.
func (a *Agent) flagConfigDisagreement(ctx context.Context, log *zap.Logger) {
	changed := a.registry.subscribe(ctx)
	defer a.configDisagree.Set(0)
	last := ""
	for {
		odd := state.CompareConfigs(a.registry.list(), a.id)
		a.configDisagree.Set(float64(len(odd)))
		if now := fmt.Sprint(odd); now != last {
			if len(odd) > 0 {
				each := make([]string, len(odd))
				for i, d := range odd {
					each[i] = d.String()
				}
				log.Warn("agents run with a configuration that differs from the fleet's: their routing or sources may split the traffic; give every agent the same file (kswitch status lists them)",
					zap.Int("agents", len(odd)), zap.Strings("disagree", each))
			} else if last != "" {
				log.Info("every agent's configuration agrees again")
			}
			last = now
		}
		select {
		case <-ctx.Done():
			return
		case <-changed:
		}
	}
}

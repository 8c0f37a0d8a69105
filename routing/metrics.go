package routing

import (
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kswitch/kswitch/internal/refused"
)

// metrics are the router's Prometheus metrics.
type metrics struct {
	version prometheus.Gauge
	refused prometheus.Counter
	// refusedValues is kswitch_refused_values_total, shared with the
	// agent when they share a registry: kind routes or channel.
	refusedValues *prometheus.CounterVec
	routed        *prometheus.CounterVec // channel
	rules         *prometheus.CounterVec // rule
	dropped       *prometheus.CounterVec // reason
	dead          *prometheus.CounterVec // reason
	latency       *prometheus.HistogramVec
	inFlight      *prometheus.Desc       // channel; collected by inFlightCollector
	stalled       *prometheus.Desc       // channel; collected by inFlightCollector
	deadRun       *prometheus.Desc       // collected by inFlightCollector
	failures      *prometheus.CounterVec // channel
	waits         *prometheus.CounterVec // reason
	producers     prometheus.Gauge
	skipped       prometheus.Counter
	reordered     prometheus.Counter
	bumps         *prometheus.CounterVec // cluster; at_least_once producers only
	duplicates    *prometheus.CounterVec // cluster; at_least_once producers only
	txns          *prometheus.CounterVec // cluster, outcome
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		version: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kswitch_config_version",
			Help: "Routing version in force: the etcd revision of the last change of routes or channels it includes (0: the configuration file alone).",
		}),
		refused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kswitch_routing_versions_refused_total",
			Help: "Routing versions (routes and channels in etcd merged with the file) refused as invalid; the last good version stayed in force.",
		}),
		routed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kswitch_routing_routed_total",
			Help: "Records produced to a channel and acknowledged by its cluster, by channel (the dead-letter channel included).",
		}, []string{"channel"}),
		rules: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kswitch_routing_rule_matches_total",
			Help: "Records a rule matched and that were handed on (produced, dropped or dead-lettered), by rule.",
		}, []string{"rule"}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kswitch_routing_dropped_total",
			Help: "Records acknowledged without a produce: reason rule (a drop rule matched) or no_match (no rule matched and there is no default route).",
		}, []string{"reason"}),
		skipped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kswitch_routing_exactly_once_skipped_total",
			Help: "Produces to an exactly_once cluster skipped because an earlier owner's committed transaction holds them (consumed again after a crash).",
		}),
		bumps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kswitch_routing_epoch_bumps_total",
			Help: "New producer ids a producer took after a destination lost its sequence numbers (drain-and-bump), by cluster. Two within 5 s make readiness fail for a minute.",
		}, []string{"cluster"}),
		duplicates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kswitch_routing_duplicate_sequence_total",
			Help: "Batches a producer sent again that the destination already had (DUPLICATE_SEQUENCE_NUMBER), by cluster.",
		}, []string{"cluster"}),
		reordered: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kswitch_routing_reordered_total",
			Help: "Records that reached their channel before an earlier record of the same source partition that had failed and was held to be sent again (0 by design); each is logged with its partition.",
		}),
		txns: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kswitch_routing_transactions_total",
			Help: "Transactions to exactly_once clusters by cluster and outcome: committed, aborted (sent again), failed (the producer is opened again) or fenced (the partition has a new owner).",
		}, []string{"cluster", "outcome"}),
		dead: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kswitch_routing_dead_lettered_total",
			Help: "Records sent to the dead-letter channel: reason evaluation (a rule or key expression failed), budget (an expression exceeded its evaluation budget on the record) produce (the destination refused the record for good), reference (the dead-letter channel refused the record too and took a reference to it, routing.refused) or dropped (even the reference was refused). Counted once the dead-letter channel acknowledges it.",
		}, []string{"reason"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kswitch_routing_produce_seconds",
			Help:    "Time from handing a record to a channel's producer to its acknowledgement, retries included, by channel.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}, []string{"channel"}),
		inFlight: prometheus.NewDesc("kswitch_routing_in_flight",
			"Records handed to a channel's producer and not yet acknowledged, by channel.", []string{"channel"}, nil),
		stalled: prometheus.NewDesc("kswitch_routing_channel_stalled_seconds",
			"Seconds for which records have waited for a channel that acknowledged none of them (0 while it moves or nothing waits), by channel; sampled every second. Readiness turns 503 past the agent's stuck limit.", []string{"channel"}, nil),
		deadRun: prometheus.NewDesc("kswitch_routing_dead_letter_run_seconds",
			"Seconds for which every record this agent handled went to the dead-letter channel and none to a channel (0 once one reaches a channel).", nil, nil),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kswitch_routing_produce_failures_total",
			Help: "Produces that failed past the producer's own retries (each is sent again, or dead-lettered), by channel.",
		}, []string{"channel"}),
		waits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kswitch_routing_waits_total",
			Help: "Records the router asked the agent to offer again later: reason paused (a channel signal), failing (a destination is failing), blocked (an earlier record of the partition is refused and there is no dead-letter channel), opening (a producer is connecting), redefined (the channel changed producer: its produces inside the previous one return first), evaluation (no dead-letter channel for an expression error), not_ready (etcd's routes not read yet).",
		}, []string{"reason"}),
		producers: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kswitch_routing_producers",
			Help: "Producers open (one per destination cluster and acks in use).",
		}),
	}
	for _, c := range []prometheus.Collector{m.version, m.refused, m.routed, m.rules, m.dropped, m.dead, m.latency, m.failures, m.waits, m.producers, m.skipped, m.reordered, m.bumps, m.duplicates, m.txns} {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if errors.As(err, &are) {
				return nil, errors.New("routing: metrics already registered: one router per registry")
			}
			return nil, err
		}
	}
	var err error
	if m.refusedValues, err = refused.Counter(reg); err != nil {
		return nil, err
	}
	for _, r := range []string{DropRule, DropNoMatch} {
		m.dropped.WithLabelValues(r)
	}
	for _, r := range []string{"evaluation", "budget", "produce", "reference", "dropped"} {
		m.dead.WithLabelValues(r)
	}
	return m, nil
}

// inFlightCollector exports kswitch_routing_in_flight from the
// destinations' counts when scraped, so that routing a record touches no
// gauge.
type inFlightCollector struct{ r *Router }

func (c inFlightCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.r.m.inFlight
	ch <- c.r.m.stalled
	ch <- c.r.m.deadRun
}

func (c inFlightCollector) Collect(ch chan<- prometheus.Metric) {
	now := time.Now()
	byChannel := map[string]int64{}
	stalled := map[string]float64{}
	c.r.mu.Lock()
	for d, ds := range c.r.dests {
		byChannel[d.channel] += ds.inFlight.Load()
		if s := ds.health.stalledSince; !s.IsZero() {
			stalled[d.channel] = max(stalled[d.channel], now.Sub(s).Seconds())
		} else if _, ok := stalled[d.channel]; !ok {
			stalled[d.channel] = 0
		}
	}
	c.r.mu.Unlock()
	for name, n := range byChannel {
		ch <- prometheus.MustNewConstMetric(c.r.m.inFlight, prometheus.GaugeValue, float64(n), name)
		ch <- prometheus.MustNewConstMetric(c.r.m.stalled, prometheus.GaugeValue, stalled[name], name)
	}
	ch <- prometheus.MustNewConstMetric(c.r.m.deadRun, prometheus.GaugeValue, c.r.health.deadRunFor(now).Seconds())
}

// countTxn counts a transaction's outcome on cluster (committed, aborted,
// failed, fenced).
func (r *Router) countTxn(cluster, outcome string) {
	r.m.txns.WithLabelValues(cluster, outcome).Inc()
}

package agent

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/internal/version"
	"github.com/kswitch/kswitch/signals"
)

// metrics are registered on a registry of the agent's own, so that several
// agents can run in one process (tests, the demo) without colliding.
type metrics struct {
	isLeader      prometheus.Gauge
	leaderChanges prometheus.Counter
	ready         prometheus.Gauge
	agents        prometheus.Gauge
	gossipMembers prometheus.Gauge
	etcdErrors    *prometheus.CounterVec
	badValues     *prometheus.CounterVec // kswitch_refused_values_total, shared (internal/refused)

	records       prometheus.Counter
	consumeErrors prometheus.Counter
	// throttle is the time brokers asked this agent's requests to wait
	// (their ThrottleTime), by cluster and API: the Fetchers' fetches
	// (countFetchStats).
	throttle *prometheus.CounterVec
	// restarts counts partition consumers started again (lifecycle.go).
	restarts      *prometheus.CounterVec
	handlerErrors prometheus.Counter
	commits       prometheus.Counter
	commitErrors  *prometheus.CounterVec
	// commitBytes, commitShare and commitsWaiting show the commit budget
	// (source.commit_budget_kib, commitPacer).
	commitBytes     prometheus.Counter
	commitShare     prometheus.Gauge
	commitsWaiting  prometheus.Gauge
	ownedPartitions prometheus.Gauge
	generation      prometheus.Gauge
	gossipDropped   prometheus.Counter
	paused          *prometheus.GaugeVec
	deliveryHeld    prometheus.Gauge
	stuckPartitions prometheus.Gauge
	// stalledPartitions counts the partitions that make no progress while
	// records wait on the cluster.
	stalledPartitions prometheus.Gauge
	lag               *prometheus.GaugeVec
	signalApply       prometheus.Histogram
	configVersion     prometheus.Gauge
}

// setPaused shows which signal scopes pause now.
func (m *metrics) setPaused(state signals.State) {
	m.paused.Reset()
	for _, s := range state.Signals() {
		if s.Paused {
			m.paused.WithLabelValues(s.Scope.String()).Set(1)
		}
	}
}

func newMetrics(reg *prometheus.Registry) *metrics {
	m := &metrics{
		isLeader: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kswitch_is_leader", Help: "1 while this agent leads the fleet, else 0.",
		}),
		leaderChanges: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kswitch_leader_changes_total", Help: "Changes of the fleet's leader (id or fencing token) observed by this agent.",
		}),
		ready: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kswitch_ready", Help: "1 while /readyz answers 200 (etcd reachable and agent registered), else 0.",
		}),
		agents: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kswitch_registered_agents", Help: "Agents registered in etcd, as this agent sees them.",
		}),
		gossipMembers: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kswitch_gossip_members", Help: "Live and suspect members of the gossip cluster, this agent included.",
		}),
		etcdErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kswitch_etcd_errors_total", Help: "Failed etcd requests by operation.",
		}, []string{"op"}),
		records: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kswitch_records_total", Help: "Records handed to the handler.",
		}),
		consumeErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kswitch_consume_errors_total", Help: "Errors reported by partition consumers.",
		}),
		handlerErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kswitch_handler_errors_total", Help: "Records the handler refused (each is offered again).",
		}),
		commits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kswitch_offset_commits_total", Help: "Partition positions committed to etcd.",
		}),
		commitErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kswitch_offset_commit_errors_total", Help: "Failed or refused commits, by reason (lease_lost, stale_generation, etcd, kafka_mirror).",
		}, []string{"reason"}),
		ownedPartitions: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kswitch_owned_partitions", Help: "Partitions this agent consumes now.",
		}),
		generation: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kswitch_assignment_generation", Help: "The assignment generation this agent has applied.",
		}),
		paused: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kswitch_paused", Help: "1 for each signal scope (fleet, topic/<t>, agent/<id>, channel/<c>) that pauses now.",
		}, []string{"scope"}),
		deliveryHeld: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kswitch_delivery_held",
			Help: "1 while this agent hands no record on because its commits to etcd have not succeeded for longer than the hold's bound (one commit interval after the first commit attempt that did not succeed).",
		}),
		signalApply: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kswitch_signal_apply_seconds",
			Help:    "Time from this agent seeing a pause signal in etcd to every affected partition having stopped delivering.",
			Buckets: []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5},
		}),
		gossipDropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kswitch_gossip_events_dropped_total", Help: "Gossip death notices dropped because the leader's queue was full.",
		}),
		configVersion: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kswitch_dynamic_config_version",
			Help: "Dynamic configuration version (source and clusters from etcd, accepted by the leader) this agent applies; 0: the file alone. The routing layer's is kswitch_config_version.",
		}),
	}
	info := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kswitch_build_info", Help: "Always 1; the labels carry the build.",
		ConstLabels: prometheus.Labels{"version": version.Version},
	})
	info.Set(1)
	var err error
	if m.badValues, err = refused.Counter(reg); err != nil {
		panic(err)
	}
	m.stuckPartitions = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kswitch_stuck_partitions",
		Help: "Partitions whose committable position has not moved for the stuck bound while records handed to the handler wait for their acknowledgement.",
	})
	m.stalledPartitions = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kswitch_stalled_partitions",
		Help: "Partitions whose position has not moved for the stuck bound, nothing waiting in the handler, while the cluster holds records past it.",
	})
	m.lag = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kswitch_consumer_lag_records",
		Help: "Records on the cluster past this agent's acknowledged position, summed over the partitions it owns, by cluster and logical topic: up to the high watermark of the last fetch, updated every commit interval (a paused partition is not fetched: see kswitch_paused).",
	}, []string{"cluster", "topic"})
	m.commitBytes = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kswitch_offset_commit_bytes_total",
		Help: "Bytes (keys and values) of the partition positions this agent committed to etcd: what source.commit_budget_kib bounds, over the fleet.",
	})
	m.commitShare = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kswitch_offset_commit_budget_bytes_per_second",
		Help: "This agent's share of source.commit_budget_kib in bytes per second (the share of the partitions it owns); 0: no bound.",
	})
	m.commitsWaiting = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kswitch_offset_commits_waiting",
		Help: "Partitions whose changed position the last commit left for a later one, to stay within the agent's share of source.commit_budget_kib: above 0, positions are committed less often than source.commit_interval.",
	})
	m.restarts = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kswitch_partition_restarts_total",
		Help: "Partitions started at another offset than their committed position, by cluster and reason: recreated (the topic was deleted and created again: at its start), beyond_end (the position is past the partition's end: at the log start), before_start (the position is before the log start: at source.initial_offset).",
	}, []string{"cluster", "reason"})
	reg.MustRegister(m.restarts)
	m.throttle = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kswitch_kafka_throttle_seconds_total",
		Help: "Time brokers throttled this agent's requests (their throttle time), by cluster and api (fetch: the direct fetch path's fetches).",
	}, []string{"cluster", "api"})
	reg.MustRegister(m.throttle)
	reg.MustRegister(m.deliveryHeld, m.stuckPartitions, m.stalledPartitions, m.lag, m.commitBytes, m.commitShare, m.commitsWaiting)
	reg.MustRegister(m.isLeader, m.leaderChanges, m.ready, m.agents, m.gossipMembers, m.etcdErrors, info,
		m.records, m.consumeErrors, m.handlerErrors, m.commits, m.commitErrors, m.ownedPartitions, m.generation, m.gossipDropped, m.paused, m.signalApply, m.configVersion,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

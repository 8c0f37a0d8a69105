package coordinator

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/state"
)

// Metrics are the leader's measurements. Register them once per agent.
type Metrics struct {
	activeCluster  *prometheus.GaugeVec
	topicActive    *prometheus.GaugeVec
	lastSwitch     prometheus.Gauge
	switchDuration prometheus.Histogram
	switchPhase    *prometheus.HistogramVec
	switchFailures prometheus.Counter
	translation    *prometheus.CounterVec
	reachable      *prometheus.GaugeVec
	// place, up and clusterBehind are the leader's view of each source
	// cluster (clusters.go).
	place, up, clusterBehind *prometheus.GaugeVec
	breakerOpen              prometheus.Gauge
	behind                   prometheus.Gauge
	repairs                  *prometheus.CounterVec
	refuted                  prometheus.Counter
	unassignedN              prometheus.Gauge
	late                     prometheus.Counter
	lateBy                   prometheus.Gauge
	// topicEvents counts the source topics' lifecycle events
	// (lifecycle.go) as kswitch_source_topic_recreated_total and
	// kswitch_source_partitions_changed_total.
	recreated, partitionsChanged *prometheus.CounterVec
	// refused is kswitch_refused_values_total, shared with the agent
	// (internal/refused): kinds pin and history.
	refused *prometheus.CounterVec
}

// NewMetrics creates and registers the leader's metrics on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		activeCluster: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kswitch_active_cluster", Help: "1 for the cluster the fleet consumes, as the leader sees it (0 for the others).",
		}, []string{"cluster"}),
		topicActive: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kswitch_topic_active_cluster",
			Help: "1 for the cluster a topic placed away from the fleet's cluster is consumed on (kswitch failover --topic), as the leader sees it; 0 while it moves there. Topics without a series are consumed on kswitch_active_cluster's cluster.",
		}, []string{"topic", "cluster"}),
		lastSwitch: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kswitch_last_switch_timestamp_seconds", Help: "When the last cluster switch finished (Unix time).",
		}),
		switchDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kswitch_switch_duration_seconds", Help: "Duration of cluster switches, from decision to active.",
			Buckets: []float64{0.1, 0.25, 0.5, 1, 2, 5, 10, 30},
		}),
		switchPhase: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kswitch_switch_phase_seconds", Help: "Duration of each phase of the switches (prepare, revoke, translate, activate), fleet and topic switches alike.",
			Buckets: []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10},
		}, []string{"phase"}),
		switchFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kswitch_switch_failures_total", Help: "Cluster switches that failed (and are retried).",
		}),
		translation: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kswitch_translation_total", Help: "Partition positions translated at switches, by method.",
		}, []string{"method"}),
		reachable: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kswitch_cluster_reachable", Help: "1 when the agent's last probe reached the cluster, as gossiped to the leader.",
		}, []string{"agent", "cluster"}),
		place: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kswitch_cluster_place", Help: "A source cluster's place in the order of failover, as the leader sees it: 0 for the primary, then the standbys by priority.",
		}, []string{"cluster"}),
		up: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kswitch_cluster_up", Help: "1 when a quorum of the live agents reaches the source cluster, as the leader sees it.",
		}, []string{"cluster"}),
		clusterBehind: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kswitch_cluster_behind_partitions",
			Help: "Partitions whose last record consumed on the active cluster a source cluster lacks, at the leader's last check (every failback_stable, of each cluster a quorum reaches); no series for the active cluster and clusters not checked.",
		}, []string{"cluster"}),
		breakerOpen: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kswitch_circuit_breaker_open", Help: "1 while automatic switching is off after too many failed or flapping switches.",
		}),
		unassignedN: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kswitch_unassigned_partitions",
			Help: "Discovered partitions of the active cluster that no agent consumes or is releasing, as the leader sees them (the fleet's stalled partitions).",
		}),
		refuted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kswitch_gossip_deaths_refuted_total",
			Help: "Gossip reports of an agent's death the leader did not act on, because the agent answered over HTTP (a stale or forged report).",
		}),
		repairs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kswitch_state_repairs_total",
			Help: "Times the leader wrote its view of a state key again after someone else changed or deleted it, by key (assignment, active).",
		}, []string{"key"}),
		behind: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kswitch_failback_behind_partitions",
			Help: "Partitions whose last record consumed on the standby is not on the primary yet, at the last failback check (0: caught up); failback waits while it is above 0.",
		}),
		late: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kswitch_late_records_total",
			Help: "Records of the primary's unmirrored tail counted at failbacks: written before the failover, not on the standby by then, consumed after the primary returned.",
		}),
		lateBy: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kswitch_late_records_max_seconds",
			Help: "At the last failback with an unmirrored tail: from the oldest tail record's timestamp to the end of the failback (an upper bound of its lateness).",
		}),
		recreated: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kswitch_source_topic_recreated_total",
			Help: "Source topics the leader found deleted and created again (a new topic id), by cluster and topic; their partitions are consumed from their start.",
		}, []string{"cluster", "topic"}),
		partitionsChanged: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kswitch_source_partitions_changed_total",
			Help: "Source topics the leader found with more (added) or fewer (removed) partitions than before, by cluster, topic and change.",
		}, []string{"cluster", "topic", "change"}),
	}
	reg.MustRegister(m.recreated, m.partitionsChanged)
	reg.MustRegister(m.activeCluster, m.topicActive, m.lastSwitch, m.switchDuration, m.switchPhase, m.switchFailures, m.translation, m.reachable, m.place, m.up, m.clusterBehind, m.breakerOpen,
		m.behind, m.late, m.lateBy, m.repairs, m.refuted, m.unassignedN)
	var err error
	if m.refused, err = refused.Counter(reg); err != nil {
		panic(err)
	}
	return m
}

// refusedValue counts a value of kind (internal/refused) the leader
// refused. m may be nil.
func (m *Metrics) refusedValue(kind string) {
	if m != nil {
		m.refused.WithLabelValues(kind).Inc()
	}
}

func (m *Metrics) observe(views AgentViews, a state.Active) {
	m.reachable.Reset()
	for agent, vs := range views {
		for cluster, v := range vs {
			val := 0.0
			if v.Reachable {
				val = 1
			}
			m.reachable.WithLabelValues(agent, cluster).Set(val)
		}
	}
	m.activeCluster.Reset()
	if a.Phase == state.PhaseActive {
		m.activeCluster.WithLabelValues(a.Cluster).Set(1)
	}
	m.topicActive.Reset()
	for topic, e := range a.Topics {
		if e.Cluster == a.Cluster {
			continue // joining the fleet's cluster in a fleet switch
		}
		val := 0.0
		if e.Phase == state.PhaseActive {
			val = 1
		}
		m.topicActive.WithLabelValues(topic, e.Cluster).Set(val)
	}
}

// unassigned records how many partitions have no consumer. m may be nil.
func (m *Metrics) unassigned(n int) {
	if m != nil {
		m.unassignedN.Set(float64(n))
	}
}

// deathRefuted counts a gossip death report not acted on. m may be nil.
func (m *Metrics) deathRefuted() {
	if m != nil {
		m.refuted.Inc()
	}
}

// repaired counts a repair of state/<key>. m may be nil.
func (m *Metrics) repaired(key string) {
	if m != nil {
		m.repairs.WithLabelValues(key).Inc()
	}
}

// lateRecords counts a failback's unmirrored tail. m may be nil.
func (m *Metrics) lateRecords(ev state.SwitchEvent) {
	if m != nil && ev.Late > 0 {
		m.late.Add(float64(ev.Late))
		m.lateBy.Set(ev.LateBySeconds)
	}
}

// clusters records the leader's view of the source clusters.
func (m *Metrics) clusters(cs []state.ClusterHealth) {
	for _, c := range cs {
		m.place.WithLabelValues(c.Name).Set(float64(c.Place))
		up := 0.0
		if c.Up {
			up = 1
		}
		m.up.WithLabelValues(c.Name).Set(up)
		if c.Behind >= 0 {
			m.clusterBehind.WithLabelValues(c.Name).Set(float64(c.Behind))
		} else {
			m.clusterBehind.DeleteLabelValues(c.Name)
		}
	}
}

// failbackBehind records the last failback check. m may be nil.
func (m *Metrics) failbackBehind(n int) {
	if m != nil && n >= 0 {
		m.behind.Set(float64(n))
	}
}

func (m *Metrics) breaker(until time.Time) {
	if time.Now().Before(until) {
		m.breakerOpen.Set(1)
	} else {
		m.breakerOpen.Set(0)
	}
}

func (m *Metrics) switched(ev state.SwitchEvent, took time.Duration, err error) {
	if err != nil {
		m.switchFailures.Inc()
		return
	}
	m.switchDuration.Observe(took.Seconds())
	for phase, secs := range ev.Phases {
		m.switchPhase.WithLabelValues(phase).Observe(secs)
	}
	m.lastSwitch.Set(float64(ev.Finished.Unix()))
}

func (l *Leader) translated(method string) {
	if l.metrics != nil {
		l.metrics.translation.WithLabelValues(method).Inc()
	}
}

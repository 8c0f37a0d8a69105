//go:build integration

package integration

import (
	"fmt"
	"math"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/kswitch/kswitch/internal/wait"
)

// stack is what the Kafka scenarios run on, each part an OS process: a
// three-member etcd cluster, Kafka A (the primary, topic orders) and B (the
// standby, and the host of the fleet's channel topic "delivered"), and
// MirrorMaker 2 from A to B; the suite's watch of the fleet's etcd keys.
type stack struct {
	env    kafkaEnv
	etcd   *etcdCluster
	a, b   *kafkaBroker
	mm     *mirrorMaker // nil when started without
	policy replicationPolicy
	tl     *timeline
	began  time.Time
}

// startStack starts the stack, MirrorMaker 2 only with mirror, and reports
// the start-up times to timed.
func startStack(t *testing.T, timed func(string, time.Duration), policy replicationPolicy, mirror bool) *stack {
	t.Helper()
	st := &stack{env: kafkaTools(t), policy: policy, began: time.Now()}
	logs := logDir(t)

	// Kafka A and B format their storage while etcd starts.
	dirs := []string{filepath.Join(t.TempDir(), "kafka-A"), filepath.Join(t.TempDir(), "kafka-B")}
	brokers := make([]*kafkaBroker, 2)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for i, name := range []string{"A", "B"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			brokers[i], errs[i] = newKafkaBroker(st.env, name, dirs[i], logs)
		}()
	}
	st.etcd = startEtcdCluster(t, 3)
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	st.a, st.b = brokers[0], brokers[1]
	st.a.start(t)
	st.b.start(t)
	timed("kafka_a_ready", st.a.waitReady(t, 2*time.Minute))
	timed("kafka_b_ready", st.b.waitReady(t, 2*time.Minute))
	st.a.createTopic(t, "orders", ordersPartitions)
	// The fleet's channel: one copy of every delivery, on B, which never
	// fails in these tests.
	st.b.createTopic(t, "delivered", ordersPartitions)

	if mirror {
		st.mm = startMirrorMaker(t, st.env, st.a, st.b, policy)
		wait.For(t, 2*time.Minute, "MirrorMaker 2 creates "+policy.remote+" on B", func() error {
			if !st.mm.proc.running() {
				return fmt.Errorf("MirrorMaker 2 exited: %v", st.mm.proc.err)
			}
			ends, err := endOffsets(st.b.addr, policy.remote)
			if err != nil {
				return err
			}
			if len(ends) != ordersPartitions {
				return fmt.Errorf("%s on B has %d partitions", policy.remote, len(ends))
			}
			return nil
		})
		timed("mirrormaker_topic_on_b", time.Since(st.mm.began))
	}
	timed("stack_ready", time.Since(st.began))
	st.tl = startTimeline(t, st.etcd.endpoints())
	return st
}

// agentConfig is the configuration of the fleet's agents on the stack.
func (st *stack) agentConfig() agentConfig {
	return agentConfig{
		Endpoints: st.etcd.endpoints(),
		Clusters: fmt.Sprintf(`  A: {brokers: [%s], role: primary, version: %q}
  B:
    brokers: [%s]
    role: standby
    version: %q
    replication_policy: %s
    source_alias: A
    offset_syncs_on: target
    offset_syncs_topic: %s
    checkpoints_topic: A.checkpoints.internal
`, st.a.addr, kafkaVersion, st.b.addr, kafkaVersion, st.policy.kswitch, st.policy.syncTopic),
		Source: "  topics: [orders]\n  group: orders\n  initial_offset: oldest\n  refresh_interval: 2s\n  commit_interval: 500ms\n",
		Failover: fmt.Sprintf("  probe_interval: %s\n  probe_timeout: 1s\n  failure_window: %s\n  failback: auto\n  failback_stable: %s\n",
			probeInterval, failureWindow, failbackStable),
		// Every record to the channel "delivered" on B, in the partition
		// it came from.
		Extra: "routing:\n  default: [delivered]\n  channels:\n    delivered: {cluster: B, topic: delivered, partitioner: manual-same-partition}\n",
	}
}

// scenarioReport is one row of the suite's report.
type scenarioReport struct {
	Scenario string `json:"scenario"`
	Passed   bool   `json:"passed"`
	verdict
	// Timings in seconds, by step (see README.md).
	Timings map[string]float64 `json:"timings_seconds"`
	// Methods are the translation methods of each switch, by partition.
	Methods map[string][]string `json:"methods,omitempty"`
}

func newReport(name string) scenarioReport {
	return scenarioReport{Scenario: name, Timings: map[string]float64{}, Methods: map[string][]string{}}
}

// timer returns a function that records a step's duration in the report
// and logs it.
func (r *scenarioReport) timer(t *testing.T) func(step string, d time.Duration) {
	return func(step string, d time.Duration) {
		r.Timings[step] = math.Round(d.Seconds()*1000) / 1000
		t.Logf("%-28s %v", step, d.Round(time.Millisecond))
	}
}

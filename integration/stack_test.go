//go:build integration

package integration

import (
	"fmt"
	"math"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
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
	// twoWay: B has its own topic orders too, MirrorMaker 2 copies it to
	// A (B.orders), and the agents are told where that flow keeps its
	// offset-syncs (a real data-centre outage, outage_test.go).
	twoWay bool
	// topics are the source topics on A, orders first: the agents'
	// source.topics, each mirrored to B when MirrorMaker 2 runs.
	topics []string
	tl     *timeline
	began  time.Time
}

// stackOptions say what a scenario's stack runs beyond Kafka A and B with
// orders and delivered, and etcd.
type stackOptions struct {
	// mirror runs MirrorMaker 2 from A to B.
	mirror bool
	// twoWay runs it both ways (mirror is implied): orders is created on
	// B too, and the stack is ready once A.orders is on B and B.orders on
	// A.
	twoWay bool
	// topics are more source topics on A beside orders, ordersPartitions
	// each, mirrored with orders from A to B (the flow back copies orders
	// alone) and consumed by the agents (agentConfig).
	topics []string
	// appendTime makes the channel topic delivered take the broker's
	// time on append (message.timestamp.type=LogAppendTime) instead of
	// the source record's: when each delivery reached B.
	appendTime bool
	// kafkaA and kafkaB are the Kafka releases A and B run (nil: the
	// suite's, which runs MirrorMaker 2 in any case).
	kafkaA, kafkaB *kafkaEnv
}

// startStack starts the stack, MirrorMaker 2 only with mirror, and reports
// the start-up times to timed.
func startStack(t *testing.T, timed func(string, time.Duration), policy replicationPolicy, mirror bool) *stack {
	t.Helper()
	return startStackWith(t, timed, policy, mirror, false)
}

// startStackWith is startStack, with MirrorMaker 2 both ways when twoWay
// (mirror is implied): orders is created on B too, and the stack is ready
// once A.orders is on B and B.orders on A.
func startStackWith(t *testing.T, timed func(string, time.Duration), policy replicationPolicy, mirror, twoWay bool) *stack {
	t.Helper()
	return startStackOpts(t, timed, policy, stackOptions{mirror: mirror, twoWay: twoWay})
}

// startStackOpts is startStack with the options o.
func startStackOpts(t *testing.T, timed func(string, time.Duration), policy replicationPolicy, o stackOptions) *stack {
	t.Helper()
	mirror, twoWay := o.mirror || o.twoWay, o.twoWay
	st := &stack{env: kafkaTools(t), policy: policy, twoWay: twoWay, topics: append([]string{"orders"}, o.topics...), began: time.Now()}
	logs := logDir(t)

	// Kafka A and B format their storage while etcd starts.
	dirs := []string{filepath.Join(t.TempDir(), "kafka-A"), filepath.Join(t.TempDir(), "kafka-B")}
	brokers := make([]*kafkaBroker, 2)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	envs := []kafkaEnv{st.env, st.env}
	for i, e := range []*kafkaEnv{o.kafkaA, o.kafkaB} {
		if e != nil {
			envs[i] = *e
		}
	}
	for i, name := range []string{"A", "B"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			brokers[i], errs[i] = newKafkaBroker(envs[i], name, dirs[i], logs)
		}()
	}
	st.etcd = startEtcdCluster(t, 3)
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			fatal(t, err)
		}
	}
	st.a, st.b = brokers[0], brokers[1]
	st.a.start(t)
	st.b.start(t)
	timed("kafka_a_ready", st.a.waitReady(t, 2*time.Minute))
	timed("kafka_b_ready", st.b.waitReady(t, 2*time.Minute))
	for _, topic := range st.topics {
		st.a.createTopic(t, topic, ordersPartitions)
	}
	if twoWay {
		// Where the producers write while A is down.
		st.b.createTopic(t, "orders", ordersPartitions)
	}
	// The fleet's channel: one copy of every delivery, on B, which never
	// fails in these tests.
	var channelConfig map[string]string
	if o.appendTime {
		channelConfig = map[string]string{"message.timestamp.type": "LogAppendTime"}
	}
	st.b.createTopicWith(t, "delivered", ordersPartitions, channelConfig)

	if mirror {
		st.mm = startMirrorMakerWith(t, st.env, st.a, st.b, policy, twoWay, o.topics...)
		created := func(on *kafkaBroker, topic string) func() error {
			return func() error {
				if !st.mm.proc.running() {
					return fmt.Errorf("MirrorMaker 2 exited: %v", st.mm.proc.err)
				}
				ends, err := endOffsets(on.addr, topic)
				if err != nil {
					return err
				}
				if len(ends) != ordersPartitions {
					return fmt.Errorf("%s on %s has %d partitions", topic, on.name, len(ends))
				}
				return nil
			}
		}
		waitFor(t, 2*time.Minute, "MirrorMaker 2 creates "+policy.remote+" on B", created(st.b, policy.remote))
		timed("mirrormaker_topic_on_b", time.Since(st.mm.began))
		for _, topic := range o.topics {
			remote := policy.remoteOf(topic)
			waitFor(t, time.Minute, "MirrorMaker 2 creates "+remote+" on B", created(st.b, remote))
		}
		if twoWay {
			waitFor(t, time.Minute, "MirrorMaker 2 creates B.orders on A", created(st.a, "B.orders"))
			timed("mirrormaker_topic_on_a", time.Since(st.mm.began))
		}
	}
	timed("stack_ready", time.Since(st.began))
	st.tl = startTimeline(t, st.etcd.endpoints())
	return st
}

// agentConfig is the configuration of the fleet's agents on the stack.
func (st *stack) agentConfig() agentConfig {
	// A's replication fields describe the flow back, B → A: its
	// offset-syncs are on A (the default name for that location,
	// mm2-offset-syncs.B.internal); the policy is B's.
	back := ""
	if st.twoWay {
		back = ", offset_syncs_on: target"
	}
	return agentConfig{
		Endpoints: st.etcd.endpoints(),
		Clusters: fmt.Sprintf(`  A: {brokers: [%s], role: primary, version: %q%s}
  B:
    brokers: [%s]
    role: standby
    version: %q
    replication_policy: %s
    source_alias: A
    offset_syncs_on: target
    offset_syncs_topic: %s
    checkpoints_topic: A.checkpoints.internal
`, st.a.addr, st.a.env.version, back, st.b.addr, st.b.env.version, st.policy.kswitch, st.policy.syncTopic),
		Source: fmt.Sprintf("  topics: [%s]\n  group: orders\n  initial_offset: oldest\n  refresh_interval: 2s\n  commit_interval: %s\n",
			strings.Join(st.topics, ", "), commitInterval),
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
	// Covers names the steps of the story it runs (README.md, Scenarios).
	Covers string `json:"covers,omitempty"`
	Passed bool   `json:"passed"`
	verdict
	// Timings in seconds, by step (see README.md).
	Timings map[string]float64 `json:"timings_seconds"`
	// Methods are the translation methods of each switch, by partition.
	Methods map[string][]string `json:"methods,omitempty"`
	// Details are findings of the scenario the columns do not hold, one
	// sentence each.
	Details []string `json:"details,omitempty"`
}

func newReport(name string) scenarioReport {
	return scenarioReport{Scenario: name, Timings: map[string]float64{}, Methods: map[string][]string{}}
}

// timer returns a function that records a step's duration in the report
// and logs it.
func (r *scenarioReport) timer(t *testing.T) func(step string, d time.Duration) {
	began := time.Now()
	var once sync.Once
	last := "none"
	return func(step string, d time.Duration) {
		r.Timings[step] = math.Round(d.Seconds()*1000) / 1000
		t.Logf("%-28s %v", step, d.Round(time.Millisecond))
		last = step
		once.Do(func() {
			// Runs before the log directory's recap (cleanups run last
			// first): the step a failed scenario reached.
			t.Cleanup(func() {
				if t.Failed() {
					recaps.add(t, "the last step reached was %s, %v into the scenario", last, time.Since(began).Round(time.Millisecond))
				}
			})
		})
	}
}

// moving waits until every partition's committed offset on A has gone past
// where it was when called (the fleet consumes all of them) and returns how
// long that took.
func (st *stack) moving(t *testing.T, what string, timeout time.Duration) time.Duration {
	t.Helper()
	began := time.Now()
	before := offsetsOf(st.tl.offsets("A", "orders"))
	waitFor(t, timeout, what, func() error {
		now := offsetsOf(st.tl.offsets("A", "orders"))
		for p := range int32(ordersPartitions) {
			if now[p] <= before[p] {
				return fmt.Errorf("orders/%d still at %d (all: %v)", p, now[p], now)
			}
		}
		return nil
	})
	return time.Since(began)
}

// relayed is what a fleet that stayed on A delivered, read back with kcat.
type relayed struct {
	verdict
	source    map[int32][]kRecord // orders on A
	delivered map[int32][]kRecord // the channel topic on B
}

// relayVerdict stops the producer, waits until the fleet has consumed all
// of A, reads A and the channel topic back with kcat and judges the
// deliveries of a fleet that never left A: the caller fails t unless
// verdict.ok(). It fails t when A does not hold exactly what the producer
// wrote, or two agents committed a partition in one generation.
func (st *stack) relayVerdict(t *testing.T, prod *producer) relayed {
	t.Helper()
	prod.finish(t, time.Minute)
	ends, err := endOffsets(st.a.addr, "orders")
	if err != nil {
		fatal(t, err)
	}
	waitFor(t, time.Minute, "the fleet consumes all of A", func() error { return st.tl.caughtUp("A", "orders", ends) })
	var r relayed
	if r.source, err = readTopic(st.a.addr, "orders"); err != nil {
		fatal(t, err)
	}
	if r.delivered, err = readTopic(st.b.addr, "delivered"); err != nil {
		fatal(t, err)
	}
	segs, err := segments(nil, func(string) string { return "orders" }, ordersPartitions, "A", offsetsOf(st.tl.offsets("A", "orders")))
	if err != nil {
		fatal(t, err)
	}
	handOvers := map[string]map[int32]map[int64]bool{"A": st.tl.handOvers("A", "orders")}
	if r.verdict, err = judge(segs, map[string]map[int32][]kRecord{"A": r.source}, r.delivered, nil, handOvers); err != nil {
		fatal(t, err)
	}
	t.Logf("verdict: %s", r.verdict)
	if r.Records != prod.count() {
		errorf(t, "%d distinct records on A, the producer wrote %d", r.Records, prod.count())
	}
	if dc := st.tl.doubleCommits(); len(dc) > 0 {
		errorf(t, "two agents committed one partition in one generation: %v", dc)
	}
	return r
}

package agent_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/record"
)

// traced is one record as a handler saw it.
type traced struct {
	id     string
	offset int64
	ts     time.Time
}

// trace keeps, per cluster and partition, the records handled there, to
// compare with the translations in history/.
type trace struct {
	mu   sync.Mutex
	recs map[string][]traced // "cluster/topic/partition"
}

func newTrace() *trace { return &trace{recs: map[string][]traced{}} }

func traceKey(cluster, topic string, partition int32) string {
	return fmt.Sprintf("%s/%s/%d", cluster, topic, partition)
}

// handler records r in the ledger and the trace, and acknowledges it.
func (tr *trace) handler(l *ledger, id string) record.Handler {
	return record.HandlerFunc(func(_ context.Context, r *record.Record) error {
		l.record(id, r)
		tr.mu.Lock()
		k := traceKey(r.Cluster, r.Topic, r.Partition)
		tr.recs[k] = append(tr.recs[k], traced{id: string(r.Value), offset: r.Offset, ts: r.Timestamp})
		tr.mu.Unlock()
		r.Ack()
		return nil
	})
}

// at returns the record handled at offset of a cluster's partition.
func (tr *trace) at(cluster, topic string, partition int32, offset int64) (traced, bool) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for _, r := range tr.recs[traceKey(cluster, topic, partition)] {
		if r.offset == offset {
			return r, true
		}
	}
	return traced{}, false
}

// within counts the distinct records handled on a cluster's partition
// before offset end whose timestamps are at or after from (millisecond
// precision, as Kafka stores them).
func (tr *trace) within(cluster, topic string, partition int32, end int64, from time.Time) int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	seen := map[int64]bool{}
	for _, r := range tr.recs[traceKey(cluster, topic, partition)] {
		if r.offset < end && r.ts.UnixMilli() >= from.UnixMilli() {
			seen[r.offset] = true
		}
	}
	return len(seen)
}

// stripFingerprints rewrites every committed position of cluster as it
// lands in etcd without its fingerprints, until the test ends. The rewrite
// is a transaction on the value's mod revision, so a newer commit is never
// overwritten with an older position. It returns how many it rewrote.
func stripFingerprints(t *testing.T, cli *clientv3.Client, cluster string) func() int {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var mu sync.Mutex
	n := 0
	done := make(chan struct{})
	prefix := fleetKeys.ClusterOffsets(cluster)
	wch := cli.Watch(ctx, prefix, clientv3.WithPrefix())
	go func() {
		defer close(done)
		for wr := range wch {
			for _, ev := range wr.Events {
				if ev.Type != clientv3.EventTypePut {
					continue
				}
				var v map[string]json.RawMessage
				if json.Unmarshal(ev.Kv.Value, &v) != nil {
					continue
				}
				if _, ok := v["fingerprints"]; !ok {
					continue
				}
				delete(v, "fingerprints")
				val, _ := json.Marshal(v)
				key := string(ev.Kv.Key)
				resp, err := cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(key), "=", ev.Kv.ModRevision)).
					Then(clientv3.OpPut(key, string(val))).Commit()
				if err == nil && resp.Succeeded {
					mu.Lock()
					n++
					mu.Unlock()
				}
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return func() int {
		mu.Lock()
		defer mu.Unlock()
		return n
	}
}

// TestFailoverWithoutFingerprints: the positions committed on A carry no
// fingerprints, as when they were written by a committer that does not
// keep them (an older kswitch during a rolling upgrade, an operator's
// reset). A stand-in strips them from every commit as it lands in etcd;
// the agents are untouched. The failover then falls back:
//
//   - timestamp: B is filled by a replicator that writes no offset-syncs.
//     Nothing mirrored before the failure is lost, and the records handled
//     twice are at most those within failover.timestamp_margin before
//     each partition's last consumed record;
//   - mm2: the replicator writes MirrorMaker 2 offset-syncs (on B, so they
//     stay readable while A is down). Nothing is lost, and the records
//     handled twice are at most what history/ says was rewound.
func TestFailoverWithoutFingerprints(t *testing.T) {
	t.Parallel()
	t.Run("timestamp", func(t *testing.T) { t.Parallel(); failoverWithoutFingerprints(t, false) })
	t.Run("mm2", func(t *testing.T) { t.Parallel(); failoverWithoutFingerprints(t, true) })
}

func failoverWithoutFingerprints(t *testing.T, offsetSyncs bool) {
	var opts []dcOption
	if !offsetSyncs {
		opts = append(opts, withoutOffsetSyncs())
	}
	d := startDC(t, opts...)
	cli := testenv.EtcdClientT(t, d.etcd)
	stripped := stripFingerprints(t, cli, "A")
	const margin = 500 * time.Millisecond
	l, tr, ho := newLedger(), newTrace(), newHandovers()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		cfg := d.config(id)
		cfg.Failover.TimestampMargin = margin
		agents = append(agents, startFleetAgent(t, cfg, agent.Options{Handler: ho.wrap(id, tr.handler(l, id))}))
	}
	waitConsuming(t, 20*time.Second, "A", agents...)
	p := startProducer(t, d.a.Brokers(), "orders", 0)
	// Records must span more than the margin for the bound to bite.
	wait.For(t, 60*time.Second, "records flowing for longer than the margin", func() error {
		if n := l.count(); n < 800 || d.mirror.Copied() < 800 {
			return fmt.Errorf("%d handled, %d mirrored", n, d.mirror.Copied())
		}
		return nil
	})

	cfg := d.config("x")
	d.a.Fail()
	took := waitConsuming(t, cfg.Failover.FailureWindow+agent.PushPullInterval+4*time.Second, "B", agents...)
	p.halt()
	t.Logf("failover: consuming B %v after A failed; %d commits on A stripped of their fingerprints", took, stripped())
	// The acceptance bound holds for the fallbacks too: the absent
	// MirrorMaker 2 topics are found absent by one metadata request each.
	// A view's lost UDP broadcast comes with the next push/pull
	// (TestFailoverToTheReplicaAndBack).
	if bound := cfg.Failover.FailureWindow + agent.PushPullInterval + time.Second; took > bound {
		t.Errorf("failover took %v, want <= failure window + push/pull interval + 1 s = %v", took, bound)
	}

	onB := idsOn(t, d.b, "A.orders")
	waitAllHandled(t, l, onB, 20*time.Second)

	evs := readHistory(t, cli)
	logEvents(t, evs)
	if len(evs) != 1 || evs[0].From != "A" || evs[0].To != "B" {
		t.Fatalf("history %+v, want one switch A→B", evs)
	}
	want := "timestamp"
	if offsetSyncs {
		want = "mm2"
	}
	bound := 0
	for _, ps := range evs[0].Partitions {
		if ps.Method != want {
			t.Errorf("%s/%d translated by %q, want %s (%s)", ps.Topic, ps.Partition, ps.Method, want, ps.Detail)
			continue
		}
		if offsetSyncs {
			// MirrorMaker 2's rule gives an upper bound of the rewind.
			t.Logf("%s/%d: A offset %d → B offset %d, rewound at most %d", ps.Topic, ps.Partition, ps.FromOffset, ps.ToOffset, ps.Rewound)
			if ps.Rewound < 0 {
				t.Errorf("%s/%d: mm2 translation with an unknown rewind: %s", ps.Topic, ps.Partition, ps.Detail)
			}
			bound += int(ps.Rewound)
			continue
		}
		last, ok := tr.at("A", ps.Topic, ps.Partition, ps.FromOffset-1)
		if !ok {
			t.Fatalf("%s/%d: the record before the committed offset %d was not handled on A", ps.Topic, ps.Partition, ps.FromOffset)
		}
		n := tr.within("A", ps.Topic, ps.Partition, ps.FromOffset, last.ts.Add(-margin))
		t.Logf("%s/%d: A offset %d → B offset %d; %d records within %v before the last consumed one",
			ps.Topic, ps.Partition, ps.FromOffset, ps.ToOffset, n, margin)
		bound += n
	}
	_, dups, _ := l.result(0)
	t.Logf("%d records mirrored before the failure, 0 lost, %d duplicates (bound %d)", len(onB), dups, bound)
	if dups > bound {
		t.Errorf("%d duplicates, more than the bound of %d", dups, bound)
	}
	if v, _ := metricValue(leaderOf(t, agents...), "kswitch_translation_total", map[string]string{"method": want}); v < failoverPartitions {
		t.Errorf("kswitch_translation_total{method=%s} = %v on the leader, want >= %d", want, v, failoverPartitions)
	}
	ho.check(t, l)
}

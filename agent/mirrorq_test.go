package agent

import (
	"fmt"
	"maps"
	"slices"
	"testing"

	"github.com/kswitch/kswitch/offsets"
)

// TestMirrorQueueKeepsTheNewestPositionsAndCluster: the queue of positions
// for the Kafka groups holds one job; merging keeps, per cluster and
// partition, the newer side's position; a cluster's batch through a
// connection replaced since is dropped, and a cluster only one side has is
// kept (a topic placed there). A failed job put back is the older side.
func TestMirrorQueueKeepsTheNewestPositionsAndCluster(t *testing.T) {
	t.Parallel()
	onA, onB, onA2 := &offsets.KafkaMirror{}, &offsets.KafkaMirror{}, &offsets.KafkaMirror{}
	var mirrors map[string]*offsets.KafkaMirror
	at := func(cluster string, offs ...int64) []offsets.Commit {
		var out []offsets.Commit
		for p, o := range offs {
			out = append(out, offsets.Commit{Cluster: cluster, Topic: "orders", Partition: int32(p), Offset: o})
		}
		return out
	}
	positions := func(j mirrorJob) map[string]int64 {
		m := map[string]int64{}
		for c, b := range j {
			for _, p := range b.commits {
				m[fmt.Sprintf("%s/%d", c, p.Partition)] = p.Offset
			}
			if b.mirror != mirrors[c] {
				m[c+" through another mirror"] = 1
			}
		}
		return m
	}
	for _, tc := range []struct {
		name         string
		queued, next mirrorJob
		retry        bool
		mirrors      map[string]*offsets.KafkaMirror
		want         map[string]int64
	}{
		{"fresh over queued, same cluster", mirrorJob{"A": {onA, at("A", 10, 20)}}, mirrorJob{"A": {onA, at("A", 15)}}, false,
			map[string]*offsets.KafkaMirror{"A": onA}, map[string]int64{"A/0": 15, "A/1": 20}},
		{"retry under queued, same cluster", mirrorJob{"A": {onA, at("A", 15)}}, mirrorJob{"A": {onA, at("A", 10, 20)}}, true,
			map[string]*offsets.KafkaMirror{"A": onA}, map[string]int64{"A/0": 15, "A/1": 20}},
		{"two clusters at once", mirrorJob{"A": {onA, at("A", 10, 20)}}, mirrorJob{"B": {onB, at("B", 7)}}, false,
			map[string]*offsets.KafkaMirror{"A": onA, "B": onB}, map[string]int64{"A/0": 10, "A/1": 20, "B/0": 7}},
		{"fresh through a new connection", mirrorJob{"A": {onA, at("A", 10, 20)}}, mirrorJob{"A": {onA2, at("A", 15)}}, false,
			map[string]*offsets.KafkaMirror{"A": onA2}, map[string]int64{"A/0": 15}},
		{"retry through an old connection", mirrorJob{"A": {onA2, at("A", 15)}}, mirrorJob{"A": {onA, at("A", 10, 20)}}, true,
			map[string]*offsets.KafkaMirror{"A": onA2}, map[string]int64{"A/0": 15}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mirrors = tc.mirrors
			w := &worker{mirrorq: make(chan mirrorJob, 1)}
			w.mirrorq <- tc.queued
			w.enqueueMirror(tc.next, tc.retry)
			got := <-w.mirrorq
			if !maps.Equal(positions(got), tc.want) {
				t.Errorf("queued %v; want %v", positions(got), tc.want)
			}
			n := 0
			for _, b := range got {
				n += len(b.commits)
			}
			if len(slices.Collect(maps.Keys(positions(got)))) != n {
				t.Errorf("%d commits for %d partitions", n, len(positions(got)))
			}
		})
	}
}

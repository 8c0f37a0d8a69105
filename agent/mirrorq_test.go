package agent

import (
	"maps"
	"slices"
	"testing"

	"github.com/kswitch/kswitch/offsets"
)

// TestMirrorQueueKeepsTheNewestPositionsAndCluster: the queue of positions
// for the Kafka group holds one job; merging keeps, per partition, the
// newer side's position, and after a switch only the newer cluster's
// positions with its client. A failed job put back is the older side.
func TestMirrorQueueKeepsTheNewestPositionsAndCluster(t *testing.T) {
	onA, onB := &offsets.KafkaMirror{}, &offsets.KafkaMirror{}
	at := func(cluster string, offs ...int64) []offsets.Commit {
		var out []offsets.Commit
		for p, o := range offs {
			out = append(out, offsets.Commit{Cluster: cluster, Topic: "orders", Partition: int32(p), Offset: o})
		}
		return out
	}
	positions := func(j mirrorJob) map[int32]int64 {
		m := map[int32]int64{}
		for _, c := range j.commits {
			m[c.Partition] = c.Offset
		}
		return m
	}
	for _, tc := range []struct {
		name         string
		queued, next mirrorJob
		retry        bool
		mirror       *offsets.KafkaMirror
		want         map[int32]int64
	}{
		{"fresh over queued, same cluster", mirrorJob{onA, at("A", 10, 20)}, mirrorJob{onA, at("A", 15)}, false, onA, map[int32]int64{0: 15, 1: 20}},
		{"retry under queued, same cluster", mirrorJob{onA, at("A", 15)}, mirrorJob{onA, at("A", 10, 20)}, true, onA, map[int32]int64{0: 15, 1: 20}},
		{"fresh after a switch", mirrorJob{onA, at("A", 10, 20)}, mirrorJob{onB, at("B", 7)}, false, onB, map[int32]int64{0: 7}},
		{"retry of the old cluster after a switch", mirrorJob{onB, at("B", 7)}, mirrorJob{onA, at("A", 10, 20)}, true, onB, map[int32]int64{0: 7}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := &worker{mirrorq: make(chan mirrorJob, 1)}
			w.mirrorq <- tc.queued
			w.enqueueMirror(tc.next, tc.retry)
			got := <-w.mirrorq
			if got.mirror != tc.mirror || !maps.Equal(positions(got), tc.want) {
				t.Errorf("queued %v through mirror %p; want %v through %p", positions(got), got.mirror, tc.want, tc.mirror)
			}
			if n := len(slices.Collect(maps.Keys(positions(got)))); n != len(got.commits) {
				t.Errorf("%d commits for %d partitions", len(got.commits), n)
			}
		})
	}
}

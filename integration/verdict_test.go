//go:build integration

package integration

import (
	"fmt"
	"maps"
	"slices"
	"sort"
	"testing"
	"time"
)

// How the suite decides, from outside kswitch, that no record was lost and
// none delivered twice (integration/README.md explains it):
//
//  1. Deliveries. The agents route every record they consume to the
//     channel "delivered", a topic on B (which never fails in these
//     tests); the router acknowledges a record only once B has it, and the
//     agents commit only acknowledged records. So the channel topic, read
//     back with kcat, holds one copy per delivery: every id on A must be
//     there (lost otherwise), and an id there twice was delivered twice.
//  2. Positions. The agents commit, per partition, the offset just past
//     the records acknowledged, and a switch records in history/ the
//     committed offset it left on the old cluster (from_offset) and the
//     translated one it starts at on the new cluster (to_offset). So the
//     fleet delivered, per partition, [0, from₁) on A, [to₁, from₂) on B, …
//     and [toₙ, final) on the last cluster. Reading A and B back turns the
//     ranges into ids. They must match the deliveries of (1) id for id (a
//     redelivery the commits do not show, or a committed range that was
//     never delivered, would differ), and they say where a duplicate came
//     from: one allowed kind is a record consumed on A that had not reached
//     B when A failed, consumed again on B once MirrorMaker 2 copied it.

// segment says the fleet delivered the records [From, To) of
// Topic/Partition on Cluster.
type segment struct {
	// Logical is the logical topic (the name on A) whose partition the
	// segment is of: a partition number names one stream per topic.
	Logical string
	// Origin is the cluster whose producers write the physical topic (a
	// stream: A's orders and its copy A.orders on B are one), when a
	// scenario has producers on both; empty otherwise.
	Origin    string
	Cluster   string
	Topic     string
	Partition int32
	From, To  int64
}

// segments derives the delivered ranges of each partition from the switch
// events (oldest first) and the final committed offsets on the cluster the
// fleet ends on. topicOn names the logical topic on a cluster.
func segments(events []switchEvent, topicOn func(cluster string) string, partitions int32, last string, final map[int32]int64) ([]segment, error) {
	return streamSegments(events, "", topicOn, partitions, last, final)
}

// streamSegments is segments for the stream written on origin (the
// partitions of the switch events with that origin), or for the only one
// when origin is empty. topicOn names the stream's physical topic on a
// cluster.
func streamSegments(events []switchEvent, origin string, topicOn func(cluster string) string, partitions int32, last string, final map[int32]int64) ([]segment, error) {
	return topicSegments(events, "orders", origin, topicOn, partitions, last, final)
}

// topicSegments is streamSegments for the logical topic logical: the
// switches that moved it are those of the fleet (history entries without
// topics) and its own topic switches (with logical among their topics);
// a topic switch of other topics left it where it was, consumed. last is
// the cluster it ends on.
func topicSegments(events []switchEvent, logical, origin string, topicOn func(cluster string) string, partitions int32, last string, final map[int32]int64) ([]segment, error) {
	var out []segment
	for p := range partitions {
		cur, start := "A", int64(0) // source.initial_offset oldest on a new topic
		for _, ev := range events {
			if len(ev.Topics) > 0 && !slices.Contains(ev.Topics, logical) {
				continue
			}
			if ev.From != cur {
				return nil, fmt.Errorf("switch %d leaves %s, but the fleet was on %s", ev.Epoch, ev.From, cur)
			}
			i := slices.IndexFunc(ev.Partitions, func(ps partitionSwitch) bool {
				return ps.Topic == logical && ps.Partition == p && (origin == "" || ps.Origin == origin)
			})
			if i < 0 {
				return nil, fmt.Errorf("switch %d has no translation for %s/%d (written on %q)", ev.Epoch, logical, p, origin)
			}
			ps := ev.Partitions[i]
			if ps.FromOffset >= 0 {
				out = append(out, segment{Logical: logical, Origin: origin, Cluster: cur, Topic: topicOn(cur), Partition: p, From: start, To: ps.FromOffset})
			} else if start != 0 {
				return nil, fmt.Errorf("switch %d: %s/%d (written on %q) had no committed position on %s, yet the fleet started it at %d", ev.Epoch, logical, p, origin, cur, start)
			}
			cur, start = ev.To, max(ps.ToOffset, 0)
		}
		if cur != last {
			return nil, fmt.Errorf("the switch events end on %s, the fleet is on %s", cur, last)
		}
		end, ok := final[p]
		if !ok {
			end = start
		}
		out = append(out, segment{Logical: logical, Origin: origin, Cluster: cur, Topic: topicOn(cur), Partition: p, From: start, To: end})
	}
	return out, nil
}

// delivery is one record as the fleet delivered it, by position.
type delivery struct {
	Segment int // index of its stream partition's segment: 0 before the first switch
	segment
	Offset int64
	Value  string
}

// verdict is the outcome of one scenario.
type verdict struct {
	// Records is the number of distinct records on A at the end: everything
	// the outside producer wrote.
	Records int `json:"records"`
	// Delivered counts the records in the channel topic.
	Delivered int `json:"delivered"`
	// Lost lists ids on A that were never delivered (at most 20).
	Lost      []string `json:"lost,omitempty"`
	LostCount int      `json:"lost_count"`
	// Duplicates counts extra deliveries; DuplicatesUnreplicated and
	// DuplicatesHandOver those that are allowed: records consumed on A that
	// had not reached B when A failed, delivered again from B after
	// MirrorMaker 2 copied them later; and records an agent delivered after
	// its last commit, delivered again by the partition's next owner (at
	// least once: after a kill, or an etcd session that expired).
	Duplicates             int      `json:"duplicates"`
	DuplicatesUnreplicated int      `json:"duplicates_unreplicated"`
	DuplicatesHandOver     int      `json:"duplicates_hand_over"`
	BadDuplicates          []string `json:"bad_duplicates,omitempty"`
	// ByPosition counts the deliveries the committed ranges account for;
	// PositionMismatch lists ids delivered a different number of times
	// than the ranges say (at most 20).
	ByPosition       int      `json:"by_position"`
	PositionMismatch []string `json:"position_mismatch,omitempty"`
}

func (v verdict) ok() bool {
	return v.LostCount == 0 && len(v.BadDuplicates) == 0 && len(v.PositionMismatch) == 0
}

// verdictHolds records v in rep, logs it, and fails t when a record was
// lost, a duplicate is not explained (unexplained names what counts as
// explained), a delivery is not in the committed ranges, or two agents
// committed one partition in one generation (tl).
func verdictHolds(t *testing.T, rep *scenarioReport, v verdict, tl *timeline, unexplained string) {
	t.Helper()
	rep.verdict = v
	t.Logf("verdict: %s", v)
	if !v.ok() {
		errorf(t, "lost %v (%d); %s %v; deliveries the committed ranges do not explain %v", v.Lost, v.LostCount, unexplained, v.BadDuplicates, v.PositionMismatch)
	}
	if dc := tl.doubleCommits(); len(dc) > 0 {
		errorf(t, "two agents committed one partition in one generation: %v", dc)
	}
}

// readDelivered waits until the channel topic "delivered" on k holds at
// least n records (every delivery reached it: the router acknowledges
// only what the channel's cluster has, so this is a formality) and reads
// it back.
func readDelivered(t *testing.T, k *kafkaBroker, n int) map[int32][]kRecord {
	t.Helper()
	waitFor(t, 30*time.Second, "every delivery is in the channel topic", func() error {
		ends, err := endOffsets(k.addr, "delivered")
		if err != nil {
			return err
		}
		if sum(ends) < int64(n) {
			return fmt.Errorf("delivered holds %d records, %d were written", sum(ends), n)
		}
		return nil
	})
	delivered, err := readTopic(k.addr, "delivered")
	if err != nil {
		fatal(t, err)
	}
	return delivered
}

// redeliverableFrom returns, per partition of the copy of A's topic on B
// (toTopic), the offset on B from which a record the fleet consumed on A
// before the failover may be consumed again from B: B's end when A failed
// (replicatedAtFault: what B lacked then, copied later), or lower, the
// offset the failover translated to when it declared a rewind (a method
// other than fingerprint: the offset-syncs or a timestamp, which continue
// at or before the position, never after). Both are what the product says
// it does at least once; a record only counts if A's segment consumed it,
// which bounds it by the position the failover translated.
func redeliverableFrom(replicatedAtFault map[int32]int64, failover switchEvent, toTopic string) map[int32]int64 {
	out := maps.Clone(replicatedAtFault)
	if out == nil {
		out = map[int32]int64{}
	}
	for _, ps := range failover.Partitions {
		if ps.ToTopic != toTopic || ps.Method == "fingerprint" {
			continue
		}
		if end, ok := out[ps.Partition]; !ok || ps.ToOffset < end {
			out[ps.Partition] = ps.ToOffset
		}
	}
	return out
}

// judge computes the verdict. content holds what kcat read back of the
// source topic on each cluster; delivered the channel topic;
// replicatedAtFault is, per partition, the offset on B from which a record
// consumed on A may be delivered again from B (redeliverableFrom); handOvers the
// offsets at which each partition changed owner, by cluster
// (timeline.handOvers). Every record on A must be delivered.
func judge(segs []segment, content map[string]map[int32][]kRecord, delivered map[int32][]kRecord, replicatedAtFault map[int32]int64,
	handOvers map[string]map[int32]map[int64]bool) (verdict, error) {
	in := judgeInput{
		segs: segs, content: map[physical]map[int32][]kRecord{}, written: map[string]bool{}, delivered: delivered,
		handOvers: map[physical]map[int32]map[int64]bool{},
		// A record consumed on A that had not reached B when A failed,
		// consumed again on B once MirrorMaker 2 copied it, or one the
		// failover declared rewound.
		unreplicated: func(ds []delivery) bool {
			return len(ds) == 2 && ds[0].Segment == 0 && ds[0].Cluster == "A" && ds[1].Segment == 1 && ds[1].Cluster == "B" &&
				ds[1].Offset >= replicatedAtFault[ds[1].Partition]
		},
	}
	for _, recs := range content["A"] {
		for _, r := range recs {
			in.written[r.Value] = true
		}
	}
	for _, s := range segs {
		pt := physical{s.Cluster, s.Topic}
		in.content[pt] = content[s.Cluster]
		in.handOvers[pt] = handOvers[s.Cluster]
	}
	return judgeStreams(in)
}

// physical is a physical topic on a cluster.
type physical struct{ Cluster, Topic string }

// judgeInput is what judgeStreams decides on.
type judgeInput struct {
	// segs are the committed ranges (segments, streamSegments).
	segs []segment
	// content is what kcat read back of each physical topic the segments
	// name.
	content map[physical]map[int32][]kRecord
	// written are the values every one of which must be delivered: what
	// the producers wrote, read back from the topics they wrote.
	written map[string]bool
	// delivered is the channel topic read back.
	delivered map[int32][]kRecord
	// unreplicated reports whether the deliveries of a record delivered
	// twice, both held by the committed ranges (in segment order), are an
	// allowed duplicate: a record the target of a switch lacked at the
	// switch, delivered again once the replicator copied it.
	unreplicated func(ds []delivery) bool
	// handOvers are the offsets at which each partition changed owner
	// (timeline.handOvers), by physical topic.
	handOvers map[physical]map[int32]map[int64]bool
}

// judgeStreams computes the verdict: a written value missing from the
// channel is lost; a value delivered more often than the committed ranges
// hold it must be part of a run redelivered from a hand-over; one the
// ranges hold twice must be an allowed unreplicated duplicate.
func judgeStreams(in judgeInput) (verdict, error) {
	var v verdict
	v.Records = len(in.written)

	got := map[string]int{}
	for _, recs := range in.delivered {
		for _, r := range recs {
			got[r.Value]++
			v.Delivered++
		}
	}

	// The deliveries the committed ranges account for.
	type streamPartition struct {
		logical, origin string
		partition       int32
	}
	byID := map[string][]delivery{}
	nth := map[streamPartition]int{}
	for _, s := range in.segs {
		sp := streamPartition{s.Logical, s.Origin, s.Partition}
		idx := nth[sp]
		nth[sp]++
		recs := in.content[physical{s.Cluster, s.Topic}][s.Partition]
		if s.To > s.From && (len(recs) == 0 || recs[len(recs)-1].Offset < s.To-1) {
			return v, fmt.Errorf("the fleet committed %s %s/%d up to %d, past the records kcat read back (%d)", s.Cluster, s.Topic, s.Partition, s.To, len(recs))
		}
		for _, r := range recs {
			if r.Offset < s.From || r.Offset >= s.To {
				continue
			}
			byID[r.Value] = append(byID[r.Value], delivery{Segment: idx, segment: s, Offset: r.Offset, Value: r.Value})
			v.ByPosition++
		}
	}

	for _, id := range sortedKeys(in.written) {
		if got[id] == 0 {
			v.LostCount++
			if len(v.Lost) < 20 {
				v.Lost = append(v.Lost, id)
			}
		}
	}
	// Extra deliveries the committed ranges do not hold: a partition handed
	// to its next owner, which consumed again from the last commit. They
	// are placed by the one delivery the ranges hold, and must form runs of
	// offsets that each start where the partition was handed over.
	type place struct {
		physical
		partition int32
	}
	redelivered := map[place]map[int64]int{} // offset → extra deliveries
	for _, id := range sortedKeys(got) {
		ds := byID[id]
		extra := got[id] - len(ds)
		switch {
		case extra > 0 && len(ds) == 1:
			pl := place{physical{ds[0].Cluster, ds[0].Topic}, ds[0].Partition}
			if redelivered[pl] == nil {
				redelivered[pl] = map[int64]int{}
			}
			redelivered[pl][ds[0].Offset] = extra
		case extra != 0 && len(v.PositionMismatch) < 20:
			v.PositionMismatch = append(v.PositionMismatch, fmt.Sprintf("%s delivered %d times, the committed ranges hold it %d times: %+v", id, got[id], len(ds), ds))
		}
		if got[id] < 2 {
			continue
		}
		v.Duplicates += got[id] - 1
		if len(ds) < 2 {
			continue // judged below, as a hand-over
		}
		if got[id] == len(ds) && in.unreplicated != nil && in.unreplicated(ds) {
			v.DuplicatesUnreplicated++
			continue
		}
		if len(v.BadDuplicates) < 20 {
			v.BadDuplicates = append(v.BadDuplicates, fmt.Sprintf("%s delivered %d times: %+v", id, got[id], ds))
		}
	}
	for pl, extra := range redelivered {
		offsets := slices.Sorted(maps.Keys(extra))
		for i, o := range offsets {
			if i > 0 && offsets[i-1] == o-1 {
				continue // inside a run
			}
			run := 1
			for i+run < len(offsets) && offsets[i+run] == o+int64(run) {
				run++
			}
			n := 0
			for _, x := range offsets[i : i+run] {
				n += extra[x]
			}
			if in.handOvers[pl.physical][pl.partition][o] {
				v.DuplicatesHandOver += n
				continue
			}
			if len(v.BadDuplicates) < 20 {
				v.BadDuplicates = append(v.BadDuplicates, fmt.Sprintf("%s %s/%d: %d records from offset %d delivered again, but the partition was not handed over there (hand-overs at %v)",
					pl.Cluster, pl.Topic, pl.partition, run, o, slices.Sorted(maps.Keys(in.handOvers[pl.physical][pl.partition]))))
			}
		}
	}
	return v, nil
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// String is the verdict in one line.
func (v verdict) String() string {
	return fmt.Sprintf("%d records, %d delivered, %d lost, %d duplicates (%d of records not yet replicated at the fault or declared rewound, %d after a hand-over); "+
		"the committed ranges account for %d deliveries, %d ids differ, %d duplicates unexplained",
		v.Records, v.Delivered, v.LostCount, v.Duplicates, v.DuplicatesUnreplicated, v.DuplicatesHandOver, v.ByPosition,
		len(v.PositionMismatch), len(v.BadDuplicates))
}

// recs returns records of partition p at offsets from, from+1, … with the
// suite's values r<n> for the numbers ns.
func recs(p int32, from int64, ns ...int) []kRecord {
	var out []kRecord
	for i, n := range ns {
		out = append(out, kRecord{Partition: p, Offset: from + int64(i), Key: fmt.Sprintf("k%07d", n), Value: fmt.Sprintf("r%07d", n)})
	}
	return out
}

// TestJudge checks the verdict on made-up reads: a record missing from
// the channel is lost and fails the scenario; a duplicate is allowed only
// when it is a record B did not have at the fault or the failover declared
// rewound, delivered on A and again on B, or one of a run delivered again
// from where the partition changed owner.
func TestJudge(t *testing.T) {
	onA := map[string]map[int32][]kRecord{"A": {0: recs(0, 0, 0, 1, 2, 3, 4)}}
	onlyA := []segment{{Cluster: "A", Topic: "orders", Partition: 0, From: 0, To: 5}}
	v, err := judge(onlyA, onA, map[int32][]kRecord{0: recs(0, 0, 0, 1, 1, 3, 4)}, nil, nil)
	if err != nil {
		fatal(t, err)
	}
	if v.ok() || v.LostCount != 1 || v.Lost[0] != "r0000002" || v.Duplicates != 1 || len(v.BadDuplicates) != 1 {
		errorf(t, "r2 lost and r1 delivered twice: %s, lost %v, bad duplicates %v, ok %v", v, v.Lost, v.BadDuplicates, v.ok())
	}

	// An owner delivered r1 and r2 after committing offset 1; the next
	// one consumed again from there.
	again := map[int32][]kRecord{0: recs(0, 0, 0, 1, 2, 1, 2, 3, 4)}
	handOver := func(o int64) map[string]map[int32]map[int64]bool {
		return map[string]map[int32]map[int64]bool{"A": {0: {o: true}}}
	}
	if v, err := judge(onlyA, onA, again, nil, handOver(1)); err != nil || !v.ok() || v.DuplicatesHandOver != 2 {
		errorf(t, "r1, r2 delivered again from a hand-over at offset 1: %s (bad %v), %v", v, v.BadDuplicates, err)
	}
	if v, err := judge(onlyA, onA, again, nil, handOver(2)); err != nil || v.ok() || len(v.BadDuplicates) != 1 {
		errorf(t, "r1, r2 delivered again, the hand-over was at offset 2: %s, ok %v, %v", v, v.ok(), err)
	}

	// A failover: the fleet delivered r0..r2 from A, then B from offset 2
	// (r2 again, which B got only after the fault) to the end.
	content := map[string]map[int32][]kRecord{"A": {0: recs(0, 0, 0, 1, 2, 3)}, "B": {0: recs(0, 0, 0, 1, 2, 3)}}
	segs := []segment{{Cluster: "A", Topic: "orders", Partition: 0, From: 0, To: 3}, {Cluster: "B", Topic: "A.orders", Partition: 0, From: 2, To: 4}}
	delivered := map[int32][]kRecord{0: recs(0, 0, 0, 1, 2, 2, 3)}
	if v, err := judge(segs, content, delivered, map[int32]int64{0: 2}, nil); err != nil || !v.ok() || v.DuplicatesUnreplicated != 1 {
		errorf(t, "r2 unreplicated at the fault, delivered from A and from B: %s (bad %v), %v", v, v.BadDuplicates, err)
	}
	if v, err := judge(segs, content, delivered, map[int32]int64{0: 3}, nil); err != nil || v.ok() || len(v.BadDuplicates) != 1 {
		errorf(t, "r2 on B at the fault, delivered from A and from B: %s, ok %v, %v", v, v.ok(), err)
	}
	// The same with r2 on B at the fault, but the failover translated by
	// the offset-syncs to offset 2 (a declared rewind): r2 again is what
	// the product says it does at least once. By fingerprint it is not.
	rewound := switchEvent{Partitions: []partitionSwitch{{ToTopic: "A.orders", Partition: 0, FromOffset: 3, ToOffset: 2, Method: "mm2", Rewound: -1}}}
	if v, err := judge(segs, content, delivered, redeliverableFrom(map[int32]int64{0: 3}, rewound, "A.orders"), nil); err != nil || !v.ok() || v.DuplicatesUnreplicated != 1 {
		errorf(t, "r2 on B at the fault, translated by the offset-syncs to offset 2, delivered from A and from B: %s (bad %v), %v", v, v.BadDuplicates, err)
	}
	exact := switchEvent{Partitions: []partitionSwitch{{ToTopic: "A.orders", Partition: 0, FromOffset: 3, ToOffset: 2, Method: "fingerprint"}}}
	if v, err := judge(segs, content, delivered, redeliverableFrom(map[int32]int64{0: 3}, exact, "A.orders"), nil); err != nil || v.ok() || len(v.BadDuplicates) != 1 {
		errorf(t, "r2 on B at the fault, translated by fingerprint, delivered from A and from B: %s, ok %v, %v", v, v.ok(), err)
	}
	// A delivery no committed range holds.
	if v, err := judge(segs, content, map[int32][]kRecord{0: recs(0, 0, 0, 1, 2, 2, 3, 5)}, map[int32]int64{0: 2}, nil); err != nil || v.ok() || len(v.PositionMismatch) != 1 {
		errorf(t, "r5 delivered, no range holds it: %s, ok %v, %v", v, v.ok(), err)
	}
}

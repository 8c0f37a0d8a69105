package agent

import (
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/record"
)

// TestTrackerPositionFingerprintsTheLastAckedRecords checks that the
// committable position moves past the longest acknowledged prefix only,
// and that its fingerprints are those of the last offsets.MaxFingerprints
// records before it, in offset order, whatever the order of the acks.
func TestTrackerPositionFingerprintsTheLastAckedRecords(t *testing.T) {
	t.Parallel()
	const start, n = 100, 30
	tr := newTracker(start, n)
	ts := time.UnixMilli(1_700_000_000_000)
	recs := make([]*delivery, n)
	want := make([]offsets.Fingerprint, n)
	for i := range recs {
		r := &delivery{rec: record.Record{Offset: start + int64(i), Key: []byte("k" + strconv.Itoa(i)), Value: []byte("v" + strconv.Itoa(i)), Timestamp: ts.Add(time.Duration(i) * time.Millisecond)}}
		want[i] = offsets.FingerprintOf(r.rec.Key, r.rec.Value, r.rec.Timestamp)
		if tr.deliver(r) != nil {
			t.Fatalf("record %d of %d refused", i+1, n)
		}
		recs[i] = r
	}
	check := func(step string, next int64, fps []offsets.Fingerprint) {
		t.Helper()
		gotNext, gotTS, gotFPs := tr.position()
		if gotNext != next || !slices.Equal(gotFPs, fps) {
			t.Fatalf("%s: position %d %v, want %d %v", step, gotNext, gotFPs, next, fps)
		}
		if next > start && !gotTS.Equal(recs[next-start-1].rec.Timestamp) {
			t.Fatalf("%s: timestamp %v, want that of offset %d", step, gotTS, next-1)
		}
	}
	check("nothing acked", start, nil)

	recs[1].Ack() // not a prefix: nothing moves
	check("offset 101 acked", start, nil)
	recs[0].Ack()
	check("offsets 100-101 acked", start+2, want[:2])

	// Ack 2..19 in reverse, then again (ignored): the prefix reaches 120.
	for i := 19; i >= 2; i-- {
		recs[i].Ack()
	}
	recs[5].Ack()
	check("offsets 100-119 acked", start+20, want[20-offsets.MaxFingerprints:20])

	for i := 20; i < n; i++ {
		recs[i].Ack()
		check("offset "+strconv.Itoa(start+i)+" acked", start+int64(i)+1, want[max(0, i+1-offsets.MaxFingerprints):i+1])
	}
	if u := tr.unacked(); u != 0 {
		t.Fatalf("%d unacked after every ack", u)
	}
	if !tr.waitDrained(time.Second) {
		t.Fatal("not drained after every ack")
	}
}

// TestTrackerLetsGoOfPassedChunks: once the committable position passes a
// chunk's last record, its records no longer hold the fetched bytes (their
// keys, values and headers are dropped, so the response they slice is
// freed), while a chunk not yet passed keeps them, and the position's
// fingerprints are still those of the records' contents.
func TestTrackerLetsGoOfPassedChunks(t *testing.T) {
	t.Parallel()
	const start, per = 0, 5
	tr := newTracker(start, 100)
	ts := time.UnixMilli(1_700_000_000_000)
	var want []offsets.Fingerprint
	chunks := make([]*chunkRef, 3)
	for c := range chunks {
		ref := &chunkRef{ds: make([]delivery, per)}
		ref.left.Store(per + 1) // no Fetcher behind it: never released to one

		for i := range ref.ds {
			o := start + int64(c*per+i)
			d := &ref.ds[i]
			d.chunk = ref
			d.rec = record.Record{Offset: o, Key: []byte("k" + strconv.FormatInt(o, 10)), Value: []byte("v" + strconv.FormatInt(o, 10)),
				Headers: []record.Header{{Key: []byte("h"), Value: []byte("x")}}, Timestamp: ts.Add(time.Duration(o) * time.Millisecond)}
			want = append(want, offsets.FingerprintOf(d.rec.Key, d.rec.Value, d.rec.Timestamp))
			if tr.deliver(d) != nil {
				t.Fatalf("record %d refused", o)
			}
		}
		chunks[c] = ref
	}
	holds := func(ref *chunkRef) (n int) {
		for i := range ref.ds {
			if r := &ref.ds[i].rec; r.Key != nil || r.Value != nil || r.Headers != nil {
				n++
			}
		}
		return n
	}
	// Chunk 1 acknowledged whole, chunk 0 all but its first record: no
	// position moves, every record keeps its bytes.
	for i := 1; i < 2*per; i++ {
		chunks[i/per].ds[i%per].Ack()
	}
	for c, ref := range chunks {
		if n := holds(ref); n != per {
			t.Fatalf("chunk %d: %d of %d records hold their bytes before the position passed any", c, n, per)
		}
	}
	chunks[0].ds[0].Ack() // the position passes chunks 0 and 1
	if n := holds(chunks[0]) + holds(chunks[1]); n != 0 {
		t.Errorf("%d records of the passed chunks still hold their bytes", n)
	}
	if n := holds(chunks[2]); n != per {
		t.Errorf("chunk 2, not acknowledged: %d of %d records hold their bytes", n, per)
	}
	next, _, fps := tr.position()
	if next != start+2*per || !slices.Equal(fps, want[2*per-offsets.MaxFingerprints:2*per]) {
		t.Errorf("position %d %v, want %d %v", next, fps, start+2*per, want[2*per-offsets.MaxFingerprints:2*per])
	}
	for i := range per {
		chunks[2].ds[i].Ack()
	}
	if n := holds(chunks[2]); n != 0 {
		t.Errorf("chunk 2 passed: %d records still hold their bytes", n)
	}
	if next, _, fps := tr.position(); next != start+3*per || !slices.Equal(fps, want[3*per-offsets.MaxFingerprints:]) {
		t.Errorf("position %d %v, want %d %v", next, fps, start+3*per, want[3*per-offsets.MaxFingerprints:])
	}
}

// TestTrackerBoundsRecordsNotAcknowledged checks that a tracker takes at
// most its bound of records not acknowledged, and makes room at the next
// ack, in any order.
func TestTrackerBoundsRecordsNotAcknowledged(t *testing.T) {
	t.Parallel()
	const bound = 3
	tr := newTracker(0, bound)
	recs := make([]*delivery, bound+2)
	for i := range recs {
		recs[i] = &delivery{rec: record.Record{Offset: int64(i)}}
	}
	for i := range bound {
		if tr.deliver(recs[i]) != nil {
			t.Fatalf("record %d refused below the bound", i)
		}
	}
	full := tr.deliver(recs[bound])
	if full == nil {
		t.Fatalf("record %d taken beyond the bound of %d", bound, bound)
	}
	if again := tr.deliver(recs[bound]); again != full {
		t.Fatal("a second refusal waits on another channel")
	}
	select {
	case <-full:
		t.Fatal("room made before any ack")
	default:
	}
	recs[1].Ack() // out of order: no commit progress, but room
	select {
	case <-full:
	default:
		t.Fatal("no room after an ack")
	}
	if tr.deliver(recs[bound]) != nil {
		t.Fatal("refused after an ack made room")
	}
	if tr.deliver(recs[bound+1]) == nil {
		t.Fatal("taken beyond the bound after the room was used")
	}
	if next, _, _ := tr.position(); next != 0 {
		t.Fatalf("position %d, want 0: offset 0 is not acknowledged", next)
	}
}

// TestByteBudgetBoundsTheBytesInFlight: the Fetchers share the agent's
// byte budget (kafka.Budget); a fetch waits while the budget has no room
// for it, until bytes are given back; a fetch larger than the whole
// budget passes when nothing is held, so that it cannot wait for ever.
func TestByteBudgetBoundsTheBytesInFlight(t *testing.T) {
	t.Parallel()
	b := newByteBudget(100)
	b.Charge(60)
	if b.Room(30) != nil {
		t.Fatal("no room for 30 bytes with 60 of 100 held")
	}
	b.Charge(30)
	wait := b.Room(20)
	if wait == nil {
		t.Fatal("room for 20 bytes with 90 of 100 held")
	}
	b.Give(60)
	select {
	case <-wait:
	default:
		t.Fatal("bytes given back did not wake the fetch waiting for room")
	}
	if b.Room(20) != nil || b.inUse() != 30 {
		t.Fatalf("after 60 given back: in use %d, want 30, and room for 20", b.inUse())
	}
	b.Give(30)
	if b.Room(500) != nil {
		t.Fatal("a fetch larger than the budget waits with nothing held")
	}
	b.Charge(500)
	if b.Room(1) == nil {
		t.Fatal("room beside a response larger than the budget")
	}
}

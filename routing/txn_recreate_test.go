package routing

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/kswitch/kswitch/config"
)

// offerTopic hands the owner the records [from, to) of A's orders/0 as a
// topic of id id holds them, with values tag+offset.
func (o *eosOwner) offerTopic(t *testing.T, id, tag string, from, to int64) {
	t.Helper()
	for off := from; off < to; off++ {
		rec := testRecord("orders", 0, off, fmt.Sprint(tag, off))
		rec.Origin, rec.TopicID, rec.Generation, rec.Session = "A", id, o.gen, o.gen
		if err := deliver(t.Context(), o.r, rec, 30*time.Second); err != nil {
			t.Fatal(err)
		}
	}
}

// TestExactlyOnceATopicCreatedAgainIsNotCovered: A's orders is deleted and
// created again (a new topic id, offsets from 0) after transactions
// delivered its offsets up to 150. The stream's position says 150 is done
// on A's orders/0: of the old topic only. The records of the new one are
// delivered, none skipped as done, by the owner that saw the old topic and
// by a next owner that reads the position back; within the new topic a
// next owner skips what was delivered of it. Before, the new topic's
// offsets 0-149 were skipped as delivered: lost.
func TestExactlyOnceATopicCreatedAgainIsNotCovered(t *testing.T) {
	t.Parallel()
	w := eosWorld(t)
	first := w.owner(1, 50*time.Millisecond)
	first.offerTopic(t, "id-1", "old-", 0, 150)
	first.waitAcked(t, 150)
	first.close(t, false)

	// The next owner resumes the old topic from 100 (etcd behind): 50
	// skipped. Then the topic is created again: 0-99 of the new one.
	second := w.owner(2, 50*time.Millisecond)
	second.offerTopic(t, "id-1", "old-", 100, 150)
	second.offerTopic(t, "id-2", "new-", 0, 100)
	second.waitAcked(t, 150)
	if n := metricValue(second.r.m.skipped); n != 50 {
		t.Errorf("second owner skipped %v produces, want 50 (the old topic's 100-149)", n)
	}
	second.close(t, false)

	// A third owner resumes the new topic from 50: 50 skipped (done of
	// this topic), 100-119 delivered.
	third := w.owner(3, 50*time.Millisecond)
	third.offerTopic(t, "id-2", "new-", 50, 120)
	third.waitAcked(t, 70)
	if n := metricValue(third.r.m.skipped); n != 50 {
		t.Errorf("third owner skipped %v produces, want 50 (the new topic's 50-99)", n)
	}
	third.close(t, false)

	var want []string
	for off := range 150 {
		want = append(want, fmt.Sprint("old-", off))
	}
	for off := range 120 {
		want = append(want, fmt.Sprint("new-", off))
	}
	wantEachOnce(t, w.readCommitted("S", "out"), want)

	var last TxnPosition
	for v := range w.readCommitted("S", config.PositionsTopic) {
		var p TxnPosition
		if err := json.Unmarshal([]byte(v), &p); err != nil {
			t.Fatalf("position %q: %v", v, err)
		}
		if p.Generation > last.Generation || (p.Generation == last.Generation && p.Offset > last.Offset) {
			last = p
		}
	}
	if last.Generation != 3 || last.Done["A/orders/0"] != 120 || last.IDs["A/orders/0"] != "id-2" {
		t.Errorf("last position %+v, want generation 3's: done 120 of topic id-2 on A/orders/0", last)
	}
}

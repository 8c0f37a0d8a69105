package routing

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap/zaptest"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/record"
)

// readCommitted returns the values of every record of topic on cluster, as
// a read_committed consumer sees them up to the last stable offset.
func (w *world) readCommitted(cluster, topic string) map[string]int {
	w.t.Helper()
	sc, err := kafka.Config(w.cfg.Clusters[cluster])
	if err != nil {
		w.t.Fatal(err)
	}
	c, err := sarama.NewClient(w.cfg.Clusters[cluster].Brokers, sc)
	if err != nil {
		w.t.Fatal(err)
	}
	defer c.Close()
	ps, err := c.Partitions(topic)
	if err != nil {
		w.t.Fatal(err)
	}
	out := map[string]int{}
	for _, p := range ps {
		err := kafka.ReadAll(w.t.Context(), c, topic, p, func(r kafka.Record) bool {
			out[string(r.Value)]++
			return true
		})
		if err != nil {
			w.t.Fatalf("read %s/%s/%d: %v", cluster, topic, p, err)
		}
	}
	return out
}

// eosWorld is a source cluster A and an exactly_once cluster S whose
// topic out is the default route's channel.
func eosWorld(t *testing.T) *world {
	w := newWorld(t, map[string][]string{"S": {"out"}}, "A", "S")
	s := w.cfg.Clusters["S"]
	s.Delivery = config.ExactlyOnce
	w.cfg.Clusters["S"] = s
	w.cfg.Routing = Config{Default: []string{"out"}, Channels: map[string]Channel{"out": {Cluster: "S", Topic: "out"}}}
	return w
}

// owner starts a router for an owner of the source partitions: records it
// is handed carry its generation and session.
type eosOwner struct {
	r    *Router
	acks *acks
	gen  int64
}

func (w *world) owner(gen int64, interval time.Duration) *eosOwner {
	w.t.Helper()
	cfg := w.cfg.Clone()
	s := cfg.Clusters["S"]
	s.TransactionInterval = interval
	cfg.Clusters["S"] = s
	o := &eosOwner{acks: newAcks(), gen: gen}
	r, err := New(cfg, nil, Options{Logger: zaptest.NewLogger(w.t).Named(fmt.Sprintf("gen%d", gen)), OnAck: o.acks.add})
	if err != nil {
		w.t.Fatal(err)
	}
	o.r = r
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = r.Run(ctx)
	}()
	w.t.Cleanup(func() {
		_ = r.Close(context.Background()) // a no-op when the test closed it
		cancel()
		<-done
	})
	return o
}

func (o *eosOwner) close(t *testing.T, wantErr bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := o.r.Close(ctx); (err != nil) != wantErr {
		t.Errorf("gen %d: Close: %v", o.gen, err)
	}
}

// handle hands the records [from, to) of orders/0 on A to the owner.
func (o *eosOwner) handle(t *testing.T, from, to int64) {
	t.Helper()
	o.handleOn(t, "A", "orders", from, to)
}

// handleOn hands the records [from, to) of a copy of A's orders/0 to the
// owner: on A orders, on B A.orders.
func (o *eosOwner) handleOn(t *testing.T, cluster, topic string, from, to int64) {
	t.Helper()
	if err := o.offer(t.Context(), cluster, topic, from, to); err != nil {
		t.Fatal(err)
	}
}

// offer is handleOn for any goroutine: it returns the first record not
// taken.
func (o *eosOwner) offer(ctx context.Context, cluster, topic string, from, to int64) error {
	for off := from; off < to; off++ {
		rec := testRecord(topic, 0, off, "")
		rec.Cluster, rec.SourceTopic = cluster, "orders"
		rec.Origin, rec.Generation, rec.Session = "A", o.gen, o.gen
		if err := deliver(ctx, o.r, rec, 30*time.Second); err != nil {
			return err
		}
	}
	return nil
}

// wantEachOnce checks that the channel's values (got: value → copies) are
// want, each once.
func wantEachOnce(t *testing.T, got map[string]int, want []string) {
	t.Helper()
	for _, v := range want {
		if got[v] != 1 {
			t.Errorf("%s on the channel %d times (read_committed), want once", v, got[v])
		}
	}
	if len(got) != len(want) {
		t.Errorf("%d distinct records on the channel, want %d", len(got), len(want))
	}
}

// waitAcked waits until the owner has acknowledged n records of A's
// orders/0.
func (o *eosOwner) waitAcked(t *testing.T, n int) {
	t.Helper()
	o.waitAckedOf(t, "orders", n)
}

// waitAckedOf waits until the owner has acknowledged n records of topic's
// partition 0 (orders on A, A.orders on B).
func (o *eosOwner) waitAckedOf(t *testing.T, topic string, n int) {
	t.Helper()
	wait.For(t, 10*time.Second, fmt.Sprintf("gen %d: %d records of %s/0 acknowledged", o.gen, n, topic), func() error {
		if got := o.acks.count(topic + "/0@"); got != n {
			return fmt.Errorf("%d acknowledged", got)
		}
		return nil
	})
}

// TestExactlyOnceThroughACrashAndAZombie: the records of a source
// partition reach a channel on an exactly_once cluster once each, although
// each next owner consumes again from an older position (etcd's, behind
// the cluster's), and although an owner that lost the partition holds an
// open transaction when the next one starts.
func TestExactlyOnceThroughACrashAndAZombie(t *testing.T) {
	t.Parallel()
	w := eosWorld(t)

	// The first owner produces 0-149, committed (acknowledged only once
	// committed), and "crashes" with etcd's position at 100.
	first := w.owner(1, 50*time.Millisecond)
	first.handle(t, 0, 150)
	first.waitAcked(t, 150)
	first.close(t, false)

	// The second owner consumes from 100: 100-149 are skipped (the
	// first's transactions hold them) and acknowledged at once; 150-199
	// wait in a transaction that its hour-long interval never commits.
	second := w.owner(2, time.Hour)
	second.handle(t, 100, 200)
	second.waitAcked(t, 50)
	if n := metricValue(second.r.m.skipped); n != 50 {
		t.Errorf("second owner skipped %v produces, want 50 (offsets 100-149)", n)
	}
	if st := second.r.Status().ExactlyOnce; len(st) != 1 || st[0].Cluster != "S" || st[0].Producers != 1 || st[0].Open != 50 {
		t.Errorf("second owner's status: %+v, want one producer on S with 50 records in its open transaction", st)
	}

	// The third owner (the second lost the partition without knowing)
	// fences the second: Kafka aborts its transaction. It too consumes
	// from 100.
	third := w.owner(3, 50*time.Millisecond)
	third.handle(t, 100, 250)
	third.waitAcked(t, 150)
	// The zombie's commit fails: its 50 records are never acknowledged.
	second.close(t, true)
	if n := metricValue(second.r.m.txns.WithLabelValues("S", "fenced")); n != 1 {
		t.Errorf("fenced transactions of the second owner: %v, want 1", n)
	}
	if n := second.acks.count("orders/0@"); n != 50 {
		t.Errorf("the fenced owner acknowledged %d records, want only the 50 skipped", n)
	}
	third.close(t, false)

	// A switch to B: the next owner consumes B's copy, A.orders/0; then
	// a switch back to A rewinds to 240 (A's unmirrored tail, say): what
	// A's copy delivered before, 240-249, is skipped.
	onB := w.owner(4, 50*time.Millisecond)
	onB.handleOn(t, "B", "A.orders", 0, 10)
	onB.close(t, false)
	back := w.owner(5, 50*time.Millisecond)
	back.handle(t, 240, 260)
	if n := metricValue(back.r.m.skipped); n != 10 {
		t.Errorf("after the switch back, %v produces skipped, want 10 (A's 240-249)", n)
	}
	back.close(t, false)

	var want []string
	for off := range int64(260) {
		want = append(want, fmt.Sprintf("orders/0@%d", off))
	}
	for off := range int64(10) {
		want = append(want, fmt.Sprintf("A.orders/0@%d", off))
	}
	wantEachOnce(t, w.readCommitted("S", "out"), want)

	// The position the last transaction wrote is the stream's.
	pos := w.readCommitted("S", config.PositionsTopic)
	var last TxnPosition
	for v := range pos {
		var p TxnPosition
		if err := json.Unmarshal([]byte(v), &p); err != nil {
			t.Fatalf("position %q: %v", v, err)
		}
		if p.Offset > last.Offset {
			last = p
		}
	}
	if last.Offset != 260 || last.Cluster != "A" || last.Topic != "orders" || last.Generation != 5 ||
		last.Done["A/orders/0"] != 260 || last.Done["B/A.orders/0"] != 10 {
		t.Errorf("last position %+v, want A orders/0 offset 260 by generation 5, done A 260 and B 10", last)
	}
}

// TestExactlyOnceReadsThePositionPastAnotherStreamsOpenTransaction: the
// positions topic is one partition for every stream, and a read_committed
// reader stops at its last stable offset, the first offset of the oldest
// open transaction. An owner that dies mid-commit leaves its transaction
// open until its stream's next owner fences it or it times out: a stream
// whose last commit came after it must still be read to that commit, or
// its next owner delivers again what the last one committed.
func TestExactlyOnceReadsThePositionPastAnotherStreamsOpenTransaction(t *testing.T) {
	t.Parallel()
	w := eosWorld(t)
	first := w.owner(1, 50*time.Millisecond)
	first.handle(t, 0, 50) // creates the positions topic
	first.waitAcked(t, 50)

	// Another stream's owner writes its position and dies before its
	// commit: the transaction stays open for its timeout.
	const strangerTimeout = 2 * time.Second
	stranger, err := kgo.NewClient(kgo.SeedBrokers(w.kafkas["S"].Brokers()...),
		kgo.TransactionalID("kswitch/test/S/other/A/9"), kgo.TransactionTimeout(strangerTimeout))
	if err != nil {
		t.Fatal(err)
	}
	defer stranger.Close()
	if err := stranger.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	if err := stranger.ProduceSync(t.Context(), &kgo.Record{Topic: config.PositionsTopic, Key: []byte("other"),
		Value: []byte(`{"cluster":"A","topic":"other","partition":9,"offset":1}`)}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	died := time.Now()

	// This stream's owner goes on, commits past the open transaction, and
	// crashes with etcd's position at 100.
	first.handle(t, 50, 150)
	first.waitAcked(t, 150)
	first.close(t, false)

	second := w.owner(2, 50*time.Millisecond)
	second.handle(t, 100, 200)
	second.waitAcked(t, 100)
	if n := metricValue(second.r.m.skipped); n != 50 {
		t.Errorf("second owner skipped %v produces, want 50 (offsets 100-149, committed by the first)", n)
	}
	if waited := time.Since(died); waited < strangerTimeout {
		t.Errorf("the second owner delivered %s after the other stream's owner died, before its transaction's timeout (%s) ended it", waited, strangerTimeout)
	}
	second.close(t, false)
	var want []string
	for off := range int64(200) {
		want = append(want, fmt.Sprintf("orders/0@%d", off))
	}
	wantEachOnce(t, w.readCommitted("S", "out"), want)
}

// TestExactlyOnceChannelSettingsRefused: a channel on an exactly_once
// cluster cannot ask for settings its transactions do not have.
func TestExactlyOnceChannelSettingsRefused(t *testing.T) {
	t.Parallel()
	clusters := map[string]config.Cluster{
		"A": {Brokers: []string{"a:9092"}, Role: config.RolePrimary, Version: config.DefaultKafkaVersion},
		"S": {Brokers: []string{"s:9092"}, Role: config.RoleSink, Version: config.DefaultKafkaVersion, Delivery: config.ExactlyOnce},
	}
	_, err := Compile(Config{Default: []string{"out"}, Channels: map[string]Channel{"out": {Cluster: "S", Topic: "out", Acks: "leader"}}}, clusters)
	if err == nil || !strings.Contains(err.Error(), "channels.out: cluster S is exactly_once") {
		t.Fatalf("acks leader on an exactly_once cluster: %v", err)
	}
}

// copyValue is the value of the record numbered id in copies.
func copyValue(id int64) string { return fmt.Sprint("record-", id) }

// copyValues are the values of copies' records numbered [0, n).
func copyValues(n int64) []string {
	vs := make([]string, n)
	for id := range n {
		vs[id] = copyValue(id)
	}
	return vs
}

// copies returns a function that hands an owner the records numbered
// [from, to) of a copy of A's orders/0: the record numbered id is on A at
// offset id and on B (A.orders, the mirror's copy) at offset id+1000, with
// the same key, value and time on both.
func copies(t *testing.T) func(o *eosOwner, cluster string, from, to int64) {
	base := time.Now().Truncate(time.Millisecond)
	return func(o *eosOwner, cluster string, from, to int64) {
		t.Helper()
		for id := from; id < to; id++ {
			topic, off := "orders", id
			if cluster == "B" {
				topic, off = "A.orders", id+1000
			}
			rec := &record.Record{Cluster: cluster, Topic: topic, SourceTopic: "orders", Origin: "A", Offset: off,
				Key: []byte(fmt.Sprint("k", id)), Value: []byte(copyValue(id)), Timestamp: base.Add(time.Duration(id) * time.Millisecond),
				Generation: o.gen, Session: o.gen}
			if err := deliver(t.Context(), o.r, rec, 30*time.Second); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestExactlyOnceAlignsACopyAfterACrashAndASwitch: the owner of A's
// orders/0 crashes with etcd's position behind its last transaction, and
// the fleet switches to B before anyone consumes A again: the next owner
// starts on B's copy at the translation of etcd's position, finds there
// the last record committed (by fingerprint) and skips what precedes it.
func TestExactlyOnceAlignsACopyAfterACrashAndASwitch(t *testing.T) {
	t.Parallel()
	w := eosWorld(t)
	hand := copies(t)
	onA := w.owner(1, 50*time.Millisecond)
	hand(onA, "A", 0, 100)
	onA.waitAcked(t, 100)
	onA.close(t, false)
	// etcd's position was 80: the next owner, on B, starts at the copy
	// of 80 and goes on to 150.
	onB := w.owner(2, 50*time.Millisecond)
	hand(onB, "B", 80, 150)
	onB.waitAckedOf(t, "A.orders", 70)
	if n := metricValue(onB.r.m.skipped); n != 20 {
		t.Errorf("%v produces skipped on B, want 20 (the copies of 80-99)", n)
	}
	onB.close(t, false)
	wantEachOnce(t, w.readCommitted("S", "out"), copyValues(150))
}

// TestExactlyOnceAlignsACopyTheMirrorFillsLate: the fleet fails over
// while the mirror lags (B's copy ends before the last record committed
// from A) and the mirror copies the rest seconds later, once A is back:
// the records B's copy gets meanwhile, all older than the last committed
// one, are held until its copy arrives, and everything up to it is
// skipped. A 1 s hold (before) gave up and delivered 47 of them again;
// a producer holding records while aligning closed as idle after 600
// transaction intervals and never delivered 3 of them.
func TestExactlyOnceAlignsACopyTheMirrorFillsLate(t *testing.T) {
	t.Parallel()
	w := eosWorld(t)
	hand := copies(t)
	onA := w.owner(1, 50*time.Millisecond)
	hand(onA, "A", 0, 100)
	onA.waitAcked(t, 100)
	onA.close(t, false)

	// etcd's position was 50; B's copy holds 50-52 at the failover, the
	// rest 7 s later: longer than the 600 idle transaction intervals
	// after which a producer without records closes (10 ms each here).
	onB := w.owner(2, 10*time.Millisecond)
	hand(onB, "B", 50, 53)
	const mirrorLate = 7 * time.Second
	time.Sleep(mirrorLate)
	hand(onB, "B", 53, 150)
	onB.waitAckedOf(t, "A.orders", 100)
	if n := metricValue(onB.r.m.skipped); n != 50 {
		t.Errorf("%v produces skipped on B, want 50 (the copies of 50-99)", n)
	}
	onB.close(t, false)
	wantEachOnce(t, w.readCommitted("S", "out"), copyValues(150))
}

// TestExactlyOnceThroughASinkOutage: the exactly_once cluster fails while
// a transaction is open: the producer is opened again once it is back,
// and the transaction's records are sent again, once.
func TestExactlyOnceThroughASinkOutage(t *testing.T) {
	t.Parallel()
	w := eosWorld(t)
	o := w.owner(1, 50*time.Millisecond)
	o.handle(t, 0, 50)
	o.waitAcked(t, 50)

	w.kafkas["S"].Fail()
	done := make(chan error, 1)
	go func() { done <- o.offer(t.Context(), "A", "orders", 50, 100) }()
	wait.For(t, 30*time.Second, "a transaction fails with S down", func() error {
		if n := metricValue(o.r.m.txns.WithLabelValues("S", "failed")); n == 0 {
			return fmt.Errorf("no failed transaction yet")
		}
		return nil
	})
	w.kafkas["S"].Recover()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	o.waitAcked(t, 100)
	o.close(t, false)
	var want []string
	for off := range int64(100) {
		want = append(want, fmt.Sprintf("orders/0@%d", off))
	}
	wantEachOnce(t, w.readCommitted("S", "out"), want)
}

// TestExactlyOnceReleaseStopsTheOldOwnersProducer: an owner whose
// exactly_once cluster fails holds an open transaction it cannot commit;
// its agent gives the partition up (the drain timed out) and tells the
// router (Release). Once the cluster is back, that producer must not open
// again: opening is what fences, and it would fence the partition's next
// owner, whose records would then wait for ever, and commit records that
// etcd's position does not cover. The next owner delivers them, each once.
func TestExactlyOnceReleaseStopsTheOldOwnersProducer(t *testing.T) {
	t.Parallel()
	w := eosWorld(t)
	const oldInterval = 2 * time.Second
	old := w.owner(1, oldInterval)
	old.handle(t, 0, 20)
	old.waitAcked(t, 20)

	w.kafkas["S"].Fail()
	ctx, stop := context.WithCancel(t.Context())
	offered := make(chan error, 1)
	go func() { offered <- old.offer(ctx, "A", "orders", 20, 40) }()
	wait.For(t, 30*time.Second, "the old owner's commit fails with S down", func() error {
		if n := metricValue(old.r.m.txns.WithLabelValues("S", "failed")); n == 0 {
			return fmt.Errorf("no failed transaction yet")
		}
		return nil
	})
	// The agent stops the partition, then releases it: etcd's position
	// stays at 20.
	stop()
	<-offered
	acked := int64(old.acks.count("orders/0@"))
	released := time.Now()
	old.r.Release(record.Owned{Cluster: "A", Topic: "orders", SourceTopic: "orders", Origin: "A", Partition: 0, Generation: 1, Session: 1})
	t.Logf("Release returned in %v; the old owner had acknowledged %d", time.Since(released).Round(time.Millisecond), acked)
	// Its producer's loop has stopped: nothing is left to open again.
	if st := old.r.Status().ExactlyOnce; len(st) != 0 {
		t.Errorf("after the release, the old owner's producers: %+v, want none", st)
	}
	w.kafkas["S"].Recover()

	next := w.owner(2, 50*time.Millisecond)
	next.handle(t, acked, 60)
	next.waitAcked(t, int(60-acked))
	next.handle(t, 60, 80)
	next.waitAcked(t, int(80-acked))
	if n := metricValue(next.r.m.txns.WithLabelValues("S", "fenced")); n != 0 {
		t.Errorf("the next owner was fenced %v times", n)
	}
	if n := int64(old.acks.count("orders/0@")); n != acked {
		t.Errorf("the released owner acknowledged %d records, %d at its release", n, acked)
	}
	next.close(t, false)
	old.close(t, false)
	var want []string
	for off := range int64(80) {
		want = append(want, fmt.Sprintf("orders/0@%d", off))
	}
	wantEachOnce(t, w.readCommitted("S", "out"), want)
}

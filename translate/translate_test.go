package translate

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/offsets"
)

// The translation tests use a primary A with topic orders and a replica B
// with A.orders (MirrorMaker 2's prefix policy), three partitions each;
// the records go to partition trPart, so that a mix-up of partitions shows.
const (
	trPart       = int32(2)
	trSyncsTopic = "mm2-offset-syncs.B.internal"
	trCpTopic    = "A.checkpoints.internal"
	trFiller     = 37 // records on B's partition before A's first record
)

var trBase = time.UnixMilli(1767225600000) // 2026-01-01T00:00:00Z

var trReplication = config.Replication{
	Policy: "prefix", SourceAlias: "A",
	OffsetSyncsTopic: trSyncsTopic, OffsetSyncsCluster: "A",
	CheckpointsTopic: trCpTopic,
}

// trRec is a record to produce.
type trRec struct {
	key, value string
	ts         time.Time
}

func (r trRec) fingerprint() offsets.Fingerprint {
	return offsets.FingerprintOf([]byte(r.key), []byte(r.value), r.ts)
}

// aRecs returns A's records 0..n-1, one second apart.
func aRecs(n int) []trRec {
	recs := make([]trRec, n)
	for i := range recs {
		recs[i] = trRec{fmt.Sprintf("k%03d", i), fmt.Sprintf("order %d", i), trBase.Add(time.Duration(i) * time.Second)}
	}
	return recs
}

// fillers returns n records that match none of A's, timestamped before
// them (the replica's own older records).
func fillers(n int, tag string) []trRec {
	recs := make([]trRec, n)
	for i := range recs {
		recs[i] = trRec{"filler", fmt.Sprintf("%s %d", tag, i), trBase.Add(-time.Hour)}
	}
	return recs
}

// positionAfter is the committed position after consuming recs[:offset] of
// a partition holding recs from offset 0 on.
func positionAfter(recs []trRec, offset int) offsets.Commit {
	c := offsets.Commit{Cluster: "A", Topic: "orders", Partition: trPart, Offset: int64(offset)}
	if offset == 0 {
		return c
	}
	c.Timestamp = recs[offset-1].ts
	for i := max(0, offset-offsets.MaxFingerprints); i < offset; i++ {
		c.Fingerprints = append(c.Fingerprints, recs[i].fingerprint())
	}
	return c
}

func trConfig() *sarama.Config {
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V3_6_0_0
	cfg.ClientID = "offsets-translate-test"
	cfg.Net.ReadTimeout = 2 * time.Second
	cfg.Metadata.Retry.Max = 1
	cfg.Metadata.Retry.Backoff = 50 * time.Millisecond
	cfg.Metadata.AllowAutoTopicCreation = false
	return cfg
}

func trClient(t *testing.T, k *devstack.Kafka) sarama.Client {
	t.Helper()
	cl, err := sarama.NewClient(k.Brokers(), trConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}

func trProducer(t *testing.T, k *devstack.Kafka, txnID string) sarama.SyncProducer {
	t.Helper()
	cfg := trConfig()
	cfg.Producer.Partitioner = sarama.NewManualPartitioner
	cfg.Producer.Return.Successes = true
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	if txnID != "" {
		cfg.Producer.Idempotent = true
		cfg.Producer.Transaction.ID = txnID
		cfg.Net.MaxOpenRequests = 1
	}
	p, err := sarama.NewSyncProducer(k.Brokers(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// produce writes recs to topic/partition and checks they got consecutive
// offsets from want on.
func produce(t *testing.T, p sarama.SyncProducer, topic string, partition int32, recs []trRec) (first, last int64) {
	t.Helper()
	first = -1
	for _, r := range recs {
		_, off, err := p.SendMessage(&sarama.ProducerMessage{
			Topic: topic, Partition: partition, Timestamp: r.ts,
			Key: sarama.StringEncoder(r.key), Value: sarama.StringEncoder(r.value),
		})
		if err != nil {
			t.Fatal(err)
		}
		if first < 0 {
			first = off
		}
		last = off
	}
	return first, last
}

func produceRaw(t *testing.T, p sarama.SyncProducer, topic string, partition int32, key, value []byte) {
	t.Helper()
	if _, _, err := p.SendMessage(&sarama.ProducerMessage{
		Topic: topic, Partition: partition, Key: sarama.ByteEncoder(key), Value: sarama.ByteEncoder(value),
	}); err != nil {
		t.Fatal(err)
	}
}

// trEnv is a primary A and a replica B.
type trEnv struct {
	a, b   *devstack.Kafka
	ca, cb sarama.Client
	pa, pb sarama.SyncProducer
}

func newTrEnv(t *testing.T) *trEnv {
	t.Helper()
	e := &trEnv{
		a: testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 3, trSyncsTopic: 1}}),
		b: testenv.StartKafkaT(t, "B", devstack.KafkaOptions{Topics: map[string]int32{"A.orders": 3, trCpTopic: 1}}),
	}
	e.ca, e.cb = trClient(t, e.a), trClient(t, e.b)
	e.pa, e.pb = trProducer(t, e.a, ""), trProducer(t, e.b, "")
	return e
}

// fill writes A's records to A and, after trFiller fillers, the first
// copied of them to B.
func (e *trEnv) fill(t *testing.T, recs []trRec, copied int) {
	t.Helper()
	produce(t, e.pa, "orders", trPart, recs)
	produce(t, e.pb, "A.orders", trPart, fillers(trFiller, "b"))
	if first, _ := produce(t, e.pb, "A.orders", trPart, recs[:copied]); first != trFiller {
		t.Fatalf("first copy at offset %d, want %d", first, trFiller)
	}
}

func forward(pos offsets.Commit) Request {
	return Request{From: "A", To: "B", Topic: "A.orders", SourceTopic: "orders",
		Partition: trPart, Position: pos, Group: "g1", Direction: Forward}
}

func backward(pos offsets.Commit) Request {
	return Request{From: "B", To: "A", Topic: "orders", SourceTopic: "A.orders",
		Partition: trPart, Position: pos, Group: "g1", Direction: Backward}
}

func translate(t *testing.T, tr *Translator, req Request) Translation {
	t.Helper()
	got, err := tr.Translate(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	if strings.ContainsAny(got.Detail, "\n\r") {
		t.Errorf("Detail is not one line: %q", got.Detail)
	}
	t.Logf("%s/%d %d → %d: %s", req.Topic, req.Partition, req.Position.Offset, got.Offset, got.Detail)
	return got
}

func wantTranslation(t *testing.T, got Translation, offset int64, m Method, rewound int64) {
	t.Helper()
	if got.Offset != offset || got.Method != m || got.Rewound != rewound {
		t.Fatalf("translation = offset %d by %s rewound %d (%s), want offset %d by %s rewound %d",
			got.Offset, got.Method, got.Rewound, got.Detail, offset, m, rewound)
	}
}

func TestTranslateFingerprint(t *testing.T) {
	e := newTrEnv(t)
	recs := aRecs(100)
	e.fill(t, recs, 100)
	// B's partition as records from offset 0, to take positions on B.
	bRecs := append(fillers(trFiller, "b"), recs...)

	for _, tc := range []struct {
		name  string
		tr    Translator
		retry bool // the first estimate must be too late
	}{
		{"timestamp estimate, no margin, overshoots", Translator{Target: e.cb}, true},
		{"timestamp estimate, margin", Translator{Target: e.cb, TimestampMargin: time.Minute}, false},
		{"margin before the epoch", Translator{Target: e.cb, TimestampMargin: 100 * 365 * 24 * time.Hour}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := translate(t, &tc.tr, forward(positionAfter(recs, 60)))
			wantTranslation(t, got, trFiller+60, MethodFingerprint, 0)
			if !strings.Contains(got.Detail, "matched the last 8 of 8") {
				t.Errorf("Detail %q does not report a full match", got.Detail)
			}
			if tc.retry != strings.Contains(got.Detail, "then") {
				t.Errorf("Detail %q: retried = %v, want %v", got.Detail, !tc.retry, tc.retry)
			}
		})
	}

	tr := &Translator{Target: e.cb, TimestampMargin: 5 * time.Second}
	t.Run("positions", func(t *testing.T) {
		for _, off := range []int{1, 2, 8, 9, 59, 99, 100} {
			got := translate(t, tr, forward(positionAfter(recs, off)))
			wantTranslation(t, got, int64(trFiller+off), MethodFingerprint, 0)
		}
	})
	t.Run("backward", func(t *testing.T) {
		back := &Translator{Target: e.ca, TimestampMargin: 5 * time.Second}
		for _, off := range []int{trFiller + 1, trFiller + 60, trFiller + 100} {
			pos := positionAfter(bRecs, off)
			got := translate(t, back, backward(pos))
			wantTranslation(t, got, int64(off-trFiller), MethodFingerprint, 0)
		}
	})
	t.Run("only the last fingerprint", func(t *testing.T) {
		pos := positionAfter(recs, 60)
		pos.Fingerprints = pos.Fingerprints[offsets.MaxFingerprints-1:]
		got := translate(t, tr, forward(pos))
		wantTranslation(t, got, trFiller+60, MethodFingerprint, 0)
	})
	t.Run("start estimated by offset-syncs", func(t *testing.T) {
		k, v := EncodeOffsetSync("orders", trPart, 50, trFiller+50)
		produceRaw(t, e.pa, trSyncsTopic, 0, k, v)
		tr := &Translator{Target: e.cb, Syncs: e.ca, Replication: trReplication}
		got := translate(t, tr, forward(positionAfter(recs, 60)))
		wantTranslation(t, got, trFiller+60, MethodFingerprint, 0)
		if !strings.Contains(got.Detail, "offset-syncs") || !strings.Contains(got.Detail, fmt.Sprintf("from %d", trFiller+51)) {
			t.Errorf("Detail %q: want a scan from %d estimated by the offset-syncs", got.Detail, trFiller+51)
		}
	})
	t.Run("start from a hint", func(t *testing.T) {
		// The earlier translation of a position the consumer has since
		// moved past (the usual case), of one it had not reached yet (a
		// hint later than the fingerprinted records), and a wrong hint
		// too late by far: the scan starts from the hint, and a wrong one
		// costs only a rescan.
		for _, tc := range []struct {
			hint      Hint
			from      int64
			rescanned bool
		}{
			{Hint{SourceOffset: 50, TargetOffset: trFiller + 50}, trFiller + 50, false},
			{Hint{SourceOffset: 58, TargetOffset: trFiller + 58}, trFiller + 52, false},
			{Hint{SourceOffset: 58, TargetOffset: trFiller + 90}, trFiller + 84, true},
		} {
			req := forward(positionAfter(recs, 60))
			req.Hint = &tc.hint
			got := translate(t, &Translator{Target: e.cb}, req)
			wantTranslation(t, got, trFiller+60, MethodFingerprint, 0)
			if !strings.Contains(got.Detail, fmt.Sprintf("from %d (the earlier translation", tc.from)) || strings.Contains(got.Detail, "then") != tc.rescanned {
				t.Errorf("hint %+v: Detail %q, want a scan from %d, rescanned %v", tc.hint, got.Detail, tc.from, tc.rescanned)
			}
		}
	})
}

// A replica can hold the same records twice (MirrorMaker 2 re-sends after
// a restart): the earliest full match wins, which rewinds, never skips.
func TestTranslateFingerprintDuplicatedCopies(t *testing.T) {
	e := newTrEnv(t)
	recs := aRecs(100)
	e.fill(t, recs, 70)
	produce(t, e.pb, "A.orders", trPart, recs[50:100]) // re-sent from 50
	tr := &Translator{Target: e.cb, TimestampMargin: time.Hour}
	got := translate(t, tr, forward(positionAfter(recs, 60)))
	wantTranslation(t, got, trFiller+60, MethodFingerprint, 0)
}

// Offsets missing from the replica (transaction markers, aborted records)
// and foreign records between the copies do not stop an exact match.
func TestTranslateFingerprintGaps(t *testing.T) {
	t.Run("transactions", func(t *testing.T) {
		e := newTrEnv(t)
		recs := aRecs(100)
		produce(t, e.pa, "orders", trPart, recs)
		tx := trProducer(t, e.b, "mirror-1")
		produce(t, e.pb, "A.orders", trPart, fillers(3, "b"))
		txn := func(rs []trRec, commit bool) {
			t.Helper()
			if err := tx.BeginTxn(); err != nil {
				t.Fatal(err)
			}
			produce(t, tx, "A.orders", trPart, rs)
			end := tx.CommitTxn
			if !commit {
				end = tx.AbortTxn
			}
			if err := end(); err != nil {
				t.Fatal(err)
			}
		}
		// Copies in transactions of 10 (each leaves a marker), with an
		// aborted copy of 52..59 before the committed one: a
		// read_committed consumer never sees it, so it must not match.
		for i := 0; i < 100; i += 10 {
			if i == 50 {
				txn(recs[52:60], false)
			}
			txn(recs[i:i+10], true)
		}
		// B: 3 fillers, then 5 transactions of 10 + marker (offsets
		// 3..57), the aborted 8 + marker (58..66), then 50..59 at 67..76.
		want := int64(3 + 5*11 + 9 + 10)
		if end, err := e.cb.GetOffset("A.orders", trPart, sarama.OffsetNewest); err != nil || end != 3+10*11+9 {
			t.Fatalf("B's end = %d, %v; want %d (one marker per transaction)", end, err, 3+10*11+9)
		}
		for _, margin := range []time.Duration{0, time.Hour} {
			tr := &Translator{Target: e.cb, TimestampMargin: margin}
			got := translate(t, tr, forward(positionAfter(recs, 60)))
			wantTranslation(t, got, want, MethodFingerprint, 0)
			if !strings.Contains(got.Detail, "matched the last 8 of 8") {
				t.Errorf("Detail %q does not report a full match", got.Detail)
			}
		}
		// At the end of the partition, behind the last marker.
		got := translate(t, &Translator{Target: e.cb}, forward(positionAfter(recs, 100)))
		wantTranslation(t, got, 3+10*11+9-1, MethodFingerprint, 0)
	})
	t.Run("filler between copies", func(t *testing.T) {
		e := newTrEnv(t)
		recs := aRecs(100)
		produce(t, e.pa, "orders", trPart, recs)
		for i, r := range recs {
			produce(t, e.pb, "A.orders", trPart, append(fillers(1, fmt.Sprint("x", i)), r))
		}
		tr := &Translator{Target: e.cb, TimestampMargin: time.Minute}
		got := translate(t, tr, forward(positionAfter(recs, 60)))
		wantTranslation(t, got, 2*60, MethodFingerprint, 0)
	})
}

// A target that lags behind the position: the fingerprints are not there;
// the fallbacks answer at most the target's end.
func TestTranslateTargetLags(t *testing.T) {
	e := newTrEnv(t)
	recs := aRecs(100)
	e.fill(t, recs, 50)
	end := int64(trFiller + 50)

	t.Run("timestamp", func(t *testing.T) {
		tr := &Translator{Target: e.cb, TimestampMargin: 5 * time.Second}
		got := translate(t, tr, forward(positionAfter(recs, 60)))
		wantTranslation(t, got, end, MethodTimestamp, -1)
		for _, want := range []string{"fingerprint failed", "not on the target", "mm2 failed"} {
			if !strings.Contains(got.Detail, want) {
				t.Errorf("Detail %q does not say %q", got.Detail, want)
			}
		}
	})
	t.Run("mm2", func(t *testing.T) {
		for u := int64(0); u < 50; u += 10 {
			k, v := EncodeOffsetSync("orders", trPart, u, trFiller+u)
			produceRaw(t, e.pa, trSyncsTopic, 0, k, v)
		}
		k, v := EncodeOffsetSync("orders", trPart, 49, trFiller+49)
		produceRaw(t, e.pa, trSyncsTopic, 0, k, v)
		tr := &Translator{Target: e.cb, Syncs: e.ca, Replication: trReplication, TimestampMargin: 5 * time.Second}
		got := translate(t, tr, forward(positionAfter(recs, 60)))
		wantTranslation(t, got, end, MethodMM2, 60-49-1)
		if !strings.Contains(got.Detail, "fingerprint failed") {
			t.Errorf("Detail %q does not say why fingerprint failed", got.Detail)
		}
	})
}

func TestTranslateMM2(t *testing.T) {
	e := newTrEnv(t)
	recs := aRecs(100)
	e.fill(t, recs, 100)
	// Syncs every 10 records, among syncs of other partitions and topics,
	// a tombstone and a record that is no sync.
	for u := int64(0); u < 100; u += 10 {
		for _, s := range []OffsetSync{{"orders", trPart, u, trFiller + u}, {"orders", 0, u, u + 1000}, {"A.orders", trPart, u, 0}} {
			k, v := EncodeOffsetSync(s.Topic, s.Partition, s.Upstream, s.Downstream)
			produceRaw(t, e.pa, trSyncsTopic, 0, k, v)
		}
	}
	produceRaw(t, e.pa, trSyncsTopic, 0, []byte("junk"), []byte("junk"))
	k, _ := EncodeOffsetSync("orders", 1, 0, 0)
	produceRaw(t, e.pa, trSyncsTopic, 0, k, nil)

	tr := &Translator{Target: e.cb, Syncs: e.ca, Replication: trReplication}
	noFP := func(off int) offsets.Commit {
		p := positionAfter(recs, off)
		p.Fingerprints = nil
		return p
	}
	t.Run("forward", func(t *testing.T) {
		for _, tc := range []struct {
			pos           int
			want, rewound int64
		}{
			{0, trFiller, 0},
			{40, trFiller + 40, 0},
			{41, trFiller + 41, 0},
			{45, trFiller + 41, 4},
			{99, trFiller + 91, 8},
			{100, trFiller + 91, 9},
		} {
			got := translate(t, tr, forward(noFP(tc.pos)))
			wantTranslation(t, got, tc.want, MethodMM2, tc.rewound)
		}
	})
	t.Run("backward", func(t *testing.T) {
		back := &Translator{Target: e.ca, Syncs: e.ca, Replication: trReplication}
		for _, tc := range []struct {
			pos           int64
			want, rewound int64
		}{
			{trFiller + 40, 40, 0},
			{trFiller + 41, 41, 0},
			{trFiller + 45, 41, 4},
			{trFiller + 100, 91, 9},
		} {
			pos := offsets.Commit{Cluster: "B", Topic: "A.orders", Partition: trPart, Offset: tc.pos}
			got := translate(t, back, backward(pos))
			wantTranslation(t, got, tc.want, MethodMM2, tc.rewound)
		}
		// Before the first sync's downstream offset: no inversion.
		pos := offsets.Commit{Cluster: "B", Topic: "A.orders", Partition: trPart, Offset: 10}
		got := translate(t, back, backward(pos))
		if got.Method != MethodTimestamp || !strings.Contains(got.Detail, "no offset-sync at or before downstream offset 10") {
			t.Fatalf("position before the syncs: %+v", got)
		}
	})
	t.Run("checkpoint", func(t *testing.T) {
		// MirrorMaker 2 translated the group's offset 45 to 82 (say from
		// a finer sync than those left): later than 41+37, and safe.
		for _, c := range []Checkpoint{
			{"g1", "A.orders", trPart, 45, 82, ""},
			{"g1", "orders", trPart, 45, 90, ""},   // upstream name: not the key
			{"g2", "A.orders", trPart, 45, 90, ""}, // another group
		} {
			k, v := EncodeCheckpoint(c.Group, c.Topic, c.Partition, c.Upstream, c.Downstream, c.Metadata)
			produceRaw(t, e.pb, trCpTopic, 0, k, v)
		}
		got := translate(t, tr, forward(noFP(45)))
		wantTranslation(t, got, 82, MethodMM2, -1)
		// A checkpoint past the position is not used.
		got = translate(t, tr, forward(noFP(44)))
		wantTranslation(t, got, trFiller+41, MethodMM2, 3)
		// No group: the syncs alone.
		req := forward(noFP(45))
		req.Group = ""
		got = translate(t, tr, req)
		wantTranslation(t, got, trFiller+41, MethodMM2, 4)
	})
	t.Run("fingerprints win", func(t *testing.T) {
		got := translate(t, tr, forward(positionAfter(recs, 45)))
		wantTranslation(t, got, trFiller+45, MethodFingerprint, 0)
	})
	t.Run("fingerprints not found", func(t *testing.T) {
		pos := positionAfter(recs, 45)
		pos.Fingerprints = []offsets.Fingerprint{1, 2, 3}
		got := translate(t, tr, forward(pos))
		wantTranslation(t, got, 82, MethodMM2, -1)
		if !strings.Contains(got.Detail, "fingerprint failed") {
			t.Errorf("Detail %q does not say why fingerprint failed", got.Detail)
		}
	})
	t.Run("missing topics", func(t *testing.T) {
		r := trReplication
		r.OffsetSyncsTopic, r.CheckpointsTopic = "no-such-syncs", "no-such-checkpoints"
		tr := &Translator{Target: e.cb, Syncs: e.ca, Replication: r}
		got := translate(t, tr, forward(noFP(45)))
		if got.Method != MethodTimestamp {
			t.Fatalf("got %+v, want the timestamp method", got)
		}
		// Found absent by one metadata request each, not by sarama's
		// lookups with their retries.
		for _, want := range []string{"topic no-such-syncs does not exist", "topic no-such-checkpoints does not exist"} {
			if !strings.Contains(got.Detail, want) {
				t.Errorf("Detail %q does not say %s", got.Detail, want)
			}
		}
	})
}

func TestTranslateTimestamp(t *testing.T) {
	e := newTrEnv(t)
	recs := aRecs(100)
	e.fill(t, recs, 100)
	tr := &Translator{Target: e.cb, TimestampMargin: 3 * time.Second}
	noFP := func(off int) offsets.Commit {
		p := positionAfter(recs, off)
		p.Fingerprints = nil
		return p
	}
	// 59's timestamp minus 3 s is 56's.
	got := translate(t, tr, forward(noFP(60)))
	wantTranslation(t, got, trFiller+56, MethodTimestamp, -1)
	if !strings.Contains(got.Detail, "no fingerprints") {
		t.Errorf("Detail %q does not say why fingerprint was not used", got.Detail)
	}
	// No timestamp (nothing consumed yet): the oldest offset, or the end
	// when the source starts at the newest.
	got = translate(t, tr, forward(noFP(0)))
	wantTranslation(t, got, 0, MethodTimestamp, -1)
	req := forward(noFP(0))
	req.Unconsumed = "newest"
	got = translate(t, tr, req)
	wantTranslation(t, got, trFiller+100, MethodTimestamp, 0)
	if !strings.Contains(got.Detail, "nothing consumed there yet") {
		t.Errorf("Detail %q does not say why the end", got.Detail)
	}
	// Newer than every record: the end.
	p := noFP(60)
	p.Timestamp = trBase.Add(24 * time.Hour)
	got = translate(t, tr, forward(p))
	wantTranslation(t, got, trFiller+100, MethodTimestamp, -1)
	// A margin reaching before 1970: the oldest offset.
	huge := &Translator{Target: e.cb, TimestampMargin: 100 * 365 * 24 * time.Hour}
	got = translate(t, huge, forward(noFP(60)))
	wantTranslation(t, got, 0, MethodTimestamp, -1)
}

func TestTranslateUnreachable(t *testing.T) {
	for _, mode := range []string{"fail", "hang"} {
		t.Run(mode, func(t *testing.T) {
			e := newTrEnv(t)
			recs := aRecs(10)
			e.fill(t, recs, 10)
			cfg := trConfig()
			cfg.Net.ReadTimeout = time.Second
			cb, err := sarama.NewClient(e.b.Brokers(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { cb.Close() })
			if mode == "fail" {
				e.b.Fail()
			} else {
				e.b.Hang()
			}
			t.Cleanup(e.b.Recover)
			const timeout = 2 * time.Second
			tr := &Translator{Target: cb, Syncs: e.ca, Replication: trReplication, Timeout: timeout}
			start := time.Now()
			_, err = tr.Translate(context.Background(), forward(positionAfter(recs, 5)))
			took := time.Since(start)
			if err == nil {
				t.Fatal("Translate succeeded against an unreachable target")
			}
			t.Logf("after %v: %v", took, err)
			if took > timeout+500*time.Millisecond {
				t.Errorf("Translate took %v, timeout %v", took, timeout)
			}
			var te *Error
			if !errors.As(err, &te) || len(te.Methods) != 3 {
				t.Fatalf("error %T %v, want a *Error with 3 methods", err, err)
			}
			for _, want := range []string{"A.orders/2", "from A to B", "fingerprint:", "mm2:", "timestamp:"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not contain %q", err, want)
				}
			}
		})
	}
}

func TestTranslateRequestChecks(t *testing.T) {
	tr := &Translator{}
	if _, err := tr.Translate(context.Background(), forward(offsets.Commit{})); err == nil || !strings.Contains(err.Error(), "no target client") {
		t.Fatalf("no target: %v", err)
	}
	e := newTrEnv(t)
	tr.Target = e.cb
	req := forward(offsets.Commit{})
	req.Direction = 0
	if _, err := tr.Translate(context.Background(), req); err == nil || !strings.Contains(err.Error(), "direction") {
		t.Fatalf("zero direction: %v", err)
	}
	req = forward(offsets.Commit{Offset: -1})
	if _, err := tr.Translate(context.Background(), req); err == nil {
		t.Fatal("negative offset accepted")
	}
	// A cancelled ctx is returned unchanged.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := tr.Translate(ctx, forward(offsets.Commit{})); err != context.Canceled {
		t.Fatalf("cancelled ctx: %v, want context.Canceled", err)
	}
	// An unknown topic on the target fails every method, naming it.
	req = forward(offsets.Commit{Offset: 3})
	req.Topic = "A.nope"
	_, err := tr.Translate(context.Background(), req)
	if err == nil || !strings.Contains(err.Error(), "A.nope/2") {
		t.Fatalf("unknown topic: %v", err)
	}
}

// A replica that lags a few records behind the consumer: the continuation
// is its end, exactly, not a timestamp rewind.
func TestTranslateFingerprintTargetLagsWithinTheWindow(t *testing.T) {
	a := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 1}})
	b := testenv.StartKafkaT(t, "B", devstack.KafkaOptions{Topics: map[string]int32{"A.orders": 1}})
	base := time.Now().Add(-time.Minute).Truncate(time.Millisecond)
	var recs []lagRec
	for i := range 40 {
		recs = append(recs, lagRec{key: fmt.Sprint("k", i), value: fmt.Sprint("v", i), ts: base.Add(time.Duration(i) * time.Millisecond)})
	}
	produceLag(t, a, "orders", recs)
	produceLag(t, b, "A.orders", recs[:37]) // B lacks the last 3 consumed records
	var fps []offsets.Fingerprint
	for _, r := range recs[32:40] {
		fps = append(fps, offsets.FingerprintOf([]byte(r.key), []byte(r.value), r.ts))
	}
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	target, err := sarama.NewClient(b.Brokers(), sc)
	if err != nil {
		t.Fatal(err)
	}
	defer target.Close()
	tr := &Translator{Target: target, Replication: config.Replication{Policy: "prefix", SourceAlias: "A"}, TimestampMargin: 5 * time.Second}
	res, err := tr.Translate(context.Background(), Request{From: "A", To: "B", Topic: "A.orders", SourceTopic: "orders",
		Position: offsets.Commit{Cluster: "A", Topic: "orders", Offset: 40, Timestamp: recs[39].ts, Fingerprints: fps}, Direction: Forward})
	if err != nil {
		t.Fatal(err)
	}
	if res.Method != MethodFingerprint || res.Offset != 37 || res.Rewound != 0 {
		t.Fatalf("got %+v, want fingerprint at B's end 37, nothing rewound", res)
	}
}

type lagRec struct {
	key, value string
	ts         time.Time
}

func produceLag(t *testing.T, k *devstack.Kafka, topic string, recs []lagRec) {
	t.Helper()
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	sc.Producer.Return.Successes = true
	p, err := sarama.NewSyncProducer(k.Brokers(), sc)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for _, r := range recs {
		if _, _, err := p.SendMessage(&sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder(r.key), Value: sarama.StringEncoder(r.value), Timestamp: r.ts}); err != nil {
			t.Fatal(err)
		}
	}
}

// TestTranslateMM2SharesTheSyncsRead checks that the Translate calls of
// one switch share what they read of the offset-syncs topic: a later call
// reads on from where the last one stopped and sees the syncs written
// since, for its own partition.
func TestTranslateMM2SharesTheSyncsRead(t *testing.T) {
	e := newTrEnv(t)
	recs := aRecs(100)
	e.fill(t, recs, 100)
	writeSyncs := func(from, to int64) {
		for u := from; u < to; u += 10 {
			for _, s := range []OffsetSync{{"orders", trPart, u, trFiller + u}, {"orders", 0, u, u + 1000}} {
				k, v := EncodeOffsetSync(s.Topic, s.Partition, s.Upstream, s.Downstream)
				produceRaw(t, e.pa, trSyncsTopic, 0, k, v)
			}
		}
	}
	writeSyncs(0, 50)
	cache := new(SyncsCache)
	tr := &Translator{Target: e.cb, Syncs: e.ca, Replication: trReplication, SyncsCache: cache}
	noFP := func(off int) offsets.Commit {
		p := positionAfter(recs, off)
		p.Fingerprints = nil
		return p
	}
	got := translate(t, tr, forward(noFP(45)))
	wantTranslation(t, got, trFiller+41, MethodMM2, 4)
	if cache.next != 10 {
		t.Fatalf("the cache read up to offset %d of the syncs topic, want its end, 10", cache.next)
	}
	writeSyncs(50, 100)
	got = translate(t, tr, forward(noFP(99)))
	wantTranslation(t, got, trFiller+91, MethodMM2, 8)
	if cache.next != 20 {
		t.Fatalf("the cache read up to offset %d, want 20", cache.next)
	}
	if n := len(cache.syncs[syncKey{"orders", 0}]); n != 10 {
		t.Fatalf("%d syncs kept for orders/0, want 10", n)
	}
}

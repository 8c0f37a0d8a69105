package mirror

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/translate"
)

// pair starts source cluster A with topics and an empty target B.
func pair(t *testing.T, topics map[string]int32) (a, b *devstack.Kafka) {
	t.Helper()
	a = testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: topics})
	b = testenv.StartKafkaT(t, "B", devstack.KafkaOptions{})
	return a, b
}

func TestCopyPreservesRecords(t *testing.T) {
	t.Parallel()
	const n, prefill = 40, 3
	a, b := pair(t, map[string]int32{"orders": 2})
	ac, bc := newClient(t, a), newClient(t, b)
	p := newProducer(t, ac)
	for part := range int32(2) {
		produceN(t, p, "orders", part, 0, n)
	}
	// sarama sends the timestamp it is given (record batches, Version >=
	// 0.11) and kfake keeps it (CreateTime): the source itself holds
	// exactly what the test produced.
	for part := range int32(2) {
		for i, m := range readAll(t, ac, "orders", part) {
			w := message("orders", part, i)
			if !m.Timestamp.Equal(w.Timestamp.Truncate(time.Millisecond)) || string(m.Value) != fmt.Sprint(w.Value) || len(m.Headers) != 2 {
				t.Fatalf("source orders/%d offset %d = %q at %v with %d headers, want %q at %v", part, i, m.Value, m.Timestamp, len(m.Headers), w.Value, w.Timestamp)
			}
		}
	}

	m := startMirror(t, Config{
		Source: a.Brokers(), Target: b.Brokers(), SourceName: "A", TargetName: "B",
		Topics: []string{"orders"}, TargetPrefill: prefill,
	})
	caughtUp(t, m)
	for part := range int32(2) {
		got := readAll(t, bc, "orders", part)
		checkCopy(t, ac, bc, "orders", "orders", part, prefill)
		// Spelled out: the copy of source offset i is at prefill + i.
		for i := range n {
			g, w := got[prefill+i], message("orders", part, i)
			if g.Offset != int64(prefill+i) || string(g.Key) != fmt.Sprint(w.Key) || !g.Timestamp.Equal(w.Timestamp.Truncate(time.Millisecond)) {
				t.Fatalf("orders/%d offset %d: %q at %v, want offset %d %q at %v", part, g.Offset, g.Key, g.Timestamp, prefill+i, w.Key, w.Timestamp)
			}
		}
		if string(got[0].Headers[0].Value) != "B" {
			t.Fatalf("filler header value %q, want the target's name", got[0].Headers[0].Value)
		}
	}
	if got := m.Copied(); got != 2*n {
		t.Fatalf("Copied() = %d, want %d", got, 2*n)
	}
	if lag, err := m.Lag(); err != nil || lag != 0 {
		t.Fatalf("Lag() = %d, %v; want 0", lag, err)
	}

	// Records produced while the mirror runs are copied too.
	produceN(t, p, "orders", 1, n, 10)
	caughtUp(t, m)
	checkCopy(t, ac, bc, "orders", "orders", 1, prefill)
	if got := m.Copied(); got != 2*n+10 {
		t.Fatalf("Copied() = %d, want %d", got, 2*n+10)
	}

	// Null is not empty: a tombstone stays a tombstone, an empty value
	// stays empty, and so do header values.
	special := []*sarama.ProducerMessage{
		{Topic: "orders", Partition: 0, Timestamp: baseTime, Headers: []sarama.RecordHeader{{Key: []byte("null")}}},
		{Topic: "orders", Partition: 0, Timestamp: baseTime, Key: sarama.ByteEncoder{}, Value: sarama.ByteEncoder{},
			Headers: []sarama.RecordHeader{{Key: []byte("empty"), Value: []byte{}}}},
	}
	for _, msg := range special {
		if _, _, err := p.SendMessage(msg); err != nil {
			t.Fatal(err)
		}
	}
	caughtUp(t, m)
	got := readAll(t, bc, "orders", 0)
	tomb, empty := got[len(got)-2], got[len(got)-1]
	if tomb.Key != nil || tomb.Value != nil || tomb.Headers[0].Value != nil {
		t.Fatalf("tombstone copied as key %q value %q header %q, want nulls", tomb.Key, tomb.Value, tomb.Headers[0].Value)
	}
	if empty.Key == nil || len(empty.Key) != 0 || empty.Value == nil || len(empty.Value) != 0 || empty.Headers[0].Value == nil {
		t.Fatalf("empty record copied as key %#v value %#v header %#v, want empty, not null", empty.Key, empty.Value, empty.Headers[0].Value)
	}

	m.Stop()
	m.Stop() // idempotent
	select {
	case <-m.Done():
	default:
		t.Fatal("Done not closed after Stop")
	}
	if _, err := m.Lag(); !errors.Is(err, ErrStopped) {
		t.Fatalf("Lag after Stop = %v, want ErrStopped", err)
	}
	if err := m.CaughtUp(context.Background()); !errors.Is(err, ErrStopped) {
		t.Fatalf("CaughtUp after Stop = %v, want ErrStopped", err)
	}
}

func TestRemoteTopicNaming(t *testing.T) {
	t.Parallel()
	a, b := pair(t, map[string]int32{"orders": 3, "payments": 2})
	// A target topic that exists already is used as it is.
	if err := b.CreateTopic("A.payments", 2); err != nil {
		t.Fatal(err)
	}
	ac, bc := newClient(t, a), newClient(t, b)
	p := newProducer(t, ac)
	for part := range int32(3) {
		produceN(t, p, "orders", part, 0, 5)
	}
	produceN(t, p, "payments", 1, 0, 5)

	repl := config.Replication{Policy: "prefix", SourceAlias: "A"}
	m := startMirror(t, Config{
		Source: a.Brokers(), Target: b.Brokers(),
		Topics: []string{"orders", "payments"}, RemoteTopic: repl.RemoteTopic,
	})
	caughtUp(t, m)
	if err := bc.RefreshMetadata(); err != nil {
		t.Fatal(err)
	}
	topics, err := bc.Topics()
	if err != nil {
		t.Fatal(err)
	}
	for _, topic := range topics {
		if topic == "orders" || topic == "payments" {
			t.Fatalf("target has %s: the copies must be named A.<topic> (topics %v)", topic, topics)
		}
	}
	if ps, err := bc.Partitions("A.orders"); err != nil || len(ps) != 3 {
		t.Fatalf("A.orders partitions = %v, %v; want 3 like the source", ps, err)
	}
	for part := range int32(3) {
		checkCopy(t, ac, bc, "orders", "A.orders", part, 0)
	}
	checkCopy(t, ac, bc, "payments", "A.payments", 1, 0)
	if got := m.Copied(); got != 20 {
		t.Fatalf("Copied() = %d, want 20", got)
	}
}

// TestMultiBroker copies between clusters whose partitions have different
// leaders: one fetch per source leader, writes to each target leader. The
// source's leaders are placed by the test (partition p on node p mod 3):
// kfake places them at random, and may put all six on one node.
func TestMultiBroker(t *testing.T) {
	t.Parallel()
	a := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Brokers: 3, Topics: map[string]int32{"orders": 6}})
	b := testenv.StartKafkaT(t, "B", devstack.KafkaOptions{Brokers: 2})
	for part := range int32(6) {
		if err := a.Cluster().MoveTopicPartition("orders", part, part%3); err != nil {
			t.Fatal(err)
		}
	}
	ac, bc := newClient(t, a), newClient(t, b)
	p := newProducer(t, ac)
	for part := range int32(6) {
		produceN(t, p, "orders", part, 0, 10+int(part))
	}
	m := startMirror(t, Config{Source: a.Brokers(), Target: b.Brokers(), Topics: []string{"orders"}, TargetPrefill: 1})
	caughtUp(t, m)
	leaders := map[int32]bool{}
	for part := range int32(6) {
		checkCopy(t, ac, bc, "orders", "orders", part, 1)
		l, err := ac.Leader("orders", part)
		if err != nil {
			t.Fatal(err)
		}
		leaders[l.ID()] = true
	}
	if len(leaders) != 3 {
		t.Fatalf("source partitions led by %v, want nodes 0, 1 and 2 (placed by the test)", leaders)
	}
}

func TestStartRefuses(t *testing.T) {
	t.Parallel()
	a, b := pair(t, map[string]int32{"orders": 3})
	if err := b.CreateTopic("orders", 2); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"target topic too small", Config{Topics: []string{"orders"}}, "fewer than the 3"},
		{"missing source topic", Config{Topics: []string{"nope"}}, "source topic nope"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.Source, tc.cfg.Target = a.Brokers(), b.Brokers()
			m, err := Start(ctx, tc.cfg)
			if err == nil {
				m.Stop()
				t.Fatal("Start succeeded")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Start: %v; want it to mention %q", err, tc.want)
			}
		})
	}
	t.Run("source down", func(t *testing.T) {
		a.Fail()
		defer a.Recover()
		m, err := Start(ctx, Config{Source: a.Brokers(), Target: b.Brokers(), Topics: []string{"orders"}})
		if err == nil {
			m.Stop()
			t.Fatal("Start succeeded with the source down")
		}
	})
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	good := Config{Source: []string{"a:1"}, Target: []string{"b:1"}, Topics: []string{"t"}}
	if err := good.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		mod  func(*Config)
	}{
		{"no source", func(c *Config) { c.Source = nil }},
		{"no target", func(c *Config) { c.Target = nil }},
		{"no topics", func(c *Config) { c.Topics = nil }},
		{"empty topic", func(c *Config) { c.Topics = []string{""} }},
		{"two topics one name", func(c *Config) {
			c.Topics = []string{"x", "y"}
			c.RemoteTopic = func(string) string { return "z" }
		}},
		{"onto itself", func(c *Config) { c.Target = []string{"a:1"} }},
		{"old version", func(c *Config) { c.Version = sarama.V0_10_2_0 }},
		{"negative prefill", func(c *Config) { c.TargetPrefill = -1 }},
		{"syncs topic copied", func(c *Config) { c.OffsetSyncsTopic = "t" }},
		{"backoff max below min", func(c *Config) { c.RetryBackoff, c.RetryBackoffMax = time.Second, time.Millisecond }},
		{"fetch wait too long", func(c *Config) { c.FetchMaxWait = time.Minute }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := good
			tc.mod(&c)
			if err := c.Validate(); err == nil {
				t.Fatal("accepted")
			}
			if _, err := Start(context.Background(), c); err == nil {
				t.Fatal("Start accepted it")
			}
		})
	}
	// Same cluster is fine when the copy gets another name.
	c := good
	c.Target = []string{"a:1"}
	c.RemoteTopic = func(t string) string { return "A." + t }
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
}

// readSyncs returns the offset-syncs on partition 0 of topic, decoded.
func readSyncs(t *testing.T, cl sarama.Client, topic string) []offsetSync {
	t.Helper()
	if ps, err := cl.Partitions(topic); err != nil || len(ps) != 1 {
		t.Fatalf("offset-syncs topic %s has partitions %v, %v; want one", topic, ps, err)
	}
	var syncs []offsetSync
	for _, m := range readAll(t, cl, topic, 0) {
		var s offsetSync
		var err error
		s.topic, s.partition, s.upstream, s.downstream, err = decodeSync(m.Key, m.Value)
		if err != nil {
			t.Fatalf("offset-sync at offset %d: %v", m.Offset, err)
		}
		// The reader kswitch uses agrees.
		if o, err := translate.DecodeOffsetSync(m.Key, m.Value); err != nil ||
			o != (translate.OffsetSync{Topic: s.topic, Partition: s.partition, Upstream: s.upstream, Downstream: s.downstream}) {
			t.Fatalf("offset-sync at offset %d: translate.DecodeOffsetSync = %+v, %v; want %+v", m.Offset, o, err, s)
		}
		syncs = append(syncs, s)
	}
	return syncs
}

// TestOffsetSyncFormat pins the bytes of an offset-sync record: Kafka's
// OffsetSync (key: topic STRING, partition INT32; value: upstream INT64,
// downstream INT64; big-endian, STRING = INT16 length + UTF-8).
func TestOffsetSyncFormat(t *testing.T) {
	t.Parallel()
	key, value := translate.EncodeOffsetSync("orders", 3, 5, 22)
	wantKey := []byte{0, 6, 'o', 'r', 'd', 'e', 'r', 's', 0, 0, 0, 3}
	wantValue := []byte{0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 22}
	if !bytes.Equal(key, wantKey) || !bytes.Equal(value, wantValue) {
		t.Fatalf("EncodeOffsetSync = %x %x, want %x %x", key, value, wantKey, wantValue)
	}
	topic, part, up, down, err := decodeSync(key, value)
	if err != nil || topic != "orders" || part != 3 || up != 5 || down != 22 {
		t.Fatalf("decodeSync = %s %d %d %d %v", topic, part, up, down, err)
	}
}

type offsetSync struct {
	topic                string
	partition            int32
	upstream, downstream int64
}

func TestOffsetSyncs(t *testing.T) {
	t.Parallel()
	for _, onTarget := range []bool{false, true} {
		t.Run(fmt.Sprintf("on target %v", onTarget), func(t *testing.T) {
			const n, prefill = 30, 5
			a, b := pair(t, map[string]int32{"orders": 2})
			ac, bc := newClient(t, a), newClient(t, b)
			p := newProducer(t, ac)
			produceN(t, p, "orders", 0, 0, n)
			produceN(t, p, "orders", 1, 0, n/2)
			const syncsTopic = "mm2-offset-syncs.B.internal"
			m := startMirror(t, Config{
				Source: a.Brokers(), Target: b.Brokers(), SourceName: "A", TargetName: "B",
				Topics: []string{"orders"}, RemoteTopic: func(t string) string { return "A." + t },
				OffsetSyncsTopic: syncsTopic, OffsetSyncsOnTarget: onTarget, TargetPrefill: prefill,
			})
			// CaughtUp covers the syncs: no waiting for them.
			caughtUp(t, m)
			syncCl, other := ac, bc
			if onTarget {
				syncCl, other = bc, ac
			}
			if ps, err := other.Partitions(syncsTopic); err == nil {
				t.Fatalf("offset-syncs topic on the wrong cluster too (partitions %v)", ps)
			}
			syncs := readSyncs(t, syncCl, syncsTopic)
			if len(syncs) != n+n/2 {
				t.Fatalf("%d offset-syncs, want one per copied record (%d)", len(syncs), n+n/2)
			}
			copies := map[int32][]*sarama.ConsumerMessage{0: readAll(t, bc, "A.orders", 0), 1: readAll(t, bc, "A.orders", 1)}
			sources := map[int32][]*sarama.ConsumerMessage{0: readAll(t, ac, "orders", 0), 1: readAll(t, ac, "orders", 1)}
			next := map[int32]int64{}
			for _, s := range syncs {
				if s.topic != "orders" {
					t.Fatalf("sync %+v: topic must be the upstream name", s)
				}
				if s.upstream != next[s.partition] || s.downstream != prefill+s.upstream {
					t.Fatalf("sync %+v: want upstream %d, downstream %d", s, next[s.partition], prefill+next[s.partition])
				}
				next[s.partition]++
				if diff := sameMessage(copies[s.partition][s.downstream], sources[s.partition][s.upstream]); diff != "" {
					t.Fatalf("sync %+v points at a different record: %s", s, diff)
				}
			}
		})
	}
}

// TestSourceGaps copies a compacted source, whose offsets have gaps: the
// copies are dense, and the offset-syncs give the real pairs.
func TestSourceGaps(t *testing.T) {
	t.Parallel()
	a, b := pair(t, nil)
	if err := a.Cluster().CreateTopic("state", 1, map[string]string{"cleanup.policy": "compact", "retention.ms": "-1"}); err != nil {
		t.Fatal(err)
	}
	ac, bc := newClient(t, a), newClient(t, b)
	p := newProducer(t, ac)
	for i := range 30 {
		msg := message("state", 0, i)
		if i%2 == 1 {
			msg.Key = sarama.StringEncoder("dup") // superseded but for the last: gaps at odd offsets
		}
		if _, _, err := p.SendMessage(msg); err != nil {
			t.Fatal(err)
		}
	}
	a.Cluster().Compact()
	src := readAll(t, ac, "state", 0)
	if len(src) >= 30 || src[len(src)-1].Offset != 29 {
		t.Fatalf("compaction left %d records up to offset %d; want gaps", len(src), src[len(src)-1].Offset)
	}
	m := startMirror(t, Config{
		Source: a.Brokers(), Target: b.Brokers(), Topics: []string{"state"},
		OffsetSyncsTopic: "syncs", OffsetSyncsOnTarget: true,
	})
	caughtUp(t, m)
	checkCopy(t, ac, bc, "state", "state", 0, 0)
	syncs := readSyncs(t, bc, "syncs")
	if len(syncs) != len(src) {
		t.Fatalf("%d syncs for %d records", len(syncs), len(src))
	}
	for i, s := range syncs {
		if s.upstream != src[i].Offset || s.downstream != int64(i) {
			t.Fatalf("sync %d = %+v, want upstream %d downstream %d", i, s, src[i].Offset, i)
		}
	}
	if lag, err := m.Lag(); err != nil || lag != 0 {
		t.Fatalf("Lag() = %d, %v; want 0", lag, err)
	}
}

// TestSourceOutage produces continuously to A while A fails (or stops) and
// comes back: B holds what was copied before the outage, and afterwards
// holds exactly A's records, in order, once each.
func TestSourceOutage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		down, back func(t *testing.T, k *devstack.Kafka)
	}{
		{"fail", func(_ *testing.T, k *devstack.Kafka) { k.Fail() }, func(_ *testing.T, k *devstack.Kafka) { k.Recover() }},
		{"stop", func(_ *testing.T, k *devstack.Kafka) { k.Stop() }, func(t *testing.T, k *devstack.Kafka) {
			if err := k.Restart(); err != nil {
				t.Fatal(err)
			}
		}},
		// A hung cluster answers nothing: requests in flight time out (5 s)
		// and their connections must be replaced.
		{"hang", func(_ *testing.T, k *devstack.Kafka) { k.Hang() }, func(_ *testing.T, k *devstack.Kafka) { k.Recover() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const prefill = 2
			a, b := pair(t, map[string]int32{"orders": 2})
			ac, bc := newClient(t, a), newClient(t, b)
			m := startMirror(t, Config{
				Source: a.Brokers(), Target: b.Brokers(), SourceName: "A", TargetName: "B",
				Topics: []string{"orders"}, TargetPrefill: prefill,
				OffsetSyncsTopic: "syncs", OffsetSyncsOnTarget: true,
			})
			pl := startProducerLoop(t, a, "orders", 2)
			pl.waitAcked(t, 100)
			wait.For(t, 20*time.Second, "some records copied", func() error {
				if c := m.Copied(); c < 50 {
					return fmt.Errorf("copied %d", c)
				}
				return nil
			})

			tc.down(t, a)
			// Once the mirror can no longer read, B holds everything it
			// copied, and the mirror knows it.
			var before int64
			wait.For(t, 20*time.Second, "B holds what the mirror copied", func() error {
				c := m.Copied()
				var onB int64
				for part := range int32(2) {
					msgs, err := tryReadAll(bc, "orders", part)
					if err != nil {
						return err
					}
					onB += int64(len(msgs) - prefill)
				}
				if c2 := m.Copied(); c2 != c || onB != c {
					return fmt.Errorf("B holds %d copied records; the mirror copied %d, then %d", onB, c, c2)
				}
				before = c
				return nil
			})
			if tc.name != "hang" { // where it would take a timeout
				if _, err := m.Lag(); err == nil {
					t.Fatal("Lag() succeeded with the source down")
				}
			}

			tc.back(t, a)
			pl.waitAcked(t, 100)
			pl.stop()
			caughtUp(t, m)
			if m.Copied() <= before {
				t.Fatalf("nothing copied after the source came back (copied %d)", m.Copied())
			}
			var onA int64
			for part := range int32(2) {
				checkCopy(t, ac, bc, "orders", "orders", part, prefill)
				onA += int64(len(readAll(t, ac, "orders", part)))
			}
			if m.Copied() != onA {
				t.Fatalf("Copied() = %d, A holds %d", m.Copied(), onA)
			}
			acked, failed := pl.counts()
			t.Logf("producer: %d acknowledged, %d failed; A holds %d; mirror copied %d before the outage", acked, failed, onA, before)
		})
	}
}

// TestTargetOutage fails or restarts B while records flow: nothing is lost
// or written twice.
func TestTargetOutage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		down, back func(t *testing.T, k *devstack.Kafka)
	}{
		{"fail", func(_ *testing.T, k *devstack.Kafka) { k.Fail() }, func(_ *testing.T, k *devstack.Kafka) { k.Recover() }},
		{"stop", func(_ *testing.T, k *devstack.Kafka) { k.Stop() }, func(t *testing.T, k *devstack.Kafka) {
			if err := k.Restart(); err != nil {
				t.Fatal(err)
			}
		}},
		// A hung cluster answers nothing: requests in flight time out (5 s)
		// and their connections must be replaced.
		{"hang", func(_ *testing.T, k *devstack.Kafka) { k.Hang() }, func(_ *testing.T, k *devstack.Kafka) { k.Recover() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := pair(t, map[string]int32{"orders": 2})
			ac, bc := newClient(t, a), newClient(t, b)
			m := startMirror(t, Config{
				Source: a.Brokers(), Target: b.Brokers(), Topics: []string{"orders"}, TargetPrefill: 1,
				OffsetSyncsTopic: "syncs", // on the source
			})
			pl := startProducerLoop(t, a, "orders", 2)
			pl.waitAcked(t, 100)
			tc.down(t, b)
			pl.waitAcked(t, 100)
			wait.For(t, 20*time.Second, "lag while B is down", func() error {
				if lag, err := m.Lag(); err != nil || lag < 150 {
					return fmt.Errorf("lag %d, %v", lag, err)
				}
				return nil
			})
			tc.back(t, b)
			pl.waitAcked(t, 100)
			pl.stop()
			caughtUp(t, m)
			var onA int
			for part := range int32(2) {
				checkCopy(t, ac, bc, "orders", "orders", part, 1)
				onA += len(readAll(t, ac, "orders", part))
			}
			if syncs := readSyncs(t, ac, "syncs"); len(syncs) < onA {
				t.Fatalf("%d offset-syncs for %d records", len(syncs), onA)
			}
		})
	}
}

// TestUnknownOutcome makes B answer produce requests with errors that come
// after the append: the mirror must see that the records landed and not
// write them again.
func TestUnknownOutcome(t *testing.T) {
	t.Parallel()
	for _, fault := range []*kerr.Error{kerr.NotEnoughReplicasAfterAppend, kerr.RequestTimedOut} {
		t.Run(fault.Message, func(t *testing.T) {
			a, b := pair(t, map[string]int32{"orders": 1})
			ac, bc := newClient(t, a), newClient(t, b)
			p := newProducer(t, ac)
			m := startMirror(t, Config{Source: a.Brokers(), Target: b.Brokers(), Topics: []string{"orders"}, TargetPrefill: 2})
			h := b.Cluster().Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: "orders", Err: fault, Count: 3})
			defer h.Remove()
			produceN(t, p, "orders", 0, 0, 20)
			caughtUp(t, m)
			produceN(t, p, "orders", 0, 20, 20)
			caughtUp(t, m)
			if h.Hits() != 3 {
				t.Fatalf("the fault fired %d times, want 3", h.Hits())
			}
			checkCopy(t, ac, bc, "orders", "orders", 0, 2)
			if m.Copied() != 40 {
				t.Fatalf("Copied() = %d, want 40", m.Copied())
			}
		})
	}
}

// TestForeignWriter: records that another client wrote to the target while
// the mirror's write failed are skipped over, not taken for copies.
func TestForeignWriter(t *testing.T) {
	t.Parallel()
	a, b := pair(t, map[string]int32{"orders": 1})
	ac, bc := newClient(t, a), newClient(t, b)
	p := newProducer(t, ac)
	m := startMirror(t, Config{Source: a.Brokers(), Target: b.Brokers(), Topics: []string{"orders"}})
	produceN(t, p, "orders", 0, 0, 5)
	caughtUp(t, m)

	// The next write fails, then a stranger writes, then writes succeed.
	h := b.Cluster().Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: "orders", Err: kerr.NotLeaderForPartition, Count: 1})
	defer h.Remove()
	produceN(t, p, "orders", 0, 5, 1)
	wait.For(t, 10*time.Second, "fault hit", func() error {
		if h.Hits() == 0 {
			return errors.New("not yet")
		}
		return nil
	})
	stranger := &sarama.ProducerMessage{Topic: "orders", Partition: 0, Value: sarama.StringEncoder("stranger")}
	if _, _, err := newProducer(t, bc).SendMessage(stranger); err != nil {
		t.Fatal(err)
	}
	produceN(t, p, "orders", 0, 6, 4)
	caughtUp(t, m)
	got := readAll(t, bc, "orders", 0)
	var values []string
	for _, g := range got {
		values = append(values, string(g.Value))
	}
	// Where the stranger lands depends on timing; every copy appears in
	// order, and at most one twice.
	var copies []string
	for _, v := range values {
		if v != "stranger" {
			copies = append(copies, v)
		}
	}
	if len(copies) < 10 || len(copies) > 11 || len(values) != len(copies)+1 {
		t.Fatalf("target holds %q; want the 10 copies (one possibly twice) and the stranger", values)
	}
	seen := 0
	for _, v := range copies {
		if v == fmt.Sprint(message("orders", 0, seen).Value) {
			seen++
		} else if seen == 0 || v != fmt.Sprint(message("orders", 0, seen-1).Value) {
			t.Fatalf("target holds %q: out of order", values)
		}
	}
	if seen != 10 {
		t.Fatalf("target holds %q: missing copies", values)
	}
}

// TestIdleMirrorWaits: with nothing to copy, the mirror long-polls its
// source rather than spinning.
func TestIdleMirrorWaits(t *testing.T) {
	t.Parallel()
	a, b := pair(t, map[string]int32{"orders": 3})
	h := a.Cluster().Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Fetch}, Observe: true, Count: -1})
	defer h.Remove()
	m := startMirror(t, Config{Source: a.Brokers(), Target: b.Brokers(), Topics: []string{"orders"}, FetchMaxWait: 100 * time.Millisecond})
	caughtUp(t, m)
	before := h.Hits()
	time.Sleep(time.Second) // the thing measured: requests over a second
	if n := h.Hits() - before; n > 15 {
		t.Fatalf("%d fetches in a second while idle, want about 10 (FetchMaxWait 100ms)", n)
	}
}

// TestStopWhileSourceDown: Stop returns promptly whatever the source does.
func TestStopWhileSourceDown(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		down func(k *devstack.Kafka)
	}{
		{"fail", (*devstack.Kafka).Fail},
		{"stop", (*devstack.Kafka).Stop},
		{"hang", (*devstack.Kafka).Hang},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := pair(t, map[string]int32{"orders": 2})
			produceN(t, newProducer(t, newClient(t, a)), "orders", 0, 0, 5)
			m := startMirror(t, Config{Source: a.Brokers(), Target: b.Brokers(), Topics: []string{"orders"}})
			caughtUp(t, m)
			tc.down(a)
			t.Cleanup(a.Recover)
			// Let the mirror run into the outage: a failed fetch, a
			// metadata refresh, a backoff.
			time.Sleep(500 * time.Millisecond)
			start := time.Now()
			m.Stop()
			if took := time.Since(start); took > 2*time.Second {
				t.Fatalf("Stop took %v with the source down (%s)", took, tc.name)
			} else {
				t.Logf("Stop took %v", took.Round(time.Millisecond))
			}
		})
	}
}

// TestContextEndsMirror: the context given to Start bounds the mirror.
func TestContextEndsMirror(t *testing.T) {
	t.Parallel()
	a, b := pair(t, map[string]int32{"orders": 1})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m, err := Start(ctx, Config{Source: a.Brokers(), Target: b.Brokers(), Topics: []string{"orders"}})
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	select {
	case <-m.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("mirror still running 5s after its context ended")
	}
	m.Stop()
	if err := m.CaughtUp(context.Background()); !errors.Is(err, ErrStopped) {
		t.Fatalf("CaughtUp = %v, want ErrStopped", err)
	}
}

// TestPartitionsAdded: with PartitionRefresh, partitions added to a source
// topic while the mirror runs are created on the target and copied from
// their start, as MirrorMaker 2 does; the partitions copied before go on.
func TestPartitionsAdded(t *testing.T) {
	t.Parallel()
	const n, prefill = 20, 3
	a, b := pair(t, map[string]int32{"orders": 2})
	m := startMirror(t, Config{
		Source: a.Brokers(), Target: b.Brokers(), SourceName: "A", TargetName: "B",
		Topics: []string{"orders"}, RemoteTopic: func(t string) string { return "A." + t },
		TargetPrefill: prefill, PartitionRefresh: 100 * time.Millisecond,
	})
	p := newProducer(t, newClient(t, a))
	for part := range int32(2) {
		produceN(t, p, "orders", part, 0, n)
	}
	caughtUp(t, m)
	if err := a.AddPartitions("orders", 4); err != nil {
		t.Fatal(err)
	}
	p = newProducer(t, newClient(t, a)) // metadata with 4 partitions
	for part := range int32(4) {
		produceN(t, p, "orders", part, n, n)
	}
	wait.For(t, 10*time.Second, "the mirror copies 4 partitions", func() error {
		if got := len(m.partitions()); got != 4 {
			return fmt.Errorf("%d partitions", got)
		}
		return nil
	})
	caughtUp(t, m)
	ac, bc := newClient(t, a), newClient(t, b)
	for part := range int32(4) {
		checkCopy(t, ac, bc, "orders", "A.orders", part, prefill)
	}
}

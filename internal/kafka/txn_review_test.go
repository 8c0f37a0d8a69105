package kafka_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testenv"
)

// TestTxnCommitAfterAnotherStreamLostTheConnection: two streams share the
// metadata client's connection to their coordinator. Stream B's EndTxn
// commit loses it (B is broken: its outcome is unknown) and B closes the
// shared connection; stream A's EndTxn commit, sent after, was never
// written on a closed connection: it is sent on a new one and commits,
// rather than A being broken too.
func TestTxnCommitAfterAnotherStreamLostTheConnection(t *testing.T) {
	const parts, idA, idB = 3, "kswitch/test/C/in/A/20", "kswitch/test/C/in/B/20"
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{"a": parts, "b": parts}})
	p := newProducer(t, k, testConfig(), newRecorder())
	a := openTxn(t, p, idA)
	b := openTxn(t, p, idB)
	msgsA := records("a", parts, 0, 60)
	produceTxn(t, a, msgsA)
	produceTxn(t, b, records("b", parts, 0, 60))
	writtenAtLeast(t, k, "a", parts, 60)
	writtenAtLeast(t, k, "b", parts, 60)

	c := k.Cluster()
	c.ControlKey(int16(kmsg.EndTxn), func(req kmsg.Request) (kmsg.Response, error, bool) {
		if req.(*kmsg.EndTxnRequest).TransactionalID != idB {
			return nil, nil, false
		}
		c.DropControl()
		return nil, errors.New("connection cut by the test"), true
	})
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if _, err := b.Commit(ctx, nil); !errors.Is(err, kafka.ErrTxnBroken) {
		t.Fatalf("B's Commit with its EndTxn unanswered: %v, want ErrTxnBroken", err)
	}
	got, err := a.Commit(ctx, nil)
	if err != nil {
		t.Fatalf("A's Commit after B lost the shared coordinator connection: %v (stats %+v)", err, a.Stats())
	}
	if len(got) != len(msgsA) {
		t.Fatalf("A committed %d records, want %d", len(got), len(msgsA))
	}
	committedVerdict(t, k, "a", parts, prefixes(msgsA))
}

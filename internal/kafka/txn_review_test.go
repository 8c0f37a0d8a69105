package kafka_test

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// TestTxnCommitAfterAnotherStreamLostTheConnection: two streams share the
// metadata client's connection to their coordinator. Stream B's EndTxn
// commit loses it (B is broken: its outcome is unknown) and B closes the
// shared connection; stream A's EndTxn commit, sent after, was never
// written on a closed connection: it is sent on a new one and commits,
// rather than A being broken too.
func TestTxnCommitAfterAnotherStreamLostTheConnection(t *testing.T) {
	t.Parallel()
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

// TestTxnTopicNotAuthorizedIsRefused: AddPartitionsToTxn answers
// TOPIC_AUTHORIZATION_FAILED for one topic of the transaction (for good,
// as an ACL the producer lacks): the transaction is aborted with that
// topic's records in TxnAbortedError.Refused (the router's dead letter,
// as the idempotent path refuses them), and the next Commit commits the
// other records once, rather than every Commit aborting again.
func TestTxnTopicNotAuthorizedIsRefused(t *testing.T) {
	t.Parallel()
	const parts = 3
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{"out": parts, "secret": 1}})
	p := newProducer(t, k, testConfig(), newRecorder())
	s := openTxn(t, p, "kswitch/test/C/in/A/21")
	denyAddPartitions(k.Cluster(), "secret")
	out := records("out", parts, 0, 30)
	var secret []*kafka.Message
	for i, m := range out {
		produceTxn(t, s, []*kafka.Message{m})
		if i%6 == 0 {
			sm := &kafka.Message{Topic: "secret", Value: []byte("secret " + strconv.Itoa(i))}
			secret = append(secret, sm)
			produceTxn(t, s, []*kafka.Message{sm})
		}
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	_, err := s.Commit(ctx, nil)
	var ae *kafka.TxnAbortedError
	if !errors.As(err, &ae) || !errors.Is(err, sarama.ErrTopicAuthorizationFailed) {
		t.Fatalf("Commit with a topic not authorized: %v, want a TxnAbortedError for TOPIC_AUTHORIZATION_FAILED", err)
	}
	if !slices.Equal(ae.Refused, secret) {
		t.Fatalf("Refused: %d messages, want the %d to the topic not authorized", len(ae.Refused), len(secret))
	}
	if got := commit(t, s, nil); !slices.Equal(got, out) {
		t.Fatalf("the next Commit: %d records, want the %d others", len(got), len(out))
	}
	committedVerdict(t, k, "out", parts, prefixes(out))
}

// TestTxnMessagesAfterADenialAreRefusedToo: records to a topic given
// after the coordinator refused to add it to the transaction are refused
// with the ones before, not carried into the next transaction (where
// every commit would abort again): the denial holds for the partition,
// not for the records it was asked for.
func TestTxnMessagesAfterADenialAreRefusedToo(t *testing.T) {
	t.Parallel()
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{"out": 1, "secret": 1}})
	p := newProducer(t, k, testConfig(), newRecorder())
	s := openTxn(t, p, "kswitch/test/C/in/A/22")
	answered := denyAddPartitions(k.Cluster(), "secret")
	first := &kafka.Message{Topic: "secret", Value: []byte("secret 0")}
	produceTxn(t, s, []*kafka.Message{first})
	wait.For(t, 10*time.Second, "the coordinator's refusal", func() error {
		if answered() == 0 {
			return errors.New("not answered yet")
		}
		return nil
	})
	secret := []*kafka.Message{first}
	out := records("out", 1, 0, 4)
	for i, m := range out {
		sm := &kafka.Message{Topic: "secret", Value: []byte("secret " + strconv.Itoa(i+1))}
		secret = append(secret, sm)
		produceTxn(t, s, []*kafka.Message{m, sm})
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	_, err := s.Commit(ctx, nil)
	var ae *kafka.TxnAbortedError
	if !errors.As(err, &ae) {
		t.Fatalf("Commit: %v, want a TxnAbortedError", err)
	}
	if !slices.Equal(ae.Refused, secret) {
		t.Fatalf("refused %d records, want the %d to the topic not authorized", len(ae.Refused), len(secret))
	}
	if got := commit(t, s, nil); !slices.Equal(got, out) {
		t.Fatalf("the next Commit: %d records, want the %d others", len(got), len(out))
	}
}

// denyAddPartitions answers every AddPartitionsToTxn that names topic as
// Kafka answers one naming a topic the producer may not write:
// TOPIC_AUTHORIZATION_FAILED for its partitions, OPERATION_NOT_ATTEMPTED
// for the others (kfake's authorization, ACL or Fault, refuses every
// partition of the request with the topic's error).
func denyAddPartitions(c *kfake.Cluster, topic string) (answered func() int64) {
	var n atomic.Int64
	c.ControlKey(int16(kmsg.AddPartitionsToTxn), func(kr kmsg.Request) (kmsg.Response, error, bool) {
		req := kr.(*kmsg.AddPartitionsToTxnRequest)
		if !slices.ContainsFunc(req.Topics, func(rt kmsg.AddPartitionsToTxnRequestTopic) bool { return rt.Topic == topic }) {
			return nil, nil, false
		}
		c.KeepControl()
		resp := req.ResponseKind().(*kmsg.AddPartitionsToTxnResponse)
		resp.Version = req.Version
		for _, rt := range req.Topics {
			st := kmsg.NewAddPartitionsToTxnResponseTopic()
			st.Topic = rt.Topic
			code := kerr.OperationNotAttempted.Code
			if rt.Topic == topic {
				code = kerr.TopicAuthorizationFailed.Code
			}
			for _, p := range rt.Partitions {
				sp := kmsg.NewAddPartitionsToTxnResponseTopicPartition()
				sp.Partition, sp.ErrorCode = p, code
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		n.Add(1)
		return resp, nil, true
	})
	return n.Load
}

package routing

import (
	"cmp"
	"errors"
	"strconv"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/record"
)

// Exactly-once delivery (config.Cluster.Delivery exactly_once).
//
// The records of one source partition bound for channels on one
// exactly_once cluster go through one transactional producer (a
// txnProducer over its wire, a kafka.TxnStream on the cluster's
// transactional Producer: txnwire.go), whose
// transactional.id is derived from the fleet, the cluster and the
// partition's stream (its logical topic, origin and number: the same for
// every physical copy, so that an owner on B fences the last owner on A).
// Every transaction_interval the producer adds the partition's position
// (the offset after the last record in the transaction) to the cluster's
// positions topic and commits: the records and the position become
// visible together, and only then are the records acknowledged to the
// agent, which commits its own position to etcd afterwards. etcd's
// position is therefore never ahead of the cluster's.
//
// A new owner opens the producer with the same transactional.id (Kafka
// aborts the last owner's open transaction and fences it), reads the
// position committed last, and skips, for this cluster, the records before
// it that it consumes again from etcd's older position. An owner is the
// agent consuming the partition under one generation and session
// (record.Record): when they change, the producer is opened again.

// txnKey identifies a transactional producer: the exactly_once cluster
// and the source partition's stream.
type txnKey struct {
	cluster, topic, origin string
	partition              int32
}

func txnKeyOf(cluster string, rec *record.Record) txnKey {
	// A record from a runtime that does not name the streams (an
	// embedding's own) is its own stream.
	return txnKey{cluster: cluster, topic: cmp.Or(rec.SourceTopic, rec.Topic), origin: cmp.Or(rec.Origin, rec.Cluster), partition: rec.Partition}
}

// positionKey is the key of the stream's position in the positions topic.
func (k txnKey) positionKey(fleet string) string {
	return fleet + "/" + k.topic + "/" + k.origin + "/" + strconv.Itoa(int(k.partition))
}

// transactionalID is the producer's transactional.id.
func (k txnKey) transactionalID(fleet string) string {
	return "kswitch/" + fleet + "/" + k.cluster + "/" + k.topic + "/" + k.origin + "/" + strconv.Itoa(int(k.partition))
}

// owner is a partition's owner as its records name it: the generation
// and its term's token, and the agent's session (record.Record).
type owner struct{ token, gen, session int64 }

// ownerOf is the owner that consumed rec.
func ownerOf(rec *record.Record) owner { return owner{rec.Token, rec.Generation, rec.Session} }

// fenced reports whether err says that another producer with the same
// transactional.id took over.
func fenced(err error) bool {
	return errors.Is(err, kafka.ErrTxnFenced) || errors.Is(err, sarama.ErrProducerFenced) || errors.Is(err, sarama.ErrInvalidProducerEpoch) ||
		errors.Is(err, sarama.ErrTransactionCoordinatorFenced)
}

package kafka

import (
	"errors"

	"github.com/IBM/sarama"
)

// This file holds what kswitch's own Kafka requests (sent with sarama's
// Broker API: the mirror's fetches and produces, the translator's fetches)
// need to speak like sarama's consumer and producer do.

// FetchVersion returns the Fetch request version sarama's consumer sends
// to a cluster of Kafka version v. From 4 (Kafka 0.11) responses carry
// record batches and the last stable offset; from 7 fetch sessions.
func FetchVersion(v sarama.KafkaVersion) int16 {
	switch {
	case v.IsAtLeast(sarama.V2_7_0_0):
		return 12
	case v.IsAtLeast(sarama.V2_3_0_0):
		return 11
	case v.IsAtLeast(sarama.V2_1_0_0):
		return 10
	case v.IsAtLeast(sarama.V2_0_0_0):
		return 8
	case v.IsAtLeast(sarama.V1_1_0_0):
		return 7
	case v.IsAtLeast(sarama.V1_0_0_0):
		return 6
	case v.IsAtLeast(sarama.V0_11_0_0):
		return 5
	case v.IsAtLeast(sarama.V0_10_1_0):
		return 3
	case v.IsAtLeast(sarama.V0_10_0_0):
		return 2
	case v.IsAtLeast(sarama.V0_9_0_0):
		return 1
	default:
		return 0
	}
}

// ProduceVersion returns the Produce request version sarama's producer
// sends to a cluster of Kafka version v. From 3 (Kafka 0.11) requests
// carry record batches.
func ProduceVersion(v sarama.KafkaVersion) int16 {
	switch {
	case v.IsAtLeast(sarama.V3_7_0_0):
		return 10
	case v.IsAtLeast(sarama.V2_8_0_0):
		return 9
	case v.IsAtLeast(sarama.V2_4_0_0):
		return 8
	case v.IsAtLeast(sarama.V2_1_0_0):
		return 7
	case v.IsAtLeast(sarama.V2_0_0_0):
		return 6
	case v.IsAtLeast(sarama.V1_0_0_0):
		return 5
	case v.IsAtLeast(sarama.V0_11_0_0):
		return 3
	case v.IsAtLeast(sarama.V0_10_0_0):
		return 2
	default:
		return 1
	}
}

// CloseOnTransportError closes the connection to b after a request on it
// failed with anything but a Kafka error code or a local encoding error.
// sarama closes a broker connection by itself on some transport errors but
// not on a read timeout, and after one every later request on that
// connection fails at once with the same timeout, for every user of the
// client, until someone calls Close; the client's next Leader or
// Coordinator call reconnects. Close waits for the broker's lock, so call
// it from the goroutine that made the request.
func CloseOnTransportError(b *sarama.Broker, err error) {
	var kerr sarama.KError
	var encErr sarama.PacketEncodingError
	if err == nil || errors.As(err, &kerr) || errors.As(err, &encErr) {
		return
	}
	_ = b.Close() // ErrNotConnected when already closed: fine
}

// InitProducerIDVersion returns the InitProducerID request version to send
// to a cluster of Kafka version v: what sarama's client sends. The
// idempotent producer asks for a new producer id at every bump (-1/-1 from
// 3 on), so it needs no more than 0 (Kafka 0.11). A TxnStream's bump after
// an abort sends its producer id and epoch (KIP-360), which 3 (Kafka 2.5)
// carries; below, the broker bumps the id's epoch as at open.
func InitProducerIDVersion(v sarama.KafkaVersion) int16 {
	switch {
	case v.IsAtLeast(sarama.V2_7_0_0):
		return 4
	case v.IsAtLeast(sarama.V2_5_0_0):
		return 3
	case v.IsAtLeast(sarama.V2_4_0_0):
		return 2
	case v.IsAtLeast(sarama.V2_0_0_0):
		return 1
	default:
		return 0
	}
}

// The transaction requests' versions (docs/RELAY.md §4, §5): what sarama's
// transaction manager sends to a cluster of Kafka version v, our ceiling;
// each broker's ApiVersions lowers it (sarama's Broker clamps a request to
// the broker's maximum). Transactions need Kafka 0.11 (version 0 of each).

// AddPartitionsToTxnVersion: 2 adds PRODUCER_FENCED, 3 is flexible. Not 4
// (KIP-890 batches of transactional ids, for brokers only).
func AddPartitionsToTxnVersion(v sarama.KafkaVersion) int16 {
	return txnRequestVersion(v)
}

// EndTxnVersion: 2 adds PRODUCER_FENCED, 3 is flexible. Not 5 (KIP-890
// part 2: the epoch bumped by every EndTxn), which sarama does not speak.
func EndTxnVersion(v sarama.KafkaVersion) int16 {
	return txnRequestVersion(v)
}

func txnRequestVersion(v sarama.KafkaVersion) int16 {
	switch {
	case v.IsAtLeast(sarama.V2_8_0_0):
		return 3
	case v.IsAtLeast(sarama.V2_7_0_0):
		return 2
	case v.IsAtLeast(sarama.V2_0_0_0):
		return 1
	default:
		return 0
	}
}

// FindCoordinatorVersion: 1 adds the key type (a transaction coordinator,
// not only a group's), 3 is flexible. Not 4 (KIP-699 batches of keys).
func FindCoordinatorVersion(v sarama.KafkaVersion) int16 {
	switch {
	case v.IsAtLeast(sarama.V2_4_0_0):
		return 3
	case v.IsAtLeast(sarama.V2_0_0_0):
		return 2
	case v.IsAtLeast(sarama.V0_11_0_0):
		return 1
	default:
		return 0
	}
}

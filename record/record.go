// Package record is what an agent hands on: a consumed Kafka record and
// the Handler that receives it. It imports nothing of kswitch, so a sink
// (the routing package, or an embedding program's own handler) depends on
// it alone and not on the agent's runtime.
package record

import (
	"context"
	"strings"
	"time"
)

// Header is one Kafka record header.
type Header struct {
	Key   []byte
	Value []byte
}

// Record is one consumed Kafka record, handed to a Handler.
type Record struct {
	// Cluster is the cluster the record was consumed from.
	Cluster string
	// Topic is the topic's name on Cluster; SourceTopic its logical name,
	// the same for every physical copy of the topic on every cluster
	// (orders for A's orders and B.orders, and B's A.orders and orders).
	Topic       string
	SourceTopic string
	// Origin is the cluster whose producers wrote the record: Cluster
	// for its local topics, the other cluster for a MirrorMaker 2 copy
	// (A for A.orders on B, B for B.orders on A).
	Origin string
	// TopicID is the identity Kafka gave Topic: the cluster's id and the
	// topic's, "<cluster id>/<topic id>" ("" unknown: a runtime that does
	// not say, or a cluster before Kafka 2.8). A topic deleted and created
	// again under the same name gets a new topic id and offsets from 0
	// again: an offset says which record it is only together with it (see
	// SameTopic).
	TopicID   string
	Partition int32
	Offset    int64
	Key       []byte
	Value     []byte
	Headers   []Header
	Timestamp time.Time
	// Generation is the assignment generation under which the agent
	// consumes this partition, and Session the etcd lease of the agent's
	// session: an agent that lost its session and registered again may
	// consume a partition again from its committed offset under the same
	// generation, but never under the same session. Token is the fencing
	// token of the leader term that published Generation: generations are
	// ordered within a token, and a later token's come after an earlier
	// token's whatever their numbers (a term may start them again at 1,
	// when someone else wrote one near the bound agents accept).
	Generation int64
	Session    int64
	Token      int64

	acker Acker
}

// Owned names a partition as one owner consumes it: the fields that its
// records carry besides their content and offset.
type Owned struct {
	Cluster, Topic, SourceTopic, Origin string
	Partition                           int32
	Generation, Session, Token          int64
}

// Owned returns the partition and owner r comes from.
func (r *Record) Owned() Owned {
	return Owned{Cluster: r.Cluster, Topic: r.Topic, SourceTopic: r.SourceTopic, Origin: r.Origin, Partition: r.Partition,
		Generation: r.Generation, Session: r.Session, Token: r.Token}
}

// Acker is told when a record is acknowledged: the runtime that delivered
// the record (an agent follows each partition's acknowledged prefix).
type Acker interface {
	Ack()
}

// SetAcker sets what Ack calls. The runtime that delivers the record sets
// it before a Handler sees the record; a handler never calls it.
func (r *Record) SetAcker(a Acker) { r.acker = a }

// Ack marks the record handled. It may be called from any goroutine, at
// any time after Handle received the record; calls after the first are
// ignored. The partition's committed offset moves past a record only once
// it and every record before it are acknowledged.
func (r *Record) Ack() {
	if r.acker != nil {
		r.acker.Ack()
	}
}

// Size is what the record counts against an agent's bytes in flight: its
// key, value and headers.
func (r *Record) Size() int64 {
	n := len(r.Key) + len(r.Value)
	for _, h := range r.Headers {
		n += len(h.Key) + len(h.Value)
	}
	return int64(n)
}

// Handler receives the records of the partitions an agent owns.
//
// Handle is called for the records of one partition in offset order and
// never concurrently for one partition; different partitions are handled
// concurrently. It should hand the record on and return quickly; it acks
// the record (then or later, from any goroutine) once it is done with it.
// An error means "not now": the same record is offered again after a
// backoff, so delivery stays at-least-once and in order. The record is
// read-only: the agent fingerprints the last records before each commit
// position from it. Its key, value and headers are slices of the fetched
// response: once the record and every one before it are acknowledged, the
// agent drops them (so that the response's memory is freed), so copy
// what you keep past Ack. ctx ends when the partition is revoked or the agent
// stops; records not acknowledged by then are consumed again by the
// partition's next owner.
type Handler interface {
	Handle(ctx context.Context, r *Record) error
}

// DeadLetterCounter is implemented by a Handler that sends the records it
// cannot deliver to a dead-letter channel (the routing sink does). The
// agent publishes the counts, and a staged move's health check reads
// them: a stage whose topics are dead-lettered on the new cluster is
// rolled back.
type DeadLetterCounter interface {
	// DeadLettered returns, by logical topic (Record.SourceTopic), the
	// records dead-lettered since the handler was created.
	DeadLettered() map[string]int64
}

// Keeper is implemented by a Handler that says how many bytes it keeps
// in memory for each record handed to it and not yet acknowledged, beyond
// the record's key, value and headers (its own bookkeeping: a produce
// message, a queue entry). The agent's byte budget
// (source.max_in_flight_mib) charges that much per record, so that the
// budget bounds what the process holds. A Handler without the method is
// charged DefaultKeptPerRecord.
type Keeper interface {
	KeptPerRecord() int
}

// DefaultKeptPerRecord is what a Handler that is not a Keeper is charged
// per record: the routing sink's produce message (384 B) and its
// producer's batch entry.
const DefaultKeptPerRecord = 448

// KeptPerRecord is what h keeps per record not yet acknowledged: its
// KeptPerRecord if it is a Keeper (negative counts as 0), else
// DefaultKeptPerRecord.
func KeptPerRecord(h Handler) int {
	if k, ok := h.(Keeper); ok {
		return max(k.KeptPerRecord(), 0)
	}
	return DefaultKeptPerRecord
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(ctx context.Context, r *Record) error

// Handle calls f.
func (f HandlerFunc) Handle(ctx context.Context, r *Record) error { return f(ctx, r) }

// SameTopic reports whether two topic identities (Record.TopicID) may be
// of the same topic, so that an offset of one says which record of the
// other it is. Unknown ("") on either side counts as the same, and so do
// identities of two different Kafka clusters: a cluster rebuilt, or its
// topics moved to other brokers, holds the same records at the same
// offsets under new ids (the configuration said so). Of the same
// cluster, another topic id is a topic deleted and created again.
func SameTopic(a, b string) bool {
	if a == "" || b == "" || a == b {
		return true
	}
	ca, ta, _ := cutIdentity(a)
	cb, tb, _ := cutIdentity(b)
	if ca != "" && cb != "" && ca != cb {
		return true
	}
	return ta == tb
}

// cutIdentity splits a topic identity into its cluster's id ("" when it
// has none: a topic id alone) and its topic's id.
func cutIdentity(id string) (cluster, topic string, ok bool) {
	i := strings.LastIndexByte(id, '/')
	if i < 0 {
		return "", id, false
	}
	return id[:i], id[i+1:], true
}

// Package routing is kswitch's routing sink: an record.Handler that
// evaluates rules against each consumed record and produces it to the
// channels they choose, a channel being a topic on any configured Kafka
// cluster.
//
// # Versions
//
// The rules and channels in force are a Version: the static layer (the
// routing section of the configuration file) merged with the dynamic layer
// in etcd (keys.Fleet.Routes(): mode, rules, default and dead_letter, which
// replace the file's as a whole when the key exists; keys.Fleet.Channel(name):
// one channel each, added to the file's or replacing the one of the same
// name). Compile validates a whole version before it is used — every
// expression compiles, every channel a rule, the default route or the
// dead-letter names exists, every channel's cluster is configured — and the
// Router swaps a new version in atomically between records. An invalid
// version is refused with its reason (logged, in Status, counted) and the
// last good one stays in force. kswitch_config_version is the number of the
// version in force: the etcd revision of the last change it includes (0 for
// the file alone), the same on every agent.
//
// # Rules
//
// Rules are evaluated in order. A rule's match is an expression
// (github.com/expr-lang/expr) yielding a bool; empty matches everything. In
// mode "first" (the default) the first matching rule decides; in mode "all"
// every matching rule adds its channels (each channel receives a record
// once) and a matching drop rule ends the evaluation. A record no rule
// matches goes to the default channels, and is dropped when there are none.
// A dropped record is acknowledged at once and counted.
//
// Expressions see (see Env): topic (the source topic's logical name, which
// stays the same after a switch to a replica named A.orders), partition,
// offset, key and value (the bytes as strings; a missing key is ""), json
// (the value parsed as JSON, nil when it is not JSON: write json?.field,
// and (json?.amount ?? 0) > 1000 in comparisons, as nil > 1000 is an
// evaluation error),
// headers (name → value), timestamp (a time.Time) and cluster (where the
// record was consumed).
//
// # Delivery
//
// A record is acknowledged (record.Record.Ack) only once every produce of it
// is acknowledged by its destination, so the agent never commits past a
// record that has not arrived everywhere. Handle returns an error — the
// agent offers the record again after a backoff, and the partition waits —
// while a channel of the record is paused (signals.State.ChannelPaused),
// while a destination of the record is failing, and while the producer of
// a cluster not produced to before is opening. Records of other channels
// keep flowing.
//
// A producer retries a produce in place, without limit and in order, while
// its destination is away: a destination cluster that is down makes its
// channels' records wait (the destination is failing after a second
// without an acknowledgement), and nothing is lost when it returns. The
// few produces that come back to the router without being refused for good
// (a topic whose partition count is not known yet, a producer retired when
// its cluster was redefined) are held and sent again in source order with
// a backoff up to RetryBackoffMax (recovery.go). Records the destination
// refuses for good (too
// large, invalid, not authorised, a partition that does not exist) go to
// the dead-letter channel when there is one. A rule or key expression that
// fails to evaluate sends the record to the dead-letter channel too, with
// the headers kswitch-error (why), kswitch-rule (the rule) and
// kswitch-source (topic/partition@offset where it was consumed); without a
// dead-letter channel Handle returns the error, so the partition stops and
// reports rather than skipping the record. A version that fixes the rule
// lets it continue.
//
// Every expression has a cost bound (budget.go): at most MaxRuleNodes
// nodes; ranges and builtins such as repeat within expr's memory budget;
// and per record at most MaxIterations runs of closure bodies (all, filter,
// map, reduce, ...), MaxBuiltBytes built by them and MaxEvalTime on the
// clock. A version whose expression exceeds the bound already on two test
// records (empty, and 1 KiB of JSON) is refused; a record on which it is
// exceeded goes to the dead-letter channel (reason budget in
// kswitch_routing_dead_lettered_total), so one costly rule cannot stop
// consumption, and a version that replaces it always takes effect.
//
// Delivery is at least once on an at_least_once cluster: a record is
// produced again after its producer lost track of it (a retired
// producer's unfinished records, a partition's next owner consuming what
// was not acknowledged), so it can arrive twice; the order of a source
// partition's records on a channel is kept. An exactly_once cluster gets
// each record once (txn.go: the design; txnset.go, the producers by
// stream; txnproducer.go and txncommit.go, one stream's transactions;
// txnposition.go, the positions topic; txnalign.go, a copy's alignment;
// txnwire.go, the wire).
//
// # Producers
//
// One internal/kafka Producer per destination cluster and acks, idempotent
// with acks all, is shared by the channels on it; the compression is the
// channel's, per batch. The router chooses each record's partition by its
// channel's partitioner (direct.go). A producer opens in the background
// when a version that routes to it comes into force (a record that finds
// it still connecting waits at most OpenWait), and is closed, after its
// records are acknowledged, once no channel that a rule, the default
// route or the dead-letter of the version in force names is on it. An
// exactly_once cluster has one transactional Producer of its own, with a
// kafka.TxnStream per source partition's stream (txnwire.go).
// sarama remains the protocol layer (requests, Broker, Client); no sarama
// AsyncProducer is on the record path.
package routing

// Package mirror is a small in-process replicator that plays MirrorMaker 2's
// part between two Kafka clusters (kfake clusters in kswitch's component
// tests and in `kswitch demo`): it copies every partition of the configured
// source topics to the same partition of their remote topics on the target,
// and can write MirrorMaker 2 offset-sync records as it goes.
//
// # What a copy preserves
//
// Each record keeps its key, value, headers and timestamp (sent as
// CreateTime, so the target stores the source's timestamp; a source batch
// with LogAppendTime is copied with that append time). Records of a
// partition are written in source order, one produce request at a time, so
// the target partition holds the source partition's records in order. Its
// offsets are not the source's: TargetPrefill makes them differ on purpose,
// and gaps in the source (compaction, transaction markers) are not
// reproduced. Offset-syncs record the actual pairs, taken from the target's
// produce responses, never computed.
//
// # How it works
//
// One goroutine owns all state. It loops: write what was fetched and not yet
// confirmed (and the offset-syncs for it), then fetch from every source
// partition (one long-poll Fetch per source broker). Requests go straight to
// the partition leaders through sarama's low-level Broker API, without
// sarama's producer or consumer: a produce request carries exactly one
// batch per partition, which Kafka appends atomically, and the mirror always
// knows which records a failed request held. On any error the loop backs off
// (RetryBackoff doubling to RetryBackoffMax) and tries again, indefinitely,
// resuming from where it stopped: a source or target that fails, hangs or
// restarts with its data is caught up when it returns.
//
// # Exactly once on the target, and where that ends
//
// A produce request whose outcome is unknown (connection cut, timeout, or
// any error answer: NOT_ENOUGH_REPLICAS_AFTER_APPEND and REQUEST_TIMED_OUT
// may come after the append) is not simply resent. First the mirror reads
// the target partition's high watermark: if it has not moved since the last
// confirmed write, nothing landed and the batch is resent; if it moved by k,
// the mirror reads those k records back and, when they are the next records
// of the batch (same key, value, timestamp and headers), counts them as
// copied and continues after them. This gives no loss, no reordering and no
// duplicates while the mirror is the target partition's only writer and the
// target does not lose acknowledged data. Otherwise:
//
//   - records on the target that the mirror did not write (another writer)
//     are logged and skipped over; the mirror's record at the point of
//     divergence may then be written twice;
//   - a target that shrank (restarted without its data) is logged; the
//     mirror continues at the new end and does not re-copy what was lost;
//   - a source that lost records the mirror had not yet copied (retention,
//     or a restart without data, seen as OFFSET_OUT_OF_RANGE) is logged, and
//     copying restarts at the source's oldest offset, as MirrorMaker 2 does
//     with auto.offset.reset=earliest.
//
// A new Mirror always starts at the source's oldest offsets: starting one
// again over a target that an earlier Mirror filled copies everything again.
// Partitions added to a source topic after Start are copied when
// Config.PartitionRefresh is set (as MirrorMaker 2 copies them), and not
// otherwise.
//
// # Offset-syncs
//
// With OffsetSyncsTopic set, every copied record gets an offset-sync record
// (as MirrorMaker 2 with offset.lag.max=0), encoded by
// translate.EncodeOffsetSync, the format kswitch's translator reads, on
// partition 0 of that topic. A record's sync is written after the target
// acknowledged the record and before the record counts as caught up
// (CaughtUp, Lag). The topic is created, with one partition and
// cleanup.policy=compact, if it is missing. A failure to write syncs stalls
// copying until they can be written, as a failure to write records does; a
// retried sync write may leave duplicate syncs, which are harmless.
//
// # Shutdown
//
// The mirror dials through its own dialer and closes every connection it
// made when Stop is called or the Start context ends, so Stop returns
// promptly even while a cluster hangs (requests never answered).
package mirror

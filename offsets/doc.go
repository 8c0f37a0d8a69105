// Package offsets is kswitch's committed-offset store: where each source
// partition's fleet position lives, how an agent commits it so that only the
// partition's current owner can, and how it is mirrored into the Kafka
// consumer group so that Kafka tooling sees it.
//
// # Model
//
// The fleet consumes source partitions of one cluster at a time; an agent
// consumes the partitions that a generation of state/assignment gives it
// (see state.Assignment). Its position in a partition is a Commit:
// the next offset to consume (Kafka's meaning: last consumed + 1), the
// timestamp of the last consumed record and the Fingerprints of the last
// few records, which let offset translation find the exact continuation
// point on another cluster.
//
// # Storage
//
// One etcd key per partition and cluster, keys.Fleet.Offset(cluster, topic,
// partition) = /kswitch/<fleet>/offsets/<cluster>/<topic>/<partition>,
// holding JSON:
//
//	{"offset":1042,"timestamp_ms":1767225600123,
//	 "fingerprints":["9f0c…","…"],"agent":"agent-2","generation":12,
//	 "committed_at":"2026-01-01T00:00:00.123Z"}
//
// timestamp_ms is absent when no record was consumed; fingerprints (16 hex
// digits each, oldest first, at most MaxFingerprints) may be absent.
// Readers refuse values over 64 KiB, with a negative offset, more than
// MaxFingerprints fingerprints, or more fingerprints than records before
// the offset. Unknown fields are ignored, so a newer writer can add some.
//
// A malformed value is reported as a *MalformedError naming the key (Load)
// or returned beside the good positions (List, LoadMany). Callers log and
// count it and treat the partition as having no committed offset: the
// fleet then starts the partition from its configured reset policy, which
// is what Kafka does with a group that has no offset for it. The next
// successful commit overwrites the bad value.
//
// # Fencing
//
// Store.Commit writes in one etcd transaction that applies only while the
// agent's registration key is still on the agent's session lease and
// state/assignment still has the revision the agent has applied (see
// Fence). A stale agent (session expired, or acting on an outdated
// assignment) gets ErrLeaseLost or ErrStaleGeneration and writes nothing.
// There is deliberately no compare on the previous offset: in a given
// generation the partition's owner is its only writer, and a rewind it
// commits (after a seek, say) is intended.
//
// # Kafka group mirror
//
// KafkaMirror copies commits into a Kafka consumer group with standalone
// OffsetCommit requests (generation -1, no member id), so that
// kafka-consumer-groups, lag monitors and MirrorMaker 2's checkpoint
// connector see the fleet's position. etcd stays the authority: the mirror
// is best effort and is never read back to resume.
package offsets

// Package translate finds, on another cluster, the position that continues
// a fleet position (an offsets.Commit): the primary's committed offset on
// its MirrorMaker 2 (or kswitch mirror) replica for a failover, and back
// for a failback.
//
// Translator tries the methods best first: the committed records'
// fingerprints found on the target (exact when the replica keeps key,
// value and timestamp), MirrorMaker 2's offset-syncs or checkpoints (may
// rewind, never skips), and the position's timestamp less a margin (may
// rewind by an unknown amount). The Translation says which method found
// it. The package also holds MirrorMaker 2's record codecs (offset-syncs,
// checkpoints), a cache of a switch's offset-syncs (SyncsCache), and
// CountBefore, which counts a replica's tail written before a moment.
//
// Its reads of Kafka go through internal/kafka's one partition reader.
package translate

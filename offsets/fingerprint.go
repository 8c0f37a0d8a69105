package offsets

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"strconv"
	"time"
)

// MaxFingerprints is how many fingerprints a Commit carries at most.
const MaxFingerprints = 8

// Fingerprint identifies one record by its content: a 64-bit FNV-1a hash of
// its key, value and timestamp (see FingerprintOf). A replica that preserves
// records (MirrorMaker 2, kswitch's demo mirror) gives a copied record the
// same fingerprint, whatever its offset there.
//
// It is written in JSON and text as 16 lowercase hex digits.
type Fingerprint uint64

// FingerprintOf returns the fingerprint of a record with this key, value and
// timestamp.
//
// The hash input is len(key) as 8 bytes big-endian, key, len(value), value,
// then the timestamp in Unix milliseconds (Kafka's precision; finer parts of
// ts are ignored) as 8 bytes big-endian. The lengths keep ("ab","c") and
// ("a","bc") apart. A nil key or value hashes like an empty one: Kafka
// clients disagree on whether a null key decodes to nil or to an empty
// slice, and the two records are never neighbours in practice.
//
// Headers are not hashed: replicators may add their own.
func FingerprintOf(key, value []byte, ts time.Time) Fingerprint {
	h := fnv.New64a()
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(key)))
	h.Write(n[:])
	h.Write(key)
	binary.BigEndian.PutUint64(n[:], uint64(len(value)))
	h.Write(n[:])
	h.Write(value)
	binary.BigEndian.PutUint64(n[:], uint64(ts.UnixMilli()))
	h.Write(n[:])
	return Fingerprint(h.Sum64())
}

// String returns the fingerprint as 16 lowercase hex digits.
func (f Fingerprint) String() string { return fmt.Sprintf("%016x", uint64(f)) }

// MarshalText implements encoding.TextMarshaler (and so JSON): 16 hex digits.
func (f Fingerprint) MarshalText() ([]byte, error) { return []byte(f.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler. It accepts exactly 16
// hex digits.
func (f *Fingerprint) UnmarshalText(b []byte) error {
	if len(b) != 16 {
		return fmt.Errorf("fingerprint %q: want 16 hex digits", b)
	}
	v, err := strconv.ParseUint(string(b), 16, 64)
	if err != nil {
		return fmt.Errorf("fingerprint %q: want 16 hex digits", b)
	}
	*f = Fingerprint(v)
	return nil
}

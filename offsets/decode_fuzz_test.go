package offsets

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"
)

// FuzzDecodeValue feeds offsets/<cluster>/<topic>/<partition> values, as
// a stranger could write them, to decodeValue: it never panics, every
// error is a *MalformedError naming the key, and what it accepts is a
// valid position that survives a round trip.
func FuzzDecodeValue(f *testing.F) {
	good, _ := encodeValue(Commit{Offset: 42, Timestamp: time.UnixMilli(1_700_000_000_123), Fingerprints: []Fingerprint{1, 2, 0xffffffffffffffff}},
		"agent-1", 7, time.Unix(1_700_000_001, 0))
	for _, seed := range []string{
		string(good), `{"offset":0}`, `{"offset":-1}`, `{}`, `{"offset":null}`, `{"offset":"1"}`,
		`{"offset":1,"fingerprints":["zz"]}`, `{"offset":1,"fingerprints":["0123456789abcdef","0123456789abcdeg"]}`,
		`{"offset":1,"timestamp_ms":-9223372036854775808}`, `{"offset":9223372036854775807,"timestamp_ms":9223372036854775807}`,
		`{"offset":1,"fingerprints":[` + strings.Repeat(`"0000000000000000",`, 20) + `"0000000000000000"]}`,
		`null`, `[`, "\xff", strings.Repeat(" ", MaxValueSize+1),
	} {
		f.Add([]byte(seed))
	}
	const key = "/kswitch/f/offsets/A/orders/3"
	f.Fuzz(func(t *testing.T, val []byte) {
		p, err := decodeValue(key, 9, "A", "orders", 3, val)
		if err != nil {
			var me *MalformedError
			if !errors.As(err, &me) || me.Key != key || !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v is not a *MalformedError naming %s", err, key)
			}
			return
		}
		if verr := validatePosition(p.Offset, len(p.Fingerprints)); verr != nil {
			t.Fatalf("accepted an invalid position %+v: %v", p, verr)
		}
		again, err := encodeValue(p.Commit, p.Agent, p.Generation, p.CommittedAt)
		if err != nil {
			t.Fatalf("an accepted position does not encode: %v", err)
		}
		q, err := decodeValue(key, 9, "A", "orders", 3, again)
		if err != nil || q.Offset != p.Offset || !q.Timestamp.Equal(p.Timestamp) || len(q.Fingerprints) != len(p.Fingerprints) {
			t.Fatalf("round trip of %+v: %+v, %v", p, q, err)
		}
	})
}

// FuzzDecodeOffsetSync feeds MirrorMaker 2 offset-sync records to
// DecodeOffsetSync: it never panics, and what it decodes encodes back to
// the record it came from (up to the bytes after the fields, which it
// ignores as Kafka's reader does).
func FuzzDecodeOffsetSync(f *testing.F) {
	k, v := EncodeOffsetSync("orders", 3, 100, 97)
	f.Add(k, v)
	f.Add(k[:len(k)-1], v)
	f.Add(k, v[:15])
	f.Add(append(bytes.Clone(k), 0xff), append(bytes.Clone(v), 1, 2, 3))
	f.Add([]byte{0xff, 0xff, 0, 0, 0, 0}, v) // string length -1
	f.Add([]byte{0x7f, 0xff}, v)             // string longer than the key
	f.Add([]byte{}, []byte{})
	f.Add([]byte(nil), []byte(nil))
	f.Fuzz(func(t *testing.T, key, value []byte) {
		s, err := DecodeOffsetSync(key, value)
		if err != nil {
			return
		}
		k2, v2 := EncodeOffsetSync(s.Topic, s.Partition, s.Upstream, s.Downstream)
		if !bytes.HasPrefix(key, k2) || !bytes.HasPrefix(value, v2) {
			t.Fatalf("decoded %+v from %x/%x, which encodes as %x/%x", s, key, value, k2, v2)
		}
	})
}

// FuzzDecodeCheckpoint feeds MirrorMaker 2 checkpoint records to
// DecodeCheckpoint: it never panics, refuses value versions other than 0,
// and what it decodes encodes back to the record it came from.
func FuzzDecodeCheckpoint(f *testing.F) {
	k, v := EncodeCheckpoint("orders-group", "A.orders", 3, 100, 97, "meta")
	f.Add(k, v)
	f.Add(k, append([]byte{0, 1}, v[2:]...)) // version 1
	f.Add(k[:5], v)
	f.Add(k, v[:len(v)-1])
	f.Add(append(bytes.Clone(k), 9), append(bytes.Clone(v), 9))
	f.Add([]byte{0x80, 0x00}, v) // string length -32768
	f.Add([]byte{}, []byte{})
	f.Fuzz(func(t *testing.T, key, value []byte) {
		c, err := DecodeCheckpoint(key, value)
		if err != nil {
			return
		}
		if len(value) < 2 || value[0] != 0 || value[1] != 0 {
			t.Fatalf("accepted value version %x", value[:min(2, len(value))])
		}
		k2, v2 := EncodeCheckpoint(c.Group, c.Topic, c.Partition, c.Upstream, c.Downstream, c.Metadata)
		if !bytes.HasPrefix(key, k2) || !bytes.HasPrefix(value, v2) {
			t.Fatalf("decoded %+v from %x/%x, which encodes as %x/%x", c, key, value, k2, v2)
		}
	})
}

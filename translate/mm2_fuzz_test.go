package translate

import (
	"bytes"
	"testing"
)

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

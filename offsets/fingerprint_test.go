package offsets

import (
	"encoding/json"
	"testing"
	"time"
)

func TestFingerprintOfDistinguishes(t *testing.T) {
	ts := time.UnixMilli(1_767_225_600_123)
	base := FingerprintOf([]byte("ab"), []byte("c"), ts)
	for _, tc := range []struct {
		name string
		fp   Fingerprint
	}{
		{"key/value boundary moved", FingerprintOf([]byte("a"), []byte("bc"), ts)},
		{"key and value swapped", FingerprintOf([]byte("c"), []byte("ab"), ts)},
		{"all in value", FingerprintOf(nil, []byte("abc"), ts)},
		{"timestamp 1 ms later", FingerprintOf([]byte("ab"), []byte("c"), ts.Add(time.Millisecond))},
		{"value changed", FingerprintOf([]byte("ab"), []byte("d"), ts)},
	} {
		if tc.fp == base {
			t.Errorf("%s: same fingerprint %s as (ab, c)", tc.name, base)
		}
	}
	if got := FingerprintOf([]byte("ab"), []byte("c"), ts.Add(999*time.Microsecond)); got != base {
		t.Errorf("sub-millisecond difference changed the fingerprint: %s != %s", got, base)
	}
	if FingerprintOf(nil, nil, ts) != FingerprintOf([]byte{}, []byte{}, ts) {
		t.Error("nil and empty key/value differ; documented to be the same")
	}
}

// TestFingerprintGolden pins the hash: fingerprints are stored in etcd and
// compared across agent versions, so the function must never change.
func TestFingerprintGolden(t *testing.T) {
	for _, tc := range []struct {
		key, value string
		ms         int64
		want       Fingerprint
	}{
		{"", "", 0, 0x81d23fd7003c2305},
		{"order-17", `{"qty":3}`, 1_767_225_600_123, 0xe1dfb27dfa394969},
	} {
		got := FingerprintOf([]byte(tc.key), []byte(tc.value), time.UnixMilli(tc.ms))
		if got != tc.want {
			t.Errorf("FingerprintOf(%q, %q, %d) = %#x, want %#x", tc.key, tc.value, tc.ms, uint64(got), uint64(tc.want))
		}
	}
}

func TestFingerprintText(t *testing.T) {
	fp := Fingerprint(0x00ab_cdef_0123_4567)
	b, err := json.Marshal([]Fingerprint{fp})
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != `["00abcdef01234567"]` {
		t.Fatalf("JSON = %s", b)
	}
	var back []Fingerprint
	if err := json.Unmarshal(b, &back); err != nil || len(back) != 1 || back[0] != fp {
		t.Fatalf("round trip = %v, %v", back, err)
	}
	for _, bad := range []string{"abc", "00abcdef0123456g", "+0abcdef01234567", "00abcdef012345678"} {
		var f Fingerprint
		if err := f.UnmarshalText([]byte(bad)); err == nil {
			t.Errorf("UnmarshalText(%q) = %s, want error", bad, f)
		}
	}
}

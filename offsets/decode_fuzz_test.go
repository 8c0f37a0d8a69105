package offsets

import (
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

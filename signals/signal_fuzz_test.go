package signals

import (
	"strings"
	"testing"

	"github.com/kswitch/kswitch/keys"
)

// FuzzParse feeds signal values, as a stranger could write them under
// signals/, to Parse: it never panics, refuses what is over MaxValueSize
// naming the limit, and what it accepts Format writes back to a value
// that parses the same.
func FuzzParse(f *testing.F) {
	for _, seed := range []string{
		"pause", "start", " PAUSE \n", "Start # back at 9", "pause # incident 42 # see wiki",
		"", "   ", "# note only", "paused", "pause\x00", "stop", "\xff\xfe", "pause #\n\r\t",
		strings.Repeat("p", MaxValueSize+1),
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, value []byte) {
		paused, note, err := Parse(value)
		if len(value) > MaxValueSize {
			if err == nil || !strings.Contains(err.Error(), "limit") {
				t.Fatalf("a value of %d bytes was not refused for its size: %v", len(value), err)
			}
			return
		}
		if err != nil {
			if err.Error() == "" {
				t.Fatal("refused without a reason")
			}
			return
		}
		v, ferr := Format(paused, note)
		if ferr != nil {
			return // a note Parse reads but Write would not store (control characters)
		}
		p2, n2, err := Parse([]byte(v))
		if err != nil || p2 != paused || n2 != note {
			t.Fatalf("Parse(%q) = %v %q; its Format %q parses as %v %q %v", value, paused, note, v, p2, n2, err)
		}
	})
}

// FuzzParseKey feeds keys under signals/ to ParseKey: it never panics,
// and a scope it returns is valid and maps back to the same key.
func FuzzParseKey(f *testing.F) {
	k := keys.New("orders")
	for _, seed := range []string{
		"fleet", "topic/orders", "agent/agent-1", "channel/audit", "topic/", "topic", "nothing/x",
		"topic/a/b", "agent/..", "channel/" + strings.Repeat("x", 300), "fleet/x", "\x00",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, rest string) {
		key := k.Signals() + rest
		s, err := ParseKey(k, key)
		if err != nil {
			return
		}
		if verr := s.Validate(); verr != nil {
			t.Fatalf("ParseKey(%q) = %+v, which is invalid: %v", key, s, verr)
		}
		if got := s.Key(k); got != key {
			t.Fatalf("ParseKey(%q) = %+v, whose key is %q", key, s, got)
		}
	})
}

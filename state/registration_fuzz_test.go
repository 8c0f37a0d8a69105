package state

import (
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// FuzzParseRegistration feeds agents/<id> values, as a stranger could
// write them, to ParseRegistration: it never panics, and what it accepts
// is under its own id and within the size limit.
func FuzzParseRegistration(f *testing.F) {
	good, _ := json.Marshal(Registration{ID: "agent-1", HTTP: "10.0.0.1:8080", Gossip: "10.0.0.1:7946", Version: "v1", Started: time.Unix(1_700_000_000, 0).UTC()})
	for _, seed := range []struct{ id, val string }{
		{"agent-1", string(good)}, {"agent-2", string(good)}, {"agent-1", `{"id":"agent-1"}`}, {"", `{"id":""}`},
		{"agent-1", `{"id":"agent-1","started":"now"}`}, {"agent-1", `null`}, {"agent-1", ``}, {"agent-1", "\xff"},
		{"agent-1", `{"id":"agent-1","http":` + strings.Repeat("9", maxRegistrationSize) + `}`},
	} {
		f.Add(seed.id, []byte(seed.val))
	}
	f.Fuzz(func(t *testing.T, id string, val []byte) {
		r, err := ParseRegistration(id, val)
		if err != nil {
			return
		}
		if r.ID != id || len(val) > maxRegistrationSize {
			t.Fatalf("accepted %+v (%d bytes) under id %q", r, len(val), id)
		}
	})
}

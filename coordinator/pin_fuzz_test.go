package coordinator

import (
	"strings"
	"testing"

	"go.uber.org/zap"
)

// FuzzPin feeds control/pin values to the leader's pin: it never panics,
// and a value it refuses (not a configured cluster, oversized) leaves the
// pin in force and is counted.
func FuzzPin(f *testing.F) {
	for _, seed := range []string{"A", " B\n", "", "   ", "C", "A B", "\x00", strings.Repeat("A", maxPinSize+1)} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, v string) {
		refusals := 0
		p := &pin{changed: make(chan struct{}, 1), log: zap.NewNop(), refused: func() { refusals++ },
			valid: func(c string) bool { return c == "A" || c == "B" }}
		p.set("B")
		p.set(v)
		got, want := p.get(), strings.TrimSpace(v)
		switch {
		case len(v) <= maxPinSize && (want == "" || want == "A" || want == "B"):
			if got != want || refusals != 0 {
				t.Fatalf("pin %q: in force %q, refusals %d; want %q and none", v, got, refusals, want)
			}
		default:
			if got != "B" || refusals != 1 {
				t.Fatalf("pin %q: in force %q, refusals %d; want B kept and the value counted", v, got, refusals)
			}
		}
	})
}

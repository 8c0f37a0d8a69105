package agent

import (
	"encoding/json"
	"testing"

	"github.com/kswitch/kswitch/coordinator"
)

// FuzzParseViews feeds gossip metadata, which any member of the gossip
// cluster sends, to parseViews: it never panics.
func FuzzParseViews(f *testing.F) {
	good, _ := json.Marshal(map[string]coordinator.ClusterView{"A": {Reachable: true, LatencyMs: 3}, "B": {Error: "dial tcp: refused"}})
	for _, seed := range []string{string(good), `{}`, `null`, ``, `{"A":true}`, `{"A":{"ok":"yes"}}`, `[{}]`, "{\"\xff\":{}}"} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, meta []byte) {
		if v, err := parseViews(meta); err != nil && v != nil {
			t.Fatalf("views %v returned with error %v", v, err)
		}
	})
}

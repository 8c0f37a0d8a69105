package state

import (
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// FuzzParseAssignment feeds state/assignment values, as a stranger could
// write them, to ParseAssignment: it never panics, and what it accepts
// keeps the invariant agents rely on (no partition given twice, a
// positive generation) and survives a round trip.
func FuzzParseAssignment(f *testing.F) {
	good, _ := json.Marshal(Assignment{Generation: 7, Cluster: "A", Leader: "agent-1", Token: 3,
		Owned:    map[string][]TopicPartition{"agent-1": {{Topic: "orders", Partition: 0}}, "agent-2": {{Topic: "orders", Partition: 1}}},
		Revoking: map[string][]TopicPartition{"agent-3": {{Topic: "orders", Partition: 2}}}, Published: time.Unix(1_700_000_000, 0).UTC()})
	for _, seed := range []string{
		string(good), `{}`, `{"generation":0}`, `{"generation":-1,"owned":{}}`, `null`, `[]`, `"x"`,
		`{"generation":1,"owned":{"a":[{"topic":"t","partition":0}],"b":[{"topic":"t","partition":0}]}}`,
		`{"generation":1,"owned":{"a":null},"revoking":{"a":[{"topic":"t","partition":-5}]}}`,
		`{"generation":9223372036854775807,"owned":{"":[]}}`, `{"generation":1e400}`, "{\"generation\":1,\"owned\":{\"a\":[{\"topic\":\"\xff\"}]}}",
		strings.Repeat("[", 10_000), `{"generation":1,"published":"yesterday"}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, val []byte) {
		a, err := ParseAssignment(val)
		if err != nil {
			if !strings.HasPrefix(err.Error(), "state: assignment") {
				t.Fatalf("error %q does not say what was refused", err)
			}
			return
		}
		if a.Generation <= 0 {
			t.Fatalf("accepted generation %d", a.Generation)
		}
		seen := map[TopicPartition]bool{}
		for _, m := range []map[string][]TopicPartition{a.Owned, a.Revoking} {
			for _, tps := range m {
				for _, tp := range tps {
					if seen[tp] {
						t.Fatalf("accepted %s given twice", tp)
					}
					seen[tp] = true
				}
			}
		}
		b, err := json.Marshal(a)
		if err != nil {
			t.Fatalf("an accepted assignment does not encode: %v", err)
		}
		if _, err := ParseAssignment(b); err != nil {
			t.Fatalf("an accepted assignment, encoded again, is refused: %v", err)
		}
	})
}

// FuzzParseActive feeds state/active values to ParseActive: it never
// panics and what it accepts names a cluster, a positive epoch and a
// known phase.
func FuzzParseActive(f *testing.F) {
	good, _ := json.Marshal(Active{Cluster: "B", Epoch: 2, Phase: PhaseSwitching, From: "A", Reason: "A down", Since: time.Unix(1_700_000_000, 0).UTC()})
	for _, seed := range []string{
		string(good), `{"cluster":"A","epoch":1,"phase":"active"}`, `{"cluster":"A","epoch":1,"phase":"paused"}`,
		`{"cluster":"","epoch":1,"phase":"active"}`, `{}`, `null`, `{"epoch":"1"}`, strings.Repeat("x", 70<<10),
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, val []byte) {
		a, err := ParseActive(val)
		if err != nil {
			return
		}
		if a.Cluster == "" || a.Epoch <= 0 || (a.Phase != PhaseActive && a.Phase != PhaseSwitching) {
			t.Fatalf("accepted %+v", a)
		}
	})
}

// FuzzParseSwitchEvent feeds history/<epoch> values to ParseSwitchEvent,
// which a new leader reads to restore its circuit breaker.
func FuzzParseSwitchEvent(f *testing.F) {
	good, _ := json.Marshal(SwitchEvent{Epoch: 3, From: "A", To: "B", Reason: "A down", Automatic: true,
		Started: time.Unix(1_700_000_000, 0).UTC(), Finished: time.Unix(1_700_000_002, 0).UTC(), Phases: map[string]float64{"release": 0.5}})
	for _, seed := range []string{
		string(good), `{"epoch":1,"to":"B","abandoned":"B unreachable"}`, `{"epoch":0,"to":"B"}`, `{"epoch":1}`,
		`{"epoch":1,"to":"B","phases":{"x":"y"}}`, `{"epoch":1,"to":"B","finished":"soon"}`, `[`, ``,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, val []byte) {
		ev, err := ParseSwitchEvent(val)
		if err == nil && (ev.Epoch <= 0 || ev.To == "") {
			t.Fatalf("accepted %+v", ev)
		}
	})
}

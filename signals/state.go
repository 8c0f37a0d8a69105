package signals

import (
	"cmp"
	"encoding/json"
	"slices"
	"strings"
)

// State is the signals in force at one etcd revision. It is immutable:
// readers share it without locks, and the slices its methods return are
// copies. The zero State has no signal: nothing is paused.
type State struct {
	rev      int64
	signals  []Signal // sorted by scope
	refusals []Refusal
	byScope  map[Scope]int // index into signals
}

func newState(rev int64, sigs []Signal, refusals []Refusal) State {
	slices.SortFunc(sigs, func(a, b Signal) int { return compareScopes(a.Scope, b.Scope) })
	slices.SortFunc(refusals, func(a, b Refusal) int { return strings.Compare(a.Key, b.Key) })
	idx := make(map[Scope]int, len(sigs))
	for i, s := range sigs {
		idx[s.Scope] = i
	}
	return State{rev: rev, signals: sigs, refusals: refusals, byScope: idx}
}

func compareScopes(a, b Scope) int {
	return cmp.Or(cmp.Compare(a.Kind, b.Kind), strings.Compare(a.Name, b.Name))
}

// Revision is the etcd revision the state is current with: every change of
// a signal key at or before it has been applied (0 before the first read).
// So a signal written at revision r is in force once Revision() >= r.
func (s State) Revision() int64 { return s.rev }

// Signal returns the value in force for scope, and false when there is none
// (the key is absent, or holds a refused value and never held a valid one),
// which means start.
func (s State) Signal(scope Scope) (Signal, bool) {
	i, ok := s.byScope[scope]
	if !ok {
		return Signal{}, false
	}
	return s.signals[i], true
}

func (s State) paused(scope Scope) bool {
	sig, ok := s.Signal(scope)
	return ok && sig.Paused
}

// Paused reports whether a partition of topic consumed by agent is paused,
// and by which scope: the fleet, else the topic, else the agent (the
// broadest paused scope decides). An empty topic or agent is not checked.
// When nothing pauses it, it returns false and the zero Scope.
//
// Channel signals do not pause partitions; see ChannelPaused.
func (s State) Paused(topic, agent string) (bool, Scope) {
	candidates := []Scope{{Kind: Fleet}}
	if topic != "" {
		candidates = append(candidates, Scope{Kind: Topic, Name: topic})
	}
	if agent != "" {
		candidates = append(candidates, Scope{Kind: Agent, Name: agent})
	}
	for _, sc := range candidates {
		if s.paused(sc) {
			return true, sc
		}
	}
	return false, Scope{}
}

// ChannelPaused reports whether records routed to channel must be held. It
// looks at the channel's own signal only: a fleet, topic or agent pause
// already stops the records before they are routed.
func (s State) ChannelPaused(channel string) bool {
	return s.paused(Scope{Kind: Channel, Name: channel})
}

// Signals returns every value in force, paused or started, sorted by kind
// (fleet, topic, agent, channel) then name.
func (s State) Signals() []Signal { return slices.Clone(s.signals) }

// Refusals returns the refused values, sorted by key.
func (s State) Refusals() []Refusal { return slices.Clone(s.refusals) }

type stateJSON struct {
	Revision int64     `json:"revision"`
	Signals  []Signal  `json:"signals"`
	Refusals []Refusal `json:"refusals"`
}

// MarshalJSON encodes the state as
// {"revision":…,"signals":[…],"refusals":[…]}, for /status pages.
func (s State) MarshalJSON() ([]byte, error) {
	v := stateJSON{Revision: s.rev, Signals: s.Signals(), Refusals: s.Refusals()}
	if v.Signals == nil {
		v.Signals = []Signal{}
	}
	if v.Refusals == nil {
		v.Refusals = []Refusal{}
	}
	return json.Marshal(v)
}

// UnmarshalJSON is the inverse of MarshalJSON.
func (s *State) UnmarshalJSON(b []byte) error {
	var v stateJSON
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	*s = newState(v.Revision, v.Signals, v.Refusals)
	return nil
}

package signals

import (
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/kswitch/kswitch/keys"
)

// MaxValueSize is the largest signal value accepted, in bytes. A larger
// value is refused unread, so a stranger's write cannot make every agent
// allocate without bound.
const MaxValueSize = 4 << 10

// maxRefusedValue bounds the raw value kept in a Refusal.
const maxRefusedValue = 200

// Accepted describes the accepted values; refusal reasons end with it.
const Accepted = `accepted values: "pause" or "start" (case and surrounding whitespace ignored), optionally followed by " # " and a note; delete the key to start`

// AcceptedKeys describes the keys under signals/ that name a scope.
const AcceptedKeys = "accepted keys under signals/: fleet, topic/<topic>, agent/<id>, channel/<channel>"

// Kind is the kind of a scope. The zero Kind is no scope.
type Kind int

// The scope kinds, broadest first.
const (
	// Fleet is every partition of the fleet.
	Fleet Kind = iota + 1
	// Topic is every partition of one source topic.
	Topic
	// Agent is every partition one agent consumes.
	Agent
	// Channel is the records routed to one channel.
	Channel
)

var kindNames = [...]string{Fleet: "fleet", Topic: "topic", Agent: "agent", Channel: "channel"}

// String returns "fleet", "topic", "agent" or "channel".
func (k Kind) String() string {
	if k >= Fleet && int(k) < len(kindNames) {
		return kindNames[k]
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// MarshalText implements encoding.TextMarshaler.
// The zero Kind is encoded as "".
func (k Kind) MarshalText() ([]byte, error) {
	if k == 0 {
		return []byte{}, nil
	}
	if k < Fleet || int(k) >= len(kindNames) {
		return nil, fmt.Errorf("signals: invalid kind %d", int(k))
	}
	return []byte(k.String()), nil
}

// UnmarshalText implements encoding.TextUnmarshaler.
func (k *Kind) UnmarshalText(b []byte) error {
	if len(b) == 0 {
		*k = 0
		return nil
	}
	kk, err := ParseKind(string(b))
	if err != nil {
		return err
	}
	*k = kk
	return nil
}

// ParseKind is the inverse of Kind.String.
func ParseKind(s string) (Kind, error) {
	for k := Fleet; int(k) < len(kindNames); k++ {
		if kindNames[k] == s {
			return k, nil
		}
	}
	return 0, fmt.Errorf("signals: unknown scope kind %q (want fleet, topic, agent or channel)", s)
}

// Scope is what a signal applies to. Name is the topic, agent id or channel;
// it is empty for Fleet.
type Scope struct {
	Kind Kind   `json:"kind"`
	Name string `json:"name,omitempty"`
}

// String is the scope as its key under signals/ reads: "fleet",
// "topic/orders", "agent/agent-1", "channel/audit".
func (s Scope) String() string {
	if s.Kind == Fleet {
		return "fleet"
	}
	return s.Kind.String() + "/" + s.Name
}

// Validate checks that s names a scope: a known kind, no name for Fleet and
// a keys.ValidName for the others.
func (s Scope) Validate() error {
	switch s.Kind {
	case Fleet:
		if s.Name != "" {
			return fmt.Errorf("signals: fleet scope takes no name (got %q)", s.Name)
		}
		return nil
	case Topic, Agent, Channel:
		if err := keys.ValidName(s.Name); err != nil {
			return fmt.Errorf("signals: %s name %q: %v", s.Kind, s.Name, err)
		}
		return nil
	}
	return fmt.Errorf("signals: invalid scope kind %d", int(s.Kind))
}

// Key is the etcd key of the scope's signal. s must be valid.
func (s Scope) Key(k keys.Fleet) string {
	switch s.Kind {
	case Topic:
		return k.TopicSignal(s.Name)
	case Agent:
		return k.AgentSignal(s.Name)
	case Channel:
		return k.ChannelSignal(s.Name)
	}
	return k.FleetSignal()
}

// ParseKey returns the scope of a signal key, and an error (whose message
// lists the accepted keys) when key is under k.Signals() but names no scope
// or is not under it at all.
func ParseKey(k keys.Fleet, key string) (Scope, error) {
	rest, ok := strings.CutPrefix(key, k.Signals())
	if !ok {
		return Scope{}, fmt.Errorf("key is not under %s", k.Signals())
	}
	if rest == "fleet" {
		return Scope{Kind: Fleet}, nil
	}
	kind, name, _ := strings.Cut(rest, "/")
	var s Scope
	switch kind {
	case "topic":
		s = Scope{Kind: Topic, Name: name}
	case "agent":
		s = Scope{Kind: Agent, Name: name}
	case "channel":
		s = Scope{Kind: Channel, Name: name}
	default:
		return Scope{}, fmt.Errorf("key names no signal scope; %s", AcceptedKeys)
	}
	if err := keys.ValidName(name); err != nil {
		return Scope{}, fmt.Errorf("%s name %q %v; %s", kind, name, err, AcceptedKeys)
	}
	return s, nil
}

// Signal is the value in force for one scope.
type Signal struct {
	Scope
	// Paused is true for "pause", false for "start".
	Paused bool `json:"paused"`
	// Note is the text after "#", trimmed; empty when there was none.
	Note string `json:"note,omitempty"`
	// Revision is the etcd mod revision of the value in force. When a
	// later value was refused, it is older than the key's mod revision.
	Revision int64 `json:"revision"`
	// Seen is when this reader first saw the value in force.
	Seen time.Time `json:"seen"`
}

// Refusal is a value that was not accepted. The key keeps the state of its
// last valid value.
type Refusal struct {
	Key string `json:"key"`
	// Value is the raw value, cut to at most 200 bytes.
	Value string `json:"value"`
	// Reason says what is wrong and lists what is accepted.
	Reason string `json:"reason"`
	// Revision is the etcd mod revision of the refused value.
	Revision int64 `json:"revision"`
}

// Parse reads a signal value: the word "pause" or "start", case and
// surrounding whitespace ignored, optionally followed by "#" and a note
// (returned trimmed). The error of any other value explains why and lists
// the accepted values.
func Parse(value []byte) (paused bool, note string, err error) {
	if len(value) > MaxValueSize {
		return false, "", fmt.Errorf("value is %d bytes, over the %d-byte limit; %s", len(value), MaxValueSize, Accepted)
	}
	s := string(value)
	word, note, hasNote := strings.Cut(s, "#")
	word = strings.TrimSpace(word)
	if hasNote {
		note = strings.TrimSpace(note)
	}
	switch {
	case strings.EqualFold(word, "pause"):
		return true, note, nil
	case strings.EqualFold(word, "start"):
		return false, note, nil
	case strings.TrimSpace(s) == "":
		return false, "", errors.New("empty value; " + Accepted)
	case word == "":
		return false, "", errors.New("no word before \"#\"; " + Accepted)
	}
	return false, "", fmt.Errorf("%q is neither pause nor start; %s", truncate(word, 40), Accepted)
}

// Format returns the value Write stores: "pause" or "start", then " # " and
// note when note is not empty. The note must be one line of at most
// MaxValueSize-8 bytes; "#" in it is fine (only the first one separates).
func Format(paused bool, note string) (string, error) {
	v := "start"
	if paused {
		v = "pause"
	}
	note = strings.TrimSpace(note)
	if note == "" {
		return v, nil
	}
	for _, r := range note {
		if r == '\n' || r == '\r' || (r < 0x20 && r != '\t') || r == 0x7f {
			return "", fmt.Errorf("signals: note %q: must be one line without control characters", truncate(note, 40))
		}
	}
	v += " # " + note
	if len(v) > MaxValueSize {
		return "", fmt.Errorf("signals: note is %d bytes; the value must fit in %d bytes", len(note), MaxValueSize)
	}
	return v, nil
}

// truncate cuts s to at most n bytes without splitting a UTF-8 sequence.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	i := n
	for i > 0 && !utf8.RuneStart(s[i]) {
		i--
	}
	return s[:i]
}

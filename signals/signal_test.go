package signals

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/kswitch/kswitch/keys"
)

func TestParse(t *testing.T) {
	cases := []struct {
		in     string
		ok     bool
		paused bool
		note   string
		reason string // part of the error when !ok
	}{
		{in: "pause", ok: true, paused: true},
		{in: "PAUSE", ok: true, paused: true},
		{in: "Pause", ok: true, paused: true},
		{in: "start", ok: true},
		{in: " start\n", ok: true},
		{in: "\tSTART  ", ok: true},
		{in: "pause # note", ok: true, paused: true, note: "note"},
		{in: "pause # 2026-11-30T10:00:00Z by ops@host1: downstream upgrade", ok: true, paused: true, note: "2026-11-30T10:00:00Z by ops@host1: downstream upgrade"},
		{in: "start#fixed # twice", ok: true, note: "fixed # twice"},
		{in: "pause #", ok: true, paused: true},
		{in: "pause # " + strings.Repeat("x", MaxValueSize-8), ok: true, paused: true, note: strings.Repeat("x", MaxValueSize-8)},
		{in: "paws", reason: `"paws" is neither pause nor start`},
		{in: "stop", reason: "neither pause nor start"},
		{in: "PAUSED!", reason: "neither pause nor start"},
		{in: "{}", reason: "neither pause nor start"},
		{in: `{"paused":true}`, reason: "neither pause nor start"},
		{in: "pause now", reason: "neither pause nor start"},
		{in: "pausestart", reason: "neither pause nor start"},
		{in: "", reason: "empty value"},
		{in: "  \n", reason: "empty value"},
		{in: "# pause", reason: `no word before "#"`},
		{in: strings.Repeat("x", 5<<10), reason: "5120 bytes, over the 4096-byte limit"},
		{in: "pause # " + strings.Repeat("x", 5<<10), reason: "over the 4096-byte limit"},
	}
	for _, c := range cases {
		paused, note, err := Parse([]byte(c.in))
		name := c.in
		if len(name) > 30 {
			name = name[:30] + "…"
		}
		if c.ok {
			if err != nil || paused != c.paused || note != c.note {
				t.Errorf("Parse(%q) = %v, %q, %v; want %v, %q", name, paused, note, err, c.paused, c.note)
			}
			continue
		}
		if err == nil {
			t.Errorf("Parse(%q) accepted (paused %v)", name, paused)
			continue
		}
		if !strings.Contains(err.Error(), c.reason) || !strings.Contains(err.Error(), `"pause" or "start"`) {
			t.Errorf("Parse(%q): error %q: want it to contain %q and list the accepted values", name, err, c.reason)
		}
	}
}

func TestFormatParsesBack(t *testing.T) {
	for _, c := range []struct {
		paused bool
		note   string
		want   string
	}{
		{true, "", "pause"},
		{false, "", "start"},
		{true, "2026-11-30T10:00:00Z by ops@host: why # not", "pause # 2026-11-30T10:00:00Z by ops@host: why # not"},
		{false, "  padded\t", "start # padded"},
	} {
		v, err := Format(c.paused, c.note)
		if err != nil || v != c.want {
			t.Errorf("Format(%v, %q) = %q, %v; want %q", c.paused, c.note, v, err, c.want)
			continue
		}
		paused, note, err := Parse([]byte(v))
		if err != nil || paused != c.paused || note != strings.TrimSpace(c.note) {
			t.Errorf("Parse(Format(%v, %q)) = %v, %q, %v", c.paused, c.note, paused, note, err)
		}
	}
	for _, bad := range []string{"two\nlines", "c\rr", "bell\a!", strings.Repeat("x", MaxValueSize)} {
		if v, err := Format(true, bad); err == nil {
			t.Errorf("Format accepted note %.20q: %.20q", bad, v)
		}
	}
}

func TestKeys(t *testing.T) {
	k := keys.New("orders")
	good := map[string]Scope{
		k.FleetSignal():              {Kind: Fleet},
		k.TopicSignal("payments"):    {Kind: Topic, Name: "payments"},
		k.AgentSignal("agent-1"):     {Kind: Agent, Name: "agent-1"},
		k.ChannelSignal("audit.eu"):  {Kind: Channel, Name: "audit.eu"},
		k.TopicSignal("a.b-c_d:1"):   {Kind: Topic, Name: "a.b-c_d:1"},
		k.ChannelSignal("ÜnicodeOK"): {Kind: Channel, Name: "ÜnicodeOK"},
	}
	for key, want := range good {
		s, err := ParseKey(k, key)
		if err != nil || s != want {
			t.Errorf("ParseKey(%q) = %+v, %v; want %+v", key, s, err, want)
		}
		if err := s.Validate(); err != nil {
			t.Errorf("%+v: %v", s, err)
		}
		if got := s.Key(k); got != key {
			t.Errorf("%+v.Key() = %q, want %q", s, got, key)
		}
	}
	for _, key := range []string{
		k.Signals() + "fleets", k.Signals() + "fleet/x", k.Signals() + "topic", k.Signals() + "topic/",
		k.Signals() + "topic/a/b", k.Signals() + "agent/a b", k.Signals() + "queue/x", k.Signals() + "",
		keys.New("other").FleetSignal(),
	} {
		if s, err := ParseKey(k, key); err == nil {
			t.Errorf("ParseKey(%q) = %+v, want an error", key, s)
		}
	}
	for _, s := range []Scope{{}, {Kind: Fleet, Name: "x"}, {Kind: Topic}, {Kind: Agent, Name: "a/b"}, {Kind: 9, Name: "x"}} {
		if err := s.Validate(); err == nil {
			t.Errorf("%+v validated", s)
		}
	}
	if got := (Scope{Kind: Topic, Name: "orders"}).String(); got != "topic/orders" {
		t.Errorf("String = %q", got)
	}
	if got := (Scope{Kind: Fleet}).String(); got != "fleet" {
		t.Errorf("String = %q", got)
	}
	for _, sc := range []Scope{{}, {Kind: Fleet}, {Kind: Channel, Name: "c"}} {
		b, err := json.Marshal(sc)
		var back Scope
		if err != nil || json.Unmarshal(b, &back) != nil || back != sc {
			t.Errorf("JSON round trip of %+v: %s, %v, %+v", sc, b, err, back)
		}
	}
	var sc Scope
	if err := json.Unmarshal([]byte(`{"kind":"queue"}`), &sc); err == nil {
		t.Error("unknown kind decoded")
	}
}

func TestPausedPrecedence(t *testing.T) {
	sig := func(kind Kind, name string, paused bool) Signal {
		return Signal{Scope: Scope{Kind: kind, Name: name}, Paused: paused}
	}
	cases := []struct {
		name          string
		sigs          []Signal
		topic, agent  string
		want          bool
		wantBy        Scope
		channelPaused map[string]bool
	}{
		{name: "nothing", topic: "t", agent: "a"},
		{name: "all started", sigs: []Signal{sig(Fleet, "", false), sig(Topic, "t", false), sig(Agent, "a", false)}, topic: "t", agent: "a"},
		{name: "fleet", sigs: []Signal{sig(Fleet, "", true)}, topic: "t", agent: "a", want: true, wantBy: Scope{Kind: Fleet}},
		{name: "fleet beats topic and agent", sigs: []Signal{sig(Agent, "a", true), sig(Topic, "t", true), sig(Fleet, "", true)}, topic: "t", agent: "a", want: true, wantBy: Scope{Kind: Fleet}},
		{name: "topic beats agent", sigs: []Signal{sig(Agent, "a", true), sig(Topic, "t", true)}, topic: "t", agent: "a", want: true, wantBy: Scope{Kind: Topic, Name: "t"}},
		{name: "agent alone", sigs: []Signal{sig(Fleet, "", false), sig(Agent, "a", true)}, topic: "t", agent: "a", want: true, wantBy: Scope{Kind: Agent, Name: "a"}},
		{name: "started fleet does not override a paused topic", sigs: []Signal{sig(Fleet, "", false), sig(Topic, "t", true)}, topic: "t", agent: "a", want: true, wantBy: Scope{Kind: Topic, Name: "t"}},
		{name: "other topic and agent", sigs: []Signal{sig(Topic, "u", true), sig(Agent, "b", true)}, topic: "t", agent: "a"},
		{name: "agent not asked", sigs: []Signal{sig(Agent, "a", true)}, topic: "t"},
		{name: "topic not asked", sigs: []Signal{sig(Topic, "t", true)}, agent: "a"},
		{name: "channel pauses no partition", sigs: []Signal{sig(Channel, "t", true), sig(Channel, "a", true)}, topic: "t", agent: "a",
			channelPaused: map[string]bool{"t": true, "a": true, "b": false}},
		{name: "fleet does not pause a channel", sigs: []Signal{sig(Fleet, "", true)}, topic: "t", want: true, wantBy: Scope{Kind: Fleet},
			channelPaused: map[string]bool{"c": false}},
	}
	for _, c := range cases {
		s := newState(1, c.sigs, nil)
		got, by := s.Paused(c.topic, c.agent)
		if got != c.want || by != c.wantBy {
			t.Errorf("%s: Paused(%q, %q) = %v, %v; want %v, %v", c.name, c.topic, c.agent, got, by, c.want, c.wantBy)
		}
		for ch, want := range c.channelPaused {
			if s.ChannelPaused(ch) != want {
				t.Errorf("%s: ChannelPaused(%q) = %v", c.name, ch, !want)
			}
		}
	}
}

func TestStateSortsAndRoundTripsJSON(t *testing.T) {
	s := newState(7, []Signal{
		{Scope: Scope{Kind: Channel, Name: "c"}, Paused: true, Revision: 3},
		{Scope: Scope{Kind: Agent, Name: "b"}, Revision: 4},
		{Scope: Scope{Kind: Topic, Name: "z"}, Paused: true, Note: "n", Revision: 5},
		{Scope: Scope{Kind: Topic, Name: "a"}, Paused: true, Revision: 6},
		{Scope: Scope{Kind: Fleet}, Revision: 2},
	}, []Refusal{{Key: "k2", Value: "v", Reason: "r", Revision: 7}, {Key: "k1"}})
	var order []string
	for _, sig := range s.Signals() {
		order = append(order, sig.Scope.String())
	}
	if got := strings.Join(order, " "); got != "fleet topic/a topic/z agent/b channel/c" {
		t.Errorf("order: %s", got)
	}
	if r := s.Refusals(); r[0].Key != "k1" || r[1].Key != "k2" {
		t.Errorf("refusals not sorted: %+v", r)
	}
	b, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"kind":"topic","name":"z","paused":true,"note":"n","revision":5`) {
		t.Errorf("json: %s", b)
	}
	var back State
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if back.Revision() != 7 || len(back.Signals()) != 5 || !back.ChannelPaused("c") {
		t.Errorf("round trip: %s", b)
	}
	if b, _ := json.Marshal(State{}); string(b) != `{"revision":0,"signals":[],"refusals":[]}` {
		t.Errorf("zero state: %s", b)
	}
	// The returned slices are copies.
	s.Signals()[0].Paused = true
	if sig, _ := s.Signal(Scope{Kind: Fleet}); sig.Paused {
		t.Error("State changed through Signals()")
	}
}

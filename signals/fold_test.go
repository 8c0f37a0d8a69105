package signals

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/kswitch/kswitch/keys"
)

// fakeEtcd keeps the history of a few keys the way etcd does, for fold
// tests that need no server.
type fakeEtcd struct {
	rev       int64
	hist      map[string][]*mvccpb.KeyValue // every version; CreateRevision 0 marks a delete
	compacted int64                         // getAt below it fails
}

func newFakeEtcd() *fakeEtcd { return &fakeEtcd{rev: 1, hist: map[string][]*mvccpb.KeyValue{}} }

func (e *fakeEtcd) current(key string) *mvccpb.KeyValue {
	h := e.hist[key]
	if len(h) == 0 || h[len(h)-1].CreateRevision == 0 {
		return nil
	}
	return h[len(h)-1]
}

func (e *fakeEtcd) put(key, val string) *clientv3.Event {
	e.rev++
	kv := &mvccpb.KeyValue{Key: []byte(key), Value: []byte(val), CreateRevision: e.rev, ModRevision: e.rev, Version: 1}
	if cur := e.current(key); cur != nil {
		kv.CreateRevision, kv.Version = cur.CreateRevision, cur.Version+1
	}
	e.hist[key] = append(e.hist[key], kv)
	return &clientv3.Event{Type: clientv3.EventTypePut, Kv: kv}
}

func (e *fakeEtcd) del(key string) *clientv3.Event {
	e.rev++
	kv := &mvccpb.KeyValue{Key: []byte(key), ModRevision: e.rev}
	e.hist[key] = append(e.hist[key], kv)
	return &clientv3.Event{Type: clientv3.EventTypeDelete, Kv: kv}
}

func (e *fakeEtcd) kvs() []*mvccpb.KeyValue {
	var out []*mvccpb.KeyValue
	for key := range e.hist {
		if kv := e.current(key); kv != nil {
			out = append(out, kv)
		}
	}
	slices.SortFunc(out, func(a, b *mvccpb.KeyValue) int { return strings.Compare(string(a.Key), string(b.Key)) })
	return out
}

func (e *fakeEtcd) getAt(key string, rev int64) (*mvccpb.KeyValue, error) {
	if rev < e.compacted {
		return nil, errors.New("mvcc: required revision has been compacted")
	}
	var found *mvccpb.KeyValue
	for _, kv := range e.hist[key] {
		if kv.ModRevision <= rev {
			found = kv
		}
	}
	if found == nil || found.CreateRevision == 0 {
		return nil, nil
	}
	return found, nil
}

func newTestFold(e *fakeEtcd) (*fold, *observer.ObservedLogs) {
	core, logs := observer.New(zapcore.DebugLevel)
	return newFold(keys.New("orders"), zap.New(core), e.getAt), logs
}

func warns(logs *observer.ObservedLogs, key string) int {
	n := 0
	for _, l := range logs.FilterLevelExact(zapcore.WarnLevel).All() {
		if l.ContextMap()["key"] == key {
			n++
		}
	}
	return n
}

var k = keys.New("orders")

func fleetSignal(t *testing.T, s State) (Signal, bool) {
	t.Helper()
	return s.Signal(Scope{Kind: Fleet})
}

func TestFoldRefusedValueKeepsPreviousState(t *testing.T) {
	e := newFakeEtcd()
	f, logs := newTestFold(e)
	f.reset(e.kvs(), e.rev)
	if s := f.state(); len(s.Signals()) != 0 || s.Revision() != e.rev {
		t.Fatalf("empty: %+v", s)
	}

	pause := e.put(k.FleetSignal(), "pause # upgrade")
	f.apply([]*clientv3.Event{pause})
	sig, ok := fleetSignal(t, f.state())
	if !ok || !sig.Paused || sig.Note != "upgrade" || sig.Revision != pause.Kv.ModRevision || sig.Seen.IsZero() {
		t.Fatalf("after pause: %+v %v", sig, ok)
	}

	bad := e.put(k.FleetSignal(), "paws")
	f.apply([]*clientv3.Event{bad})
	s := f.state()
	if got, _ := fleetSignal(t, s); got != sig {
		t.Errorf("refused value changed the signal: %+v, want %+v", got, sig)
	}
	if p, by := s.Paused("t", "a"); !p || by.Kind != Fleet {
		t.Errorf("Paused = %v, %v", p, by)
	}
	r := s.Refusals()
	if len(r) != 1 || r[0].Key != k.FleetSignal() || r[0].Value != "paws" || r[0].Revision != bad.Kv.ModRevision ||
		!strings.Contains(r[0].Reason, `"pause" or "start"`) {
		t.Errorf("refusals: %+v", r)
	}
	if s.Revision() != bad.Kv.ModRevision {
		t.Errorf("revision %d, want %d", s.Revision(), bad.Kv.ModRevision)
	}
	if warns(logs, k.FleetSignal()) != 1 {
		t.Errorf("want one warning, got %v", logs.All())
	}

	start := e.put(k.FleetSignal(), "START")
	f.apply([]*clientv3.Event{start})
	if sig, _ := fleetSignal(t, f.state()); sig.Paused || sig.Revision != start.Kv.ModRevision || len(f.state().Refusals()) != 0 {
		t.Errorf("after start: %+v, refusals %v", sig, f.state().Refusals())
	}

	f.apply([]*clientv3.Event{e.put(k.FleetSignal(), "pause"), e.put(k.FleetSignal(), "{}")})
	del := e.del(k.FleetSignal())
	f.apply([]*clientv3.Event{del})
	s = f.state()
	if _, ok := fleetSignal(t, s); ok || len(s.Refusals()) != 0 || s.Revision() != del.Kv.ModRevision {
		t.Errorf("after delete: %+v %+v rev %d", s.Signals(), s.Refusals(), s.Revision())
	}
	if p, _ := s.Paused("t", "a"); p {
		t.Error("paused after delete")
	}
}

func TestFoldRefusalLoggedOncePerRevision(t *testing.T) {
	e := newFakeEtcd()
	f, logs := newTestFold(e)
	e.put(k.TopicSignal("t"), "stop")
	e.put(k.Signals()+"bogus", "pause")
	for range 3 {
		f.reset(e.kvs(), e.rev)
	}
	if n := warns(logs, k.TopicSignal("t")); n != 1 {
		t.Errorf("%d warnings for the topic after 3 reads, want 1", n)
	}
	if n := warns(logs, k.Signals()+"bogus"); n != 1 {
		t.Errorf("%d warnings for the bogus key after 3 reads, want 1", n)
	}
	s := f.state()
	if len(s.Signals()) != 0 || len(s.Refusals()) != 2 {
		t.Fatalf("signals %+v, refusals %+v", s.Signals(), s.Refusals())
	}
	if r := s.Refusals()[0]; r.Key != k.Signals()+"bogus" || !strings.Contains(r.Reason, "topic/<topic>") {
		t.Errorf("bogus key refusal: %+v", r)
	}
	f.apply([]*clientv3.Event{e.put(k.TopicSignal("t"), "stop")})
	if n := warns(logs, k.TopicSignal("t")); n != 2 {
		t.Errorf("%d warnings after a new revision, want 2", n)
	}
	f.apply([]*clientv3.Event{e.del(k.Signals() + "bogus")})
	if r := f.state().Refusals(); len(r) != 1 || r[0].Key != k.TopicSignal("t") {
		t.Errorf("refusals after deleting the bogus key: %+v", r)
	}
}

func TestFoldRelistAppliesMissedChanges(t *testing.T) {
	e := newFakeEtcd()
	f, logs := newTestFold(e)
	e.put(k.FleetSignal(), "pause")
	e.put(k.TopicSignal("a"), "pause")
	e.put(k.TopicSignal("b"), "pause")
	e.put(k.AgentSignal("x"), "pause")
	f.reset(e.kvs(), e.rev)
	seen, _ := f.state().Signal(Scope{Kind: Agent, Name: "x"})

	// Missed while the watch was down:
	e.put(k.FleetSignal(), "start # done") // then refused: start is in force
	e.put(k.FleetSignal(), "paws")
	e.del(k.TopicSignal("a")) // gone
	e.del(k.TopicSignal("b")) // recreated with a refused value: start
	e.put(k.TopicSignal("b"), "PAUSED!")
	e.put(k.ChannelSignal("c"), "pause") // new
	e.put(k.AgentSignal("x"), "pause # again")
	e.put(k.AgentSignal("x"), "nope") // previous valid value is the missed one
	f.reset(e.kvs(), e.rev+5)

	s := f.state()
	if s.Revision() != e.rev+5 {
		t.Errorf("revision %d, want %d", s.Revision(), e.rev+5)
	}
	if sig, ok := fleetSignal(t, s); !ok || sig.Paused || sig.Note != "done" {
		t.Errorf("fleet: %+v, want the missed start", sig)
	}
	if _, ok := s.Signal(Scope{Kind: Topic, Name: "a"}); ok {
		t.Error("topic a still has a signal")
	}
	if sig, ok := s.Signal(Scope{Kind: Topic, Name: "b"}); ok {
		t.Errorf("topic b: %+v, want start (recreated with a refused value)", sig)
	}
	if !s.ChannelPaused("c") {
		t.Error("channel c not paused")
	}
	if sig, _ := s.Signal(Scope{Kind: Agent, Name: "x"}); !sig.Paused || sig.Note != "again" || sig.Revision == seen.Revision {
		t.Errorf("agent x: %+v", sig)
	}
	if n := len(s.Refusals()); n != 3 {
		t.Errorf("refusals: %+v", s.Refusals())
	}
	if len(logs.FilterFieldKey("history_error").All()) != 0 {
		t.Error("history error logged")
	}
}

func TestFoldHistory(t *testing.T) {
	t.Run("fresh reader finds the last valid value", func(t *testing.T) {
		e := newFakeEtcd()
		pause := e.put(k.FleetSignal(), "pause # why")
		e.put(k.FleetSignal(), "paws")
		e.put(k.FleetSignal(), "still wrong")
		f, _ := newTestFold(e)
		f.reset(e.kvs(), e.rev)
		sig, ok := fleetSignal(t, f.state())
		if !ok || !sig.Paused || sig.Note != "why" || sig.Revision != pause.Kv.ModRevision {
			t.Errorf("%+v %v", sig, ok)
		}
	})
	t.Run("created refused", func(t *testing.T) {
		e := newFakeEtcd()
		e.put(k.FleetSignal(), "pause")
		e.del(k.FleetSignal())
		e.put(k.FleetSignal(), "paws")
		f, _ := newTestFold(e)
		f.reset(e.kvs(), e.rev)
		if sig, ok := fleetSignal(t, f.state()); ok {
			t.Errorf("%+v: want start", sig)
		}
	})
	t.Run("compacted: what was known stays", func(t *testing.T) {
		e := newFakeEtcd()
		f, logs := newTestFold(e)
		e.put(k.FleetSignal(), "pause")
		f.reset(e.kvs(), e.rev)
		want, _ := fleetSignal(t, f.state())
		e.put(k.FleetSignal(), "start")
		e.put(k.FleetSignal(), "paws")
		e.compacted = e.rev
		f.reset(e.kvs(), e.rev)
		if sig, _ := fleetSignal(t, f.state()); sig != want {
			t.Errorf("%+v, want %+v", sig, want)
		}
		w := logs.FilterLevelExact(zapcore.WarnLevel).All()
		if len(w) != 1 || !strings.Contains(w[0].ContextMap()["history_error"].(string), "compacted") {
			t.Errorf("warnings: %+v", w)
		}
	})
	t.Run("compacted, fresh reader: start", func(t *testing.T) {
		e := newFakeEtcd()
		e.put(k.FleetSignal(), "pause")
		e.put(k.FleetSignal(), "paws")
		e.compacted = e.rev
		f, _ := newTestFold(e)
		f.reset(e.kvs(), e.rev)
		if sig, ok := fleetSignal(t, f.state()); ok {
			t.Errorf("%+v: want start", sig)
		}
		if len(f.state().Refusals()) != 1 {
			t.Error("no refusal")
		}
	})
	t.Run("too many refused versions", func(t *testing.T) {
		e := newFakeEtcd()
		e.put(k.FleetSignal(), "pause")
		for range maxHistory + 1 {
			e.put(k.FleetSignal(), "paws")
		}
		f, logs := newTestFold(e)
		f.reset(e.kvs(), e.rev)
		if _, ok := fleetSignal(t, f.state()); ok {
			t.Error("want start")
		}
		if len(logs.FilterFieldKey("history_error").All()) != 1 {
			t.Errorf("no history error logged: %v", logs.All())
		}
	})
}

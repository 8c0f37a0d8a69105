package signals

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/grpc/connectivity"

	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// applyDeadline is how long a test waits for a change to be applied. The
// contract is milliseconds; the margin is for loaded test machines.
const applyDeadline = 5 * time.Second

// startWatcher runs a watcher of fleet "orders" until the test ends.
func startWatcher(t *testing.T, c *clientv3.Client) (*Watcher, *observer.ObservedLogs) {
	t.Helper()
	core, logs := observer.New(zapcore.DebugLevel)
	w := NewWatcher(c, k, 2*time.Second, zap.New(core))
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := w.Run(ctx); !errors.Is(err, context.Canceled) {
			t.Errorf("Run returned %v, want context.Canceled", err)
		}
	})
	t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
	return w, logs
}

func put(t *testing.T, c *clientv3.Client, key, val string) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := c.Put(ctx, key, val)
	if err != nil {
		t.Fatal(err)
	}
	return resp.Header.Revision
}

func del(t *testing.T, c *clientv3.Client, key string) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := c.Delete(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	return resp.Header.Revision
}

// applied waits until w has applied revision rev.
func applied(t *testing.T, w *Watcher, rev int64) State {
	t.Helper()
	wait.For(t, applyDeadline, fmt.Sprintf("revision %d applied", rev), func() error {
		if got := w.State().Revision(); got < rev {
			return fmt.Errorf("at revision %d", got)
		}
		return nil
	})
	return w.State()
}

func waitReady(t *testing.T, w *Watcher) {
	t.Helper()
	select {
	case <-w.Ready():
	case <-time.After(applyDeadline):
		t.Fatal("watcher not ready")
	}
}

func TestWatcherReadyWithoutKeys(t *testing.T) {
	e := testenv.StartEtcdT(t)
	c := testenv.EtcdClientT(t, e)
	put(t, c, k.Agent("unrelated"), "x")
	w, _ := startWatcher(t, c)
	waitReady(t, w)
	s := w.State()
	if len(s.Signals()) != 0 || len(s.Refusals()) != 0 || s.Revision() == 0 {
		t.Errorf("state %+v", s)
	}
	if p, _ := s.Paused("t", "a"); p {
		t.Error("paused")
	}
}

func TestWatcherReadsSignalsBeforeReady(t *testing.T) {
	e := testenv.StartEtcdT(t)
	c := testenv.EtcdClientT(t, e)
	put(t, c, k.FleetSignal(), "pause # before the agent")
	put(t, c, k.TopicSignal("t"), "pause")
	put(t, c, k.TopicSignal("t"), "stop") // refused: pause stays, found in history
	w, _ := startWatcher(t, c)
	waitReady(t, w)
	s := w.State()
	if sig, _ := s.Signal(Scope{Kind: Fleet}); !sig.Paused || sig.Note != "before the agent" {
		t.Errorf("fleet: %+v", sig)
	}
	if sig, _ := s.Signal(Scope{Kind: Topic, Name: "t"}); !sig.Paused {
		t.Errorf("topic: %+v", sig)
	}
	if r := s.Refusals(); len(r) != 1 || r[0].Value != "stop" {
		t.Errorf("refusals: %+v", r)
	}
}

func TestWatcherFollowsChanges(t *testing.T) {
	e := testenv.StartEtcdT(t)
	c := testenv.EtcdClientT(t, e)
	w, logs := startWatcher(t, c)
	waitReady(t, w)
	sub := w.Subscribe(t.Context())
	sub2 := w.Subscribe(t.Context())

	for _, sc := range []Scope{{Kind: Fleet}, {Kind: Topic, Name: "t"}, {Kind: Agent, Name: "a"}, {Kind: Channel, Name: "c"}} {
		t.Run(sc.String(), func(t *testing.T) {
			began := time.Now()
			rev := put(t, c, sc.Key(k), "pause")
			s := applied(t, w, rev)
			t.Logf("pause applied %v after the write", time.Since(began).Round(time.Microsecond))
			sig, ok := s.Signal(sc)
			if !ok || !sig.Paused || sig.Revision != rev {
				t.Fatalf("after pause: %+v", sig)
			}
			if sc.Kind == Channel {
				if !s.ChannelPaused(sc.Name) {
					t.Error("channel not paused")
				}
			} else if p, by := s.Paused("t", "a"); !p || by != sc {
				t.Errorf("Paused = %v, %v; want true, %v", p, by, sc)
			}

			bad := put(t, c, sc.Key(k), "paws")
			s = applied(t, w, bad)
			if got, _ := s.Signal(sc); got != sig {
				t.Errorf("after a refused value: %+v, want %+v", got, sig)
			}
			if r := s.Refusals(); len(r) != 1 || r[0].Key != sc.Key(k) || r[0].Value != "paws" || r[0].Revision != bad {
				t.Errorf("refusals: %+v", r)
			}

			gone := del(t, c, sc.Key(k))
			s = applied(t, w, gone)
			if _, ok := s.Signal(sc); ok || len(s.Refusals()) != 0 {
				t.Errorf("after delete: %+v %+v", s.Signals(), s.Refusals())
			}
			if p, _ := s.Paused("t", "a"); p || s.ChannelPaused("c") {
				t.Error("still paused after delete")
			}
		})
	}
	for i, ch := range []<-chan struct{}{sub, sub2} {
		select {
		case <-ch:
		default:
			t.Errorf("subscriber %d not notified", i)
		}
	}
	if n := len(logs.FilterMessage("refused signal value; the previous state stays in force").All()); n != 4 {
		t.Errorf("%d refusal warnings, want 4", n)
	}
}

func TestWatcherSubscribersAreNotBlockingAndEnd(t *testing.T) {
	e := testenv.StartEtcdT(t)
	c := testenv.EtcdClientT(t, e)
	w, _ := startWatcher(t, c)
	waitReady(t, w)
	ctx, cancel := context.WithCancel(context.Background())
	_ = w.Subscribe(ctx) // never read: must not hold the watcher up
	live := w.Subscribe(t.Context())
	var rev int64
	for i := range 20 {
		rev = put(t, c, k.AgentSignal("a"), fmt.Sprintf("pause # %d", i))
	}
	applied(t, w, rev)
	select {
	case <-live:
	case <-time.After(applyDeadline):
		t.Fatal("no notification")
	}
	cancel()
	wait.For(t, applyDeadline, "unsubscribed", func() error {
		if n := w.subs.Len(); n != 1 {
			return fmt.Errorf("%d subscribers", n)
		}
		return nil
	})
	if err := w.Run(t.Context()); err == nil || !strings.Contains(err.Error(), "twice") {
		t.Errorf("second Run: %v", err)
	}
}

func TestWatcherSurvivesEtcdRestart(t *testing.T) {
	e := testenv.StartEtcdT(t)
	// A client with gRPC's default reconnection backoff (as an agent has):
	// after the restart it stays disconnected long enough for the changes
	// and the compaction below to happen behind its back.
	c, err := clientv3.New(clientv3.Config{Endpoints: e.Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	w, logs := startWatcher(t, c)
	waitReady(t, w)
	put(t, c, k.FleetSignal(), "pause")
	put(t, c, k.TopicSignal("gone"), "pause")
	before := applied(t, w, put(t, c, k.AgentSignal("x"), "start"))
	fleet, _ := before.Signal(Scope{Kind: Fleet})

	e.Stop()
	// The client notices the outage; its watch is then broken.
	wait.For(t, applyDeadline, "the client to lose its connection", func() error {
		if st := c.ActiveConnection().GetState(); st == connectivity.Ready {
			return fmt.Errorf("connection %v", st)
		}
		return nil
	})
	if err := e.Restart(); err != nil {
		t.Fatal(err)
	}
	// Changes the broken watch did not see, then a compaction, so that a
	// watch resumed from where it broke fails and the watcher must read
	// everything again. (When the client reconnects first it receives the
	// changes on its resumed watch; the outcome must be the same.)
	other := testenv.EtcdClientT(t, e)
	put(t, other, k.FleetSignal(), "paws")
	del(t, other, k.TopicSignal("gone"))
	rev := put(t, other, k.AgentSignal("x"), "pause # while away")
	if _, err := other.Compact(t.Context(), rev); err != nil {
		t.Fatal(err)
	}
	c.ActiveConnection().ResetConnectBackoff()
	s := applied(t, w, rev)

	if sig, _ := s.Signal(Scope{Kind: Fleet}); sig != fleet {
		t.Errorf("fleet: %+v, want the pause before the refused value: %+v", sig, fleet)
	}
	if r := s.Refusals(); len(r) != 1 || r[0].Key != k.FleetSignal() {
		t.Errorf("refusals: %+v", r)
	}
	if _, ok := s.Signal(Scope{Kind: Topic, Name: "gone"}); ok {
		t.Error("deleted topic signal still there")
	}
	if p, by := s.Paused("other", "x"); !p || by.Kind != Fleet {
		t.Errorf("Paused = %v, %v", p, by)
	}
	if sig, _ := s.Signal(Scope{Kind: Agent, Name: "x"}); !sig.Paused || sig.Note != "while away" {
		t.Errorf("agent: %+v", sig)
	}
	if logs.FilterMessage("signals watch interrupted; reading the signals again").Len() > 0 {
		wait.For(t, applyDeadline, "re-established log", func() error {
			if logs.FilterMessage("signals watch re-established").Len() == 0 {
				return errors.New("not logged")
			}
			return nil
		})
		t.Log("the watcher read the signals again after the compaction")
	} else {
		t.Log("the client resumed the watch before the compaction")
	}
	// And the watch works again after the re-read.
	s = applied(t, w, del(t, other, k.FleetSignal()))
	if p, by := s.Paused("other", "y"); p {
		t.Errorf("still paused by %v", by)
	}
}

func TestReadAndWrite(t *testing.T) {
	e := testenv.StartEtcdT(t)
	c := testenv.EtcdClientT(t, e)
	ctx := t.Context()
	if err := Write(ctx, c, k, Scope{Kind: Topic, Name: "t"}, true, "by me"); err != nil {
		t.Fatal(err)
	}
	if err := Write(ctx, c, k, Scope{Kind: Fleet}, false, ""); err != nil {
		t.Fatal(err)
	}
	put(t, c, k.ChannelSignal("c"), "pause")
	put(t, c, k.ChannelSignal("c"), "PAUSED!")
	put(t, c, k.Signals()+"bogus/x", "pause")
	for _, bad := range []Scope{{Kind: Topic}, {Kind: Fleet, Name: "x"}, {Kind: Agent, Name: "a b"}} {
		if err := Write(ctx, c, k, bad, true, ""); err == nil {
			t.Errorf("Write(%+v) accepted", bad)
		}
	}
	if err := Write(ctx, c, k, Scope{Kind: Fleet}, true, "two\nlines"); err == nil {
		t.Error("Write accepted a two-line note")
	}
	s, err := Read(ctx, c, k)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Get(ctx, k.TopicSignal("t"))
	if err != nil {
		t.Fatal(err)
	}
	if v := string(resp.Kvs[0].Value); v != "pause # by me" {
		t.Errorf("written %q", v)
	}
	if sig, _ := s.Signal(Scope{Kind: Topic, Name: "t"}); !sig.Paused || sig.Note != "by me" || sig.Revision != resp.Kvs[0].ModRevision {
		t.Errorf("topic: %+v", sig)
	}
	if sig, ok := s.Signal(Scope{Kind: Fleet}); !ok || sig.Paused {
		t.Errorf("fleet: %+v", sig)
	}
	if !s.ChannelPaused("c") {
		t.Error("channel: the refused value should leave the pause in force")
	}
	if r := s.Refusals(); len(r) != 2 {
		t.Errorf("refusals: %+v", r)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := Read(cctx, c, k); !errors.Is(err, context.Canceled) {
		t.Errorf("Read with a cancelled ctx: %v", err)
	}
}

package election_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

func TestMain(m *testing.M) {
	wait.VerifyTestMain(m, testenv.LeakOptions()...)
}

const prefix = "/kswitch/test/election/"

// candidate campaigns in the background and reports its terms.
type candidate struct {
	c     *election.Candidate
	s     *concurrency.Session
	terms chan election.Term
	done  chan error
}

func campaign(t *testing.T, ctx context.Context, cli *clientv3.Client, id string) *candidate {
	t.Helper()
	s, err := concurrency.NewSession(cli, concurrency.WithTTL(2))
	if err != nil {
		t.Fatal(err)
	}
	c, err := election.NewCandidate(election.Config{Prefix: prefix, ID: id})
	if err != nil {
		t.Fatal(err)
	}
	cd := &candidate{c: c, s: s, terms: make(chan election.Term, 4), done: make(chan error, 1)}
	go func() {
		cd.done <- c.Campaign(ctx, s, func(lctx context.Context, term election.Term) {
			cd.terms <- term
			<-lctx.Done()
		})
	}()
	return cd
}

func TestFencedWriteOfDeposedLeaderIsRejected(t *testing.T) {
	e := testenv.StartEtcdT(t)
	cli := testenv.EtcdClientT(t, e)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	a := campaign(t, ctx, cli, "a")
	defer a.s.Close()
	var ta election.Term
	select {
	case ta = <-a.terms:
	case <-time.After(10 * time.Second):
		t.Fatal("a was not elected")
	}
	if err := ta.Put(ctx, "/kswitch/test/state", "from-a"); err != nil {
		t.Fatalf("leader's fenced write failed: %v", err)
	}

	b := campaign(t, ctx, cli, "b")
	defer b.s.Close()

	// Depose a the way etcd does when a leader stalls past its TTL: its
	// lease goes away.
	if _, err := cli.Revoke(ctx, a.s.Lease()); err != nil {
		t.Fatal(err)
	}
	if err := <-a.done; !errors.Is(err, election.ErrSessionDone) {
		t.Fatalf("a's campaign returned %v, want ErrSessionDone", err)
	}
	if a.c.Leading() {
		t.Fatal("a still reports leading after its session ended")
	}
	var tb election.Term
	select {
	case tb = <-b.terms:
	case <-time.After(10 * time.Second):
		t.Fatal("b was not elected after a was deposed")
	}
	if tb.Rev <= ta.Rev {
		t.Fatalf("fencing token did not grow: a=%d b=%d", ta.Rev, tb.Rev)
	}

	err := ta.Put(ctx, "/kswitch/test/state", "stale-from-a")
	if !errors.Is(err, election.ErrNotLeader) {
		t.Fatalf("deposed leader's write: got %v, want ErrNotLeader", err)
	}
	if err := tb.Put(ctx, "/kswitch/test/state", "from-b"); err != nil {
		t.Fatalf("new leader's fenced write failed: %v", err)
	}
	resp, err := cli.Get(ctx, "/kswitch/test/state")
	if err != nil {
		t.Fatal(err)
	}
	if got := string(resp.Kvs[0].Value); got != "from-b" {
		t.Fatalf("state = %q, want from-b", got)
	}

	// The caller's own comparisons are reported apart from the fence.
	_, err = tb.Txn(ctx, []clientv3.Cmp{clientv3.Compare(clientv3.Value("/kswitch/test/state"), "=", "nope")},
		clientv3.OpPut("/kswitch/test/state", "x"))
	if !errors.Is(err, election.ErrConditionFailed) {
		t.Fatalf("failed condition: got %v, want ErrConditionFailed", err)
	}
	cancel()
	<-b.done
}

func TestCleanResignHandsOverAndObserverFollows(t *testing.T) {
	e := testenv.StartEtcdT(t)
	cli := testenv.EtcdClientT(t, e)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	obs := election.NewObserver(cli, prefix, 2*time.Second, nil)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = obs.Run(ctx)
	}()
	defer wg.Wait()

	actx, acancel := context.WithCancel(ctx)
	a := campaign(t, actx, cli, "a")
	defer a.s.Close()
	ta := <-a.terms
	wait.For(t, 5*time.Second, "observer sees a", func() error {
		if l, ok := obs.Leader(); !ok || l.ID != "a" || l.Token != ta.Rev {
			return fmt.Errorf("observer: %+v %v", l, ok)
		}
		return nil
	})

	b := campaign(t, ctx, cli, "b")
	defer b.s.Close()
	start := time.Now()
	acancel() // a's leader work ends; Campaign resigns
	if err := <-a.done; err != nil {
		t.Fatalf("a's campaign after a clean stop: %v", err)
	}
	select {
	case tb := <-b.terms:
		// Both sessions live; only the resign can have handed over, so
		// this does not wait for any TTL.
		if d := time.Since(start); d > time.Second {
			t.Fatalf("successor elected after %v, want < 1s", d)
		}
		wait.For(t, 5*time.Second, "observer sees b", func() error {
			if l, ok := obs.Leader(); !ok || l.ID != "b" || l.Token != tb.Rev {
				return fmt.Errorf("observer: %+v %v", l, ok)
			}
			return nil
		})
	case <-time.After(5 * time.Second):
		t.Fatal("b not elected after a resigned")
	}
	cancel()
	<-b.done
}

func TestConfigValidate(t *testing.T) {
	for _, c := range []election.Config{{Prefix: "", ID: "a"}, {Prefix: "/x", ID: "a"}, {Prefix: "/x/", ID: ""}} {
		if _, err := election.NewCandidate(c); err == nil {
			t.Errorf("config %+v accepted", c)
		}
	}
}

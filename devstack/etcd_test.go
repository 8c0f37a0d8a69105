package devstack_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"

	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
)

func TestEtcdStopRestartKeepsDataAndClient(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	if got := e.Endpoints(); len(got) != 1 {
		t.Fatalf("Endpoints() = %v, want one endpoint", got)
	}
	cli := testenv.EtcdClientT(t, e)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := cli.Put(ctx, "/testenv/k", "v1"); err != nil {
		t.Fatalf("put: %v", err)
	}
	resp, err := cli.Get(ctx, "/testenv/k")
	if err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v1" {
		t.Fatalf("get = %v, %v; want v1", resp, err)
	}

	e.Stop()
	e.Stop() // idempotent
	if e.Running() {
		t.Fatal("Running() after Stop")
	}
	getCtx, getCancel := context.WithTimeout(context.Background(), time.Second)
	_, err = cli.Get(getCtx, "/testenv/k")
	getCancel()
	if err == nil {
		t.Fatal("get on a stopped etcd succeeded")
	}

	if err := e.Restart(); err != nil {
		t.Fatalf("restart: %v", err)
	}
	if err := e.Restart(); err == nil {
		t.Fatal("restart of a running etcd succeeded")
	}
	// The same client reconnects by itself.
	waitFor(t, 30*time.Second, "get after restart", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		resp, err := cli.Get(ctx, "/testenv/k")
		if err != nil {
			return err
		}
		if len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v1" {
			return fmt.Errorf("got %v, want v1", resp.Kvs)
		}
		return nil
	})
}

func TestEtcdStopLeavesNoGoroutines(t *testing.T) {
	defer goleak.VerifyNone(t, append([]goleak.Option{goleak.IgnoreCurrent()}, testenv.IgnoreEtcd...)...)

	e, err := devstack.StartEtcd(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	cli, err := e.Client()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := cli.Put(ctx, "k", "v"); err != nil {
		t.Fatal(err)
	}
	if err := cli.Close(); err != nil && !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
	e.Stop()
	if err := e.Restart(); err != nil {
		t.Fatal(err)
	}
	e.Stop()
}

func TestEtcdNewValueOnExistingDataDir(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	e1, err := devstack.StartEtcd(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	cli1, err := e1.Client()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := cli1.Put(ctx, "k", "kept"); err != nil {
		t.Fatal(err)
	}
	cli1.Close()
	e1.Stop()

	// A second devstack.StartEtcd on the same dir gets new ports but the old data.
	e2 := func() *devstack.Etcd {
		e, err := devstack.StartEtcd(dir, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(e.Stop)
		return e
	}()
	cli2 := testenv.EtcdClientT(t, e2)
	resp, err := cli2.Get(ctx, "k")
	if err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "kept" {
		t.Fatalf("get = %v, %v; want kept", resp, err)
	}
}

// TestEtcdCompactingCompactsItsHistory: with a retention of 2 s the
// server compacts away the revisions older than that by itself.
func TestEtcdCompactingCompactsItsHistory(t *testing.T) {
	t.Parallel()
	if _, err := devstack.StartEtcdCompacting(t.TempDir(), nil, 0); err == nil {
		t.Fatal("a retention of 0 was taken")
	}
	e, err := devstack.StartEtcdCompacting(t.TempDir(), nil, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Stop)
	cli := testenv.EtcdClientT(t, e)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	first, err := cli.Put(ctx, "/testenv/k", "0")
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, "the first revision compacted", func() error {
		// The compactor compacts to revisions it saw a retention ago.
		if _, err := cli.Put(ctx, "/testenv/k", time.Now().String()); err != nil {
			return err
		}
		_, err := cli.Get(ctx, "/testenv/k", clientv3.WithRev(first.Header.Revision))
		if errors.Is(err, rpctypes.ErrCompacted) {
			return nil
		}
		return fmt.Errorf("revision %d still readable (%v)", first.Header.Revision, err)
	})
}

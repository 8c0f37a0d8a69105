package etcdclient_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/etcdclient"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

func TestMain(m *testing.M) {
	wait.VerifyTestMain(m, testenv.LeakOptions()...)
}

// TestAuthOnFirstRequest: with a username and password, New succeeds
// while etcd is down (clientv3.New alone would fail), and the client
// authenticates once etcd is back; a wrong password fails requests with
// the reason, which Explain spells out.
func TestAuthOnFirstRequest(t *testing.T) {
	e := testenv.StartSecureEtcdT(t)
	pki := e.Security().PKI
	if err := e.AddUser("fleet", "pw", devstack.EtcdPermission{Key: "/kswitch/orders/", Prefix: true, Type: clientv3.PermissionType(clientv3.PermReadWrite)}); err != nil {
		t.Fatal(err)
	}
	cert, err := pki.Issue("fleet", "fleet")
	if err != nil {
		t.Fatal(err)
	}
	cfg := config.Default().Etcd
	cfg.Endpoints = e.Endpoints()
	cfg.TLS = config.TLS{CAFile: pki.CAFile, CertFile: cert.CertFile, KeyFile: cert.KeyFile}
	cfg.Username, cfg.Password = "fleet", "pw"

	e.Stop()
	c, err := etcdclient.New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatalf("New while etcd is down: %v", err)
	}
	defer c.Close()
	if err := e.Restart(); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 20*time.Second, "a put as fleet once etcd is back", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := c.Put(ctx, "/kswitch/orders/x", "1")
		return err
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = c.Put(ctx, "/kswitch/other/x", "1")
	if !errors.Is(err, rpctypes.ErrPermissionDenied) || !etcdclient.AccessDenied(err) {
		t.Errorf("put outside the role: %v, want permission denied", err)
	}
	if got := etcdclient.Explain(err, cfg, "write /kswitch/other/x").Error(); !strings.HasPrefix(got, `etcd permission denied to user "fleet" (write /kswitch/other/x)`) {
		t.Errorf("Explain = %s", got)
	}

	cfg.Password = "wrong"
	bad, err := etcdclient.New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatalf("New with a wrong password: %v", err)
	}
	defer bad.Close()
	_, err = bad.Get(ctx, "/kswitch/orders/x")
	if !errors.Is(err, rpctypes.ErrAuthFailed) || !etcdclient.AccessDenied(err) {
		t.Errorf("get with a wrong password: %v, want authentication failed", err)
	}
	if got := etcdclient.Explain(err, cfg, "read").Error(); !strings.HasPrefix(got, `etcd authentication failed for user "fleet": wrong username or password`) {
		t.Errorf("Explain = %s", got)
	}
	// A watch authenticates when its stream opens: refused as well.
	wctx, wcancel := context.WithTimeout(ctx, 2*time.Second)
	defer wcancel()
	var werr error
	for resp := range bad.Watch(wctx, "/kswitch/orders/", clientv3.WithPrefix()) {
		if werr = resp.Err(); werr != nil {
			break
		}
		t.Errorf("watch with a wrong password delivered %v", resp.Events)
	}
	if !errors.Is(werr, rpctypes.ErrAuthFailed) {
		t.Errorf("watch with a wrong password: %v, want authentication failed", werr)
	}
}

package devstack_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
)

// TestSecureEtcd: the server speaks TLS only to clients with a certificate
// of its CA, auth is on, and a user added with a prefix role reads and
// writes there and nowhere else, also after a restart.
func TestSecureEtcd(t *testing.T) {
	t.Parallel()
	e := testenv.StartSecureEtcdT(t)
	s := e.Security()
	if err := e.AddUser("fleet", "pw", devstack.EtcdPermission{Key: "/kswitch/orders/", Prefix: true, Type: clientv3.PermissionType(clientv3.PermReadWrite)}); err != nil {
		t.Fatal(err)
	}
	cert, err := s.PKI.Issue("fleet", "fleet")
	if err != nil {
		t.Fatal(err)
	}
	client := func(user, pass string, withCert bool) *clientv3.Client {
		t.Helper()
		tc := s.PKI.ClientTLS(nil)
		if withCert {
			tc = s.PKI.ClientTLS(&cert)
		}
		c, err := clientv3.New(clientv3.Config{Endpoints: e.Endpoints(), DialTimeout: 5 * time.Second, TLS: tc, Username: user, Password: pass})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	fleet := client("fleet", "pw", true)
	if _, err := fleet.Put(ctx, "/kswitch/orders/x", "1"); err != nil {
		t.Fatalf("put in the role's prefix: %v", err)
	}
	if _, err := fleet.Put(ctx, "/kswitch/other/x", "1"); !errors.Is(err, rpctypes.ErrPermissionDenied) {
		t.Errorf("put outside the role's prefix: %v, want permission denied", err)
	}

	// Without a client certificate the TLS handshake fails.
	nocert, err := clientv3.New(clientv3.Config{Endpoints: e.Endpoints(), DialTimeout: 5 * time.Second, TLS: s.PKI.ClientTLS(nil)})
	if err != nil {
		t.Fatal(err)
	}
	defer nocert.Close()
	short, scancel := context.WithTimeout(ctx, time.Second)
	if _, err := nocert.Get(short, "/kswitch/orders/x"); err == nil {
		t.Error("a client without a certificate read a key")
	}
	scancel()

	// Root (by certificate) sees everything; auth survives a restart.
	root := testenv.EtcdClientT(t, e)
	if _, err := root.Put(ctx, "/kswitch/other/x", "1"); err != nil {
		t.Fatalf("root put: %v", err)
	}
	e.Stop()
	if err := e.Restart(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "auth still on after restart", func() error {
		_, err := client("fleet", "pw", true).Put(ctx, "/kswitch/other/y", "1")
		if !errors.Is(err, rpctypes.ErrPermissionDenied) {
			return errors.New("put outside the prefix: " + errString(err))
		}
		return nil
	})
}

func errString(err error) string {
	if err == nil {
		return "no error"
	}
	return err.Error()
}

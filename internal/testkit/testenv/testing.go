package testenv

import (
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/devstack"
)

// Thin wrappers of devstack that fail the test on error and stop what they
// started in t.Cleanup. Cleanups run in reverse order of registration, so a client made
// with EtcdClientT is closed before the server made earlier is stopped.

// StartEtcdT starts an etcd with devstack.StartEtcd in a fresh t.TempDir(), with
// etcd's logs at error level on stderr, and stops it when the test ends.
// It calls t.Fatal on error, so it must be called from the test's goroutine.
func StartEtcdT(t testing.TB) *devstack.Etcd {
	t.Helper()
	e, err := devstack.StartEtcd(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Stop)
	return e
}

// EtcdClientT returns a client of e that is closed when the test ends.
// It calls t.Fatal on error, so it must be called from the test's goroutine.
func EtcdClientT(t testing.TB, e *devstack.Etcd) *clientv3.Client {
	t.Helper()
	cli, err := e.Client()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// StartKafkaT starts a Kafka cluster with devstack.StartKafka and stops it when the
// test ends. Unlike devstack.StartKafka, an empty opts.DataDir means a fresh
// t.TempDir(), so Stop and Restart keep the data by default. It calls
// t.Fatal on error, so it must be called from the test's goroutine.
func StartKafkaT(t testing.TB, name string, opts devstack.KafkaOptions) *devstack.Kafka {
	t.Helper()
	if opts.DataDir == "" {
		opts.DataDir = t.TempDir()
	}
	k, err := devstack.StartKafka(name, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(k.Stop)
	return k
}

// StartSecureEtcdT starts an etcd with devstack.StartSecureEtcd (TLS, client
// certificates and auth; certificates from a new PKI in t.TempDir()) and
// stops it when the test ends. It calls t.Fatal on error, so it must be
// called from the test's goroutine.
func StartSecureEtcdT(t testing.TB) *devstack.Etcd {
	t.Helper()
	pki, err := devstack.NewPKI(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	e, err := devstack.StartSecureEtcd(t.TempDir(), nil, pki)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Stop)
	return e
}

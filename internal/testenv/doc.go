// Package testenv runs the embedded infrastructure that kswitch's component
// tests and `kswitch demo` need: a single-member etcd (go.etcd.io/etcd/server
// embed) and fake Kafka clusters (github.com/twmb/franz-go/pkg/kfake), all in
// the calling process, on loopback ports.
//
// The core API (StartEtcd, StartKafka and their methods) takes plain
// parameters and returns errors, so it can be used outside tests. The *T
// helpers in testing.go wrap it for tests: they fail the test on error and
// register cleanup with t.Cleanup.
//
// Faults. Both services can be stopped and restarted on the same ports with
// their data, which looks to clients like a process crash and recovery: the
// port refuses connections while stopped. A Kafka cluster can also be made to
// fail (Fail: every request closes its connection, like brokers that are down
// behind a host that still answers) or to hang (Hang: requests are never
// answered, like a network partition) without stopping it; Recover lifts
// either.
//
// Goroutines. Every Stop waits until the service's own goroutines have been
// told to exit; a few finish asynchronously within milliseconds, and some
// libraries keep process-wide goroutines forever. Tests using goleak pass the
// option lists in leak.go (IgnoreEtcd, IgnoreSarama, IgnoreKafka, or all of
// them via LeakOptions).
package testenv

// Package devstack runs, in the calling process and on loopback ports, the
// infrastructure a kswitch fleet needs: a single-member etcd
// (go.etcd.io/etcd/server embed) and Kafka clusters
// (github.com/twmb/franz-go/pkg/kfake). `kswitch demo`, the examples and
// kswitch's own component tests run on it; production runs on real etcd
// and Kafka.
//
// The API (StartEtcd, StartKafka and their methods) takes plain parameters
// and returns errors; it does not import "testing". Test wrappers that fail
// the test and register cleanups live in kswitch's internal/testkit/testenv.
//
// Faults. Both services can be stopped and restarted on the same ports with
// their data, which looks to clients like a process crash and recovery: the
// port refuses connections while stopped. A Kafka cluster can also be made to
// fail (Fail: every request closes its connection, like brokers that are down
// behind a host that still answers), to hang (Hang: requests are never
// answered, like a network partition) or to starve (Starve: fetches return
// nothing) without stopping it; Recover lifts any of them. A Link cuts one
// client's connections.
//
// Goroutines. Every Stop waits until the service's own goroutines have been
// told to exit; a few finish asynchronously within milliseconds, and some
// libraries keep process-wide goroutines forever (see internal/testkit/testenv's
// LeakOptions).
package devstack

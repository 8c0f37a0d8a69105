// Package testenv holds what kswitch's tests add to devstack: wrappers that
// start an embedded etcd or Kafka cluster, fail the test on error and stop
// it in t.Cleanup (StartEtcdT, EtcdClientT, StartKafkaT, StartSecureEtcdT),
// and the goroutines goleak must ignore (LeakOptions). Only tests import
// it: it imports "testing" and goleak, which the kswitch binary must not
// link.
package testenv

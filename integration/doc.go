// Package integration holds kswitch's integration suite: real etcd server
// processes and etcdctl, Apache Kafka brokers (KRaft) and MirrorMaker 2
// from Maven jars, kcat, and kswitch agents as OS processes built from the
// tree, killed and restarted the way machines fail. The tests carry the
// build tag "integration" and run with `make integration`, which builds or
// fetches what they need and passes its location in KSWITCH_TEST_BIN,
// KSWITCH_TEST_ETCD_DIR and KSWITCH_TEST_KAFKA_DIR. See README.md.
package integration

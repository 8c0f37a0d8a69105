// Package integration holds kswitch's integration suite: real etcd server
// processes and etcdctl, kswitch agents as OS processes built from the tree,
// killed and restarted the way machines fail. The tests carry the build tag
// "integration" and run with `make integration`, which builds the binaries
// they need and passes their paths in KSWITCH_TEST_BIN and KSWITCH_TEST_ETCD_DIR.
package integration

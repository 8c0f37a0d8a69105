//go:build tools

// Package tools pins the etcd binaries of the integration suite.
package tools

import (
	_ "go.etcd.io/etcd/etcdctl/v3"
	_ "go.etcd.io/etcd/server/v3"
)

//go:build chaos

// Package chaos is kswitch's chaos run (make chaos, docs/CHAOS.md): a
// fleet of three `kswitch agent` processes on a stack served by
// integration/chaos/stack (embedded etcd, kfake clusters A, B and the sink
// C, mirrors both ways, a producer of numbered records), a nemesis that
// draws a timeline of faults from a seed and applies them, and a checker
// that reads only from outside (C read back to its end, etcd, the agents'
// HTTP). Everything carries the build tag "chaos", so that go test ./...
// neither builds nor runs it.
package chaos

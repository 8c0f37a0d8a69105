// Package testhooks holds the knobs this module's tests and benchmarks
// turn in packages they do not own. Its types are internal: a program
// outside the module cannot build one, so a public options struct that
// carries a pointer to one offers nothing to set.
package testhooks

import "github.com/kswitch/kswitch/internal/kafka"

// Leader changes a coordinator.Leader's behaviour for a test.
type Leader struct {
	// Dialer, when set, opens the leader's connections to a cluster
	// (a fault link of devstack, say).
	Dialer func(cluster string) kafka.Dialer
	// BreakBeforeMake turns off the preparation of planned switches
	// (agents warming their clients to the target, the
	// pre-translation): every switch revokes first and connects after, as
	// a failover must. The baseline of BenchmarkPlannedSwitch.
	BreakBeforeMake bool
}

// Package fleet is kswitch for programs: what the kswitch binary does, as
// calls.
//
//   - Member runs one member of a fleet as 'kswitch agent' does: an agent
//     whose handler is the routing sink (package routing), sharing one etcd
//     client, started and stopped in the order they need. 'kswitch agent'
//     and 'kswitch demo' run their agents through it; a program embedding
//     an agent with routing uses it too.
//   - Operator steers and reads a fleet through etcd as an operator does
//     with the kswitch commands: pin the fleet or a topic to a cluster,
//     move topics in stages, pause and resume, check and apply routes
//     (CompileRouting checks them without etcd), apply a configuration
//     change and await the leader's verdict, read the active
//     cluster, the signals, the routing layer and the switch history. Every method writes or reads the
//     keys an operator could write with etcdctl (docs/ARCHITECTURE.md, the
//     etcd key layout); the commands call it, so it stays what they do.
//   - OpenEtcd opens an etcd client from config.Etcd as the agent and the
//     commands do: TLS, credentials, timeouts.
//
// A fleet is named by its name alone (config.Config.Fleet, 'kswitch
// --fleet'): its keys are under /kswitch/<name>/, built by package keys.
//
// Lifecycles: Start(ctx) starts (ctx bounds the start only),
// Run(ctx, stopTimeout) starts and runs until ctx ends, Stop(ctx) ends
// cleanly within ctx, Abort ends as a crash would; each is safe to call
// after the others. A constructor starts no goroutine of its own; NewMember
// opens the member's etcd client (it makes no request until Start), so a
// Member built is stopped (Stop or Abort) even if it was never started.
// Operator has no goroutine: its methods are calls, bounded by their
// contexts.
package fleet

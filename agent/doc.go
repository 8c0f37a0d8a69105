// Package agent runs one kswitch agent: it registers in etcd on its
// session lease, campaigns for leadership, joins the fleet's gossip
// cluster using the registered agents as seeds, and serves its health,
// status and metrics over HTTP.
//
// An agent is embeddable: New, then Start (binds its listeners and
// returns), then Stop (clean: resigns, deregisters, leaves gossip) or
// Abort (as a crash would: nothing is released, etcd's lease TTL and
// gossip's failure detection clean up). Run combines them for cmd/.
//
// Where things are:
//
//   - agent.go: the Agent, its options, Start and Stop; session.go: one
//     etcd session (registration, the worker, leadership); status.go:
//     what it reports (readiness, status, the etcd probe); http.go: its
//     endpoints (the page is fleetview.Page).
//   - registry.go: the fleet's registrations; vouch.go: members vouching
//     for each other; gossip.go and gossipkey.go: gossip, its views and
//     its key; probe.go: probing the clusters.
//   - worker.go: the worker and its loop; assign.go: applying
//     assignments; startrelease.go: starting and releasing partitions;
//     kafkaconn.go: its connections to a cluster; partition.go and
//     tracker.go: one partition's consumption and its committable
//     position; commit.go and pacer.go: commits and their pace; hold.go:
//     the hold while commits fail; acks.go: acknowledging generations
//     and dead letters; signals.go: applying pause signals;
//     groupmirror.go: mirroring positions to the Kafka groups;
//     health.go: stuck and idle partitions; lifecycle.go and
//     startoffset.go: where a partition starts.
//   - dynconfig.go and configdigest.go: the configuration in force and
//     its digest; handler.go: the handler of an agent without routes;
//     metrics.go
//     and rate.go: the agent's measurements.
package agent

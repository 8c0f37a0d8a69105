// Package coordinator holds the leader's decisions: which source
// partitions exist, and which agent consumes each, published to etcd as
// generations of state/assignment with the revoke → ack → assign protocol
// so that a partition never has two consumers at once.
//
// It does not import agent/: the agent runs the coordinator as its leader
// work and feeds it the fleet's membership. It writes the values of
// package state.
//
// Where things are:
//
//   - leader.go: the Leader, its options and status; run.go: one term's
//     loop (read the fleet's state, follow etcd, take turns);
//     followers.go: the followers of acks/ and control/pin.
//   - decide.go: the verdict's decision to switch, the breaker, retries;
//     verdict.go and health.go: the health verdict from the agents'
//     cluster views; silence.go: agents planned without.
//   - publish.go: publishing generations (the handover hold, which
//     partitions are consumed where); plan.go: the assignment plan;
//     discovery.go: listing the partitions; lifecycle.go: topics
//     re-created or grown; repair.go: state another wrote, stalled
//     partitions.
//   - switch.go: the cluster switch protocol; prepare.go: a planned
//     switch's warm-up and pre-translation; translation.go: translating
//     the positions; activestate.go: reading, writing and recovering
//     state/active; history.go: writing history/; late.go: a failback's
//     late tail.
//   - topics.go: topic switches (pins of one topic); stages.go: staged
//     moves; naming.go: a logical topic's copies on each cluster.
package coordinator

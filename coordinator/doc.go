// Package coordinator holds the leader's decisions: which source
// partitions exist, and which agent consumes each, published to etcd as
// generations of state/assignment with the revoke → ack → assign protocol
// so that a partition never has two consumers at once.
//
// It does not import agent/: the agent runs the coordinator as its leader
// work and feeds it the fleet's membership.
package coordinator

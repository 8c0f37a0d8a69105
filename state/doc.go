// Package state is the schema of the values a fleet keeps in etcd under
// /kswitch/<fleet>/state/, control/ and history/, with their parsers and
// readers: the leader (package coordinator) writes with these types, and
// the agents, the commands, the status page and the checkers read with
// them. A parser refuses a value that is not one (too large, malformed,
// out of range) with the reason, so that a reader keeps its last good
// state.
//
//   - Active (state/active): the cluster the fleet consumes, a switch in
//     progress, the topics placed elsewhere; FailbackCheck
//     (state/failback).
//   - Assignment (state/assignment): the generation, the partitions each
//     agent owns on each cluster.
//   - SwitchEvent (history/<epoch>): one cluster switch, its phases and
//     each partition's translation; LoadPartitions reads the chunks of a
//     large one.
//   - StagePlan (control/stages), StageState (state/stages), StageStep
//     (history/stages/): a staged move.
//   - Stalled (state/stalled): partitions no agent consumes.
//   - TopicEvent (history/topics/): a source topic re-created or grown.
//   - ConfigVersion (state/config), ConfigRefusal (state/config-refused):
//     the dynamic configuration the leader accepted or refused, its
//     ConfigOverrides over each agent's file; ReadConfigState reads both.
//   - Registration (agents/<id>): an agent's registration, with the
//     digest of its fleet-wide configuration (ConfigDigest).
package state

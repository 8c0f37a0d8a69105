// Package keys builds every etcd key kswitch reads or writes.
//
// All keys of a fleet live under /kswitch/<fleet>/. Building them in one
// place keeps prefix mistakes (a missing or doubled "/", a prefix that also
// matches a longer name) out of the rest of the code: every prefix returned
// here ends in "/", so "agents/a" never matches "agents/ab".
package keys

import (
	"fmt"
	"strings"
)

// Root is the prefix shared by all fleets.
const Root = "/kswitch/"

// SecretsRoot is the prefix of the fleets' secrets: outside Root, so that
// a role granted the reading of a fleet's prefix (an operator's), or of
// Root, does not read them. Only the fleet's own role is granted its key.
const SecretsRoot = "/kswitch-keys/"

// Fleet builds the keys of one fleet. The zero value is not usable; call New.
type Fleet struct {
	name, prefix string
}

// New returns the key builder for fleet. The name must be non-empty and
// must not contain "/" (config validation enforces this; New panics on a
// programming error).
func New(fleet string) Fleet {
	if err := ValidName(fleet); err != nil {
		panic(fmt.Sprintf("keys: fleet %q: %v", fleet, err))
	}
	return Fleet{name: fleet, prefix: Root + fleet + "/"}
}

// ValidName reports whether s can be used as a fleet name, agent id, topic or
// channel name inside a key: non-empty, no "/", no whitespace or control
// characters.
func ValidName(s string) error {
	if s == "" {
		return fmt.Errorf("must not be empty")
	}
	if strings.ContainsAny(s, "/ \t\r\n") {
		return fmt.Errorf("must not contain '/' or whitespace")
	}
	for _, r := range s {
		if r < 0x20 || r == 0x7f {
			return fmt.Errorf("must not contain control characters")
		}
	}
	return nil
}

// Name is the fleet's name.
func (f Fleet) Name() string { return f.name }

// Prefix is /kswitch/<fleet>/.
func (f Fleet) Prefix() string { return f.prefix }

// GossipKey holds the fleet's gossip encryption keys (base64, one per
// line, the first used to send), created by the first agent:
// /kswitch-keys/<fleet>/gossip, outside Prefix, so that only a role
// granted this key reads it.
func (f Fleet) GossipKey() string { return SecretsRoot + f.name + "/gossip" }

// Election is the prefix of the leader election.
func (f Fleet) Election() string { return f.prefix + "election/" }

// Agents is the prefix of the agent registrations.
func (f Fleet) Agents() string { return f.prefix + "agents/" }

// Agent is the registration key of one agent.
func (f Fleet) Agent(id string) string { return f.Agents() + id }

// AgentID returns the agent id of a registration key, and false when key is
// not directly under Agents().
func (f Fleet) AgentID(key string) (string, bool) {
	id, ok := strings.CutPrefix(key, f.Agents())
	if !ok || id == "" || strings.Contains(id, "/") {
		return "", false
	}
	return id, true
}

// State is the prefix of the leader-written state.
func (f Fleet) State() string { return f.prefix + "state/" }

// Active is the key of the active cluster.
func (f Fleet) Active() string { return f.State() + "active" }

// Assignment is the key of the partition assignment.
func (f Fleet) Assignment() string { return f.State() + "assignment" }

// Failback holds the leader's last failback check while the fleet is on
// the standby: whether the primary holds what was consumed there, and why
// not.
func (f Fleet) Failback() string { return f.State() + "failback" }

// Clusters is the leader's view of every source cluster: its place in
// the order of preference, its health, and how far it is behind the
// active one (state.ClusterState).
func (f Fleet) Clusters() string { return f.State() + "clusters" }

// Stalled lists the discovered partitions that no agent has consumed for
// longer than the leader's bound (state.Stalled); absent when none.
func (f Fleet) Stalled() string { return f.State() + "stalled" }

// Acks is the prefix of the per-agent generation acknowledgements.
func (f Fleet) Acks() string { return f.prefix + "acks/" }

// Ack is the acknowledgement key of one agent.
func (f Fleet) Ack(id string) string { return f.Acks() + id }

// Offsets is the prefix of all committed offsets.
func (f Fleet) Offsets() string { return f.prefix + "offsets/" }

// ClusterOffsets is the prefix of the committed offsets of one cluster.
func (f Fleet) ClusterOffsets(cluster string) string { return f.Offsets() + cluster + "/" }

// TopicOffsets is the prefix of the committed offsets of one topic on one
// cluster.
func (f Fleet) TopicOffsets(cluster, topic string) string {
	return f.ClusterOffsets(cluster) + topic + "/"
}

// Offset is the committed-offset key of one partition on one cluster.
func (f Fleet) Offset(cluster, topic string, partition int32) string {
	return fmt.Sprintf("%s%d", f.TopicOffsets(cluster, topic), partition)
}

// Signals is the prefix of all pause/start signals.
func (f Fleet) Signals() string { return f.prefix + "signals/" }

// FleetSignal is the fleet-wide signal key.
func (f Fleet) FleetSignal() string { return f.Signals() + "fleet" }

// TopicSignal is the signal key of one source topic.
func (f Fleet) TopicSignal(topic string) string { return f.Signals() + "topic/" + topic }

// AgentSignal is the signal key of one agent.
func (f Fleet) AgentSignal(id string) string { return f.Signals() + "agent/" + id }

// ChannelSignal is the signal key of one routing channel.
func (f Fleet) ChannelSignal(channel string) string { return f.Signals() + "channel/" + channel }

// Pin is the operator's manual cluster pin.
func (f Fleet) Pin() string { return f.prefix + "control/pin" }

// TopicPins is the prefix of the operator's pins of single topics.
func (f Fleet) TopicPins() string { return f.prefix + "control/pin/topic/" }

// TopicPin is the pin of one logical topic to a cluster.
func (f Fleet) TopicPin(topic string) string { return f.TopicPins() + topic }

// Stages is the operator's staged move: topics moved to a cluster stage by
// stage, with a health check between stages.
func (f Fleet) Stages() string { return f.prefix + "control/stages" }

// StagesState is the leader's progress of the staged move.
func (f Fleet) StagesState() string { return f.prefix + "state/stages" }

// StageHistory is the prefix of the staged moves' steps.
func (f Fleet) StageHistory() string { return f.History() + "stages/" }

// StageEvent is the key of step n of the staged move written at etcd
// revision rev, zero-padded so that keys sort in order.
func (f Fleet) StageEvent(rev int64, n int) string {
	return fmt.Sprintf("%s%06d", f.StageEvents(rev), n)
}

// StageEvents is the prefix of the steps of the staged move written at
// etcd revision rev.
func (f Fleet) StageEvents(rev int64) string {
	return fmt.Sprintf("%s%020d/", f.StageHistory(), rev)
}

// DeadLetters is the prefix of the agents' dead-letter counts
// (deadletters/<id>, on the agent's lease).
func (f Fleet) DeadLetters() string { return f.prefix + "deadletters/" }

// DeadLetterCount is the key of one agent's dead-letter counts.
func (f Fleet) DeadLetterCount(id string) string { return f.DeadLetters() + id }

// Routes is the key of the dynamic routing rules.
func (f Fleet) Routes() string { return f.prefix + "routes" }

// Channels is the prefix of the dynamic channel definitions.
func (f Fleet) Channels() string { return f.prefix + "channels/" }

// Channel is the key of one channel definition.
func (f Fleet) Channel(name string) string { return f.Channels() + name }

// History is the prefix of the switch history.
func (f Fleet) History() string { return f.prefix + "history/" }

// HistoryEvent is the key of one switch event. The epoch is zero-padded so
// that keys sort in epoch order.
func (f Fleet) HistoryEvent(epoch int64) string {
	return fmt.Sprintf("%s%020d", f.History(), epoch)
}

// SwitchHistory is the prefix of the switch events alone: an epoch
// zero-padded to 20 digits always starts with "0" (int64 has 19).
func (f Fleet) SwitchHistory() string { return f.History() + "0" }

// HistoryPartitions is the prefix under which a switch of more partitions
// than one etcd value holds keeps their translations (its event at
// HistoryEvent counts the chunks); "p" keeps them out of SwitchHistory.
func (f Fleet) HistoryPartitions(epoch int64) string {
	return fmt.Sprintf("%spartitions/%020d/", f.History(), epoch)
}

// HistoryPartitionChunk is the key of chunk n of a switch's partitions.
func (f Fleet) HistoryPartitionChunk(epoch int64, n int) string {
	return fmt.Sprintf("%s%06d", f.HistoryPartitions(epoch), n)
}

// TopicHistory is the prefix of the source topics' lifecycle events
// (a topic deleted and created again, partitions added).
func (f Fleet) TopicHistory() string { return f.History() + "topics/" }

// TopicEvent is the key of lifecycle event n (when the leader found it,
// in Unix nanoseconds, zero-padded so that keys sort in time order).
func (f Fleet) TopicEvent(n int64) string {
	return fmt.Sprintf("%s%020d", f.TopicHistory(), n)
}

// ConfigHistory is the prefix of the dynamic configuration events.
func (f Fleet) ConfigHistory() string { return f.History() + "config/" }

// ConfigEvent is the key of the event of dynamic configuration version n,
// zero-padded so that keys sort in version order.
func (f Fleet) ConfigEvent(n int64) string {
	return fmt.Sprintf("%s%020d", f.ConfigHistory(), n)
}

// Config is the prefix of the dynamic configuration layer that operators
// write (kswitch config apply, or etcdctl put): config/source and
// config/clusters/<name>. Agents never act on it directly; the leader
// validates each version and publishes what it accepted at StateConfig.
func (f Fleet) Config() string { return f.prefix + "config/" }

// ConfigSource is the key of the dynamic source override.
func (f Fleet) ConfigSource() string { return f.Config() + "source" }

// ConfigClusters is the prefix of the dynamic cluster definitions.
func (f Fleet) ConfigClusters() string { return f.Config() + "clusters/" }

// ConfigCluster is the key of one dynamic cluster definition.
func (f Fleet) ConfigCluster(name string) string { return f.ConfigClusters() + name }

// StateConfig is the key of the dynamic configuration version in force,
// written by the leader after validation.
func (f Fleet) StateConfig() string { return f.State() + "config" }

// ConfigRefusal is the key of the last refused dynamic configuration; it
// is deleted when a later version is accepted.
func (f Fleet) ConfigRefusal() string { return f.State() + "config-refused" }

// ConfigAcks is the prefix of the per-agent acknowledgements of the
// dynamic configuration version each agent has applied.
func (f Fleet) ConfigAcks() string { return f.prefix + "config-acks/" }

// ConfigAck is the configuration acknowledgement key of one agent.
func (f Fleet) ConfigAck(id string) string { return f.ConfigAcks() + id }

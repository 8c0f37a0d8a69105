package keys

import (
	"strings"
	"testing"
)

func TestPrefixesDoNotCollide(t *testing.T) {
	k := New("orders")
	if strings.HasPrefix(New("orders2").Prefix(), k.Prefix()) {
		t.Error("fleet orders2 is under fleet orders' prefix")
	}
	if id, ok := k.AgentID(k.Agent("agent-1")); !ok || id != "agent-1" {
		t.Errorf("AgentID(Agent(agent-1)) = %q, %v", id, ok)
	}
	for _, bad := range []string{k.Agents(), k.Agents() + "a/b", k.Ack("agent-1")} {
		if id, ok := k.AgentID(bad); ok {
			t.Errorf("AgentID(%q) = %q, want not an agent key", bad, id)
		}
	}
	if strings.HasPrefix(k.Offset("A", "orders2", 1), k.TopicOffsets("A", "orders")) {
		t.Error("topic orders2's offsets are under topic orders' prefix")
	}
	if strings.HasPrefix(k.Offset("AB", "orders", 1), k.ClusterOffsets("A")) {
		t.Error("cluster AB's offsets are under cluster A's prefix")
	}
	if got, want := k.Offset("A", "orders", 3), "/kswitch/orders/offsets/A/orders/3"; got != want {
		t.Errorf("Offset = %q, want %q", got, want)
	}
	if g := k.GossipKey(); strings.HasPrefix(g, Root) || strings.HasPrefix(g, k.Prefix()) || g != "/kswitch-keys/orders/gossip" {
		t.Errorf("GossipKey = %q: want /kswitch-keys/orders/gossip, outside what a read of %s or %s grants", g, Root, k.Prefix())
	}
	if strings.HasPrefix(New("orders2").GossipKey(), SecretsRoot+"orders/") {
		t.Error("fleet orders2's gossip key is under fleet orders' secrets")
	}
	if a, b := k.HistoryEvent(9), k.HistoryEvent(10); a >= b {
		t.Errorf("history keys do not sort by epoch: %q >= %q", a, b)
	}
	if c := k.HistoryPartitionChunk(9, 0); strings.HasPrefix(c, k.SwitchHistory()) || strings.HasPrefix(k.HistoryPartitionChunk(90, 0), k.HistoryPartitions(9)) {
		t.Errorf("a switch's partition chunk %q is read as a switch event, or under another epoch's chunks", c)
	}
}

func TestValidName(t *testing.T) {
	for _, s := range []string{"", "a/b", "a b", "a\tb", "a\x00"} {
		if ValidName(s) == nil {
			t.Errorf("ValidName(%q) accepted", s)
		}
	}
	for _, s := range []string{"orders", "agent-1", "A.b_c"} {
		if err := ValidName(s); err != nil {
			t.Errorf("ValidName(%q): %v", s, err)
		}
	}
}

package agent_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-msgpack/v2/codec"
	"github.com/hashicorp/memberlist"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// forgeDead sends one unauthenticated UDP packet to a gossip address: a
// memberlist "dead" message naming victim, with the fleet's label, as a
// stranger on the network can.
func forgeDead(t *testing.T, to, victim string) {
	t.Helper()
	var buf bytes.Buffer
	buf.WriteByte(5) // memberlist's deadMsg
	msg := struct {
		Incarnation uint32
		Node        string
		From        string
	}{1 << 30, victim, "stranger"}
	if err := codec.NewEncoder(&buf, &codec.MsgpackHandle{}).Encode(msg); err != nil {
		t.Fatal(err)
	}
	pkt, err := memberlist.AddLabelHeaderToPacket(buf.Bytes(), "kswitch/orders")
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("udp", to)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write(pkt); err != nil {
		t.Fatal(err)
	}
}

// leaseOf returns the lease of agent id's registration.
func leaseOf(t *testing.T, e *devstack.Etcd, id string) int64 {
	t.Helper()
	cli := testenv.EtcdClientT(t, e)
	resp, err := cli.Get(context.Background(), fleetKeys.Agent(id))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return 0
	}
	return resp.Kvs[0].Lease
}

// TestAForgedGossipDeathEvictsNobody: a stranger sends the leader's
// gossip port "dead" messages naming a live agent, twenty times. With
// plain gossip (agent.gossip_encryption off: by default the packets would
// not even be decrypted) gossip believes them for a moment, but the
// leader acts on a death only when the agent's HTTP endpoint does not
// answer: this one does, so its lease and its partitions stay.
func TestAForgedGossipDeathEvictsNobody(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 4}})
	l := newLedger()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		cfg := consumeConfig(e, k, id)
		cfg.Agent.GossipEncryption = "off"
		agents = append(agents, startConsumer(t, cfg, l.handler(id)))
	}
	waitBalanced(t, 4, agents...)
	leader := leaderOf(t, agents...)
	victim := agents[0]
	if victim == leader {
		victim = agents[1]
	}
	lease := leaseOf(t, e, victim.ID())
	for i := range 20 {
		forgeDead(t, leader.GossipAddr(), victim.ID())
		if i == 0 {
			wait.For(t, 5*time.Second, "the leader refusing the forged death", func() error {
				if v, _ := metricValue(leader, "kswitch_gossip_deaths_refuted_total", nil); v < 1 {
					return fmt.Errorf("not yet")
				}
				return nil
			})
		}
	}
	wait.For(t, 10*time.Second, "the victim alive in the leader's gossip again", func() error {
		for _, m := range leader.Status().Gossip {
			if m.Name == victim.ID() {
				return nil
			}
		}
		return fmt.Errorf("%s not a gossip member", victim.ID())
	})
	if got := leaseOf(t, e, victim.ID()); got != lease {
		t.Fatalf("%s's registration is on lease %x, was %x: evicted by a forged packet", victim.ID(), got, lease)
	}
	if len(victim.Owned()) == 0 {
		t.Errorf("%s owns nothing after the forged deaths", victim.ID())
	}
	v, _ := metricValue(leader, "kswitch_gossip_deaths_refuted_total", nil)
	t.Logf("20 forged deaths: %v refused by the leader, %s kept lease %x", v, victim.ID(), lease)
}

// TestEncryptedGossipRefusesStrangers: agents that share a gossip key form
// one gossip cluster; a node without the key cannot join it, nor can one
// with another key; a key file that is not a key is refused at start. The
// key file wins over the fleet's key: none is made in etcd.
func TestEncryptedGossipRefusesStrangers(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 4}})
	dir := t.TempDir()
	keyFile := func(name string, keys ...string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(strings.Join(keys, "\n")+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	key := func(b byte) string { return base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{b}, 32)) }
	// The second key is accepted on receipt: a rotation in progress.
	file := keyFile("keys", "# the fleet's gossip keys", key(1), key(2))
	l := newLedger()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		cfg := consumeConfig(e, k, id)
		cfg.Agent.GossipKeyFile = file
		agents = append(agents, startConsumer(t, cfg, l.handler(id)))
	}
	waitGossipMembers(t, 15*time.Second, "three encrypted gossip members", agents...)

	if resp, err := testenv.EtcdClientT(t, e).Get(context.Background(), fleetKeys.GossipKey()); err != nil || len(resp.Kvs) != 0 {
		t.Errorf("agents with a key file made the fleet's key in etcd (%v): %v", err, resp.Kvs)
	}

	join := func(name string, keys ...[]byte) error { return joinGossip(t, agents[0].GossipAddr(), name, keys...) }
	if err := join("stranger"); err == nil {
		t.Error("a node without the gossip key joined the fleet's gossip")
	} else {
		t.Logf("without the key: %v", err)
	}
	if err := join("other-key", bytes.Repeat([]byte{9}, 32)); err == nil {
		t.Error("a node with another key joined the fleet's gossip")
	}
	// The middle of a rotation: a node that sends with the new key and
	// still knows the old one talks to agents that send with the old key
	// and know the new one.
	if err := join("rotating", bytes.Repeat([]byte{2}, 32), bytes.Repeat([]byte{1}, 32)); err != nil {
		t.Errorf("a node sending with the fleet's second key (a rotation) could not join: %v", err)
	}

	bad := consumeConfig(e, k, "agent-9")
	bad.Agent.GossipKeyFile = keyFile("bad", base64.StdEncoding.EncodeToString([]byte("short")))
	if err := bad.Validate(); err == nil || !strings.Contains(err.Error(), "agent.gossip_key_file") || !strings.Contains(err.Error(), "16, 24 or 32 bytes") {
		t.Errorf("a 5-byte key: Validate says %v", err)
	}
}

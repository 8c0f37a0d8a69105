package agent_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-msgpack/v2/codec"
	"github.com/hashicorp/memberlist"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/coordinator"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/state"
)

// forgedIncarnation is the incarnation of the next forged "alive": each
// is far above the last, so it overrides the real node's refutation
// (which takes the incarnation it refutes plus one).
var forgedIncarnation atomic.Uint32

func init() { forgedIncarnation.Store(1 << 24) }

// forgeAlive sends one unauthenticated UDP packet to a gossip address: a
// memberlist "alive" message for node name at addr, with metadata meta
// and an incarnation above any real one, with the fleet's label, as a
// stranger on the network can.
func forgeAlive(t *testing.T, to, name, addr string, meta []byte) {
	t.Helper()
	host, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	port, err := strconv.Atoi(p)
	if err != nil {
		t.Fatal(err)
	}
	c := memberlist.DefaultLANConfig()
	msg := struct {
		Incarnation uint32
		Node        string
		Addr        []byte
		Port        uint16
		Meta        []byte
		Vsn         []uint8
	}{forgedIncarnation.Add(1 << 10), name, net.ParseIP(host).To4(), uint16(port), meta, []uint8{
		memberlist.ProtocolVersionMin, memberlist.ProtocolVersionMax, c.ProtocolVersion,
		c.DelegateProtocolMin, c.DelegateProtocolMax, c.DelegateProtocolVersion}}
	var buf bytes.Buffer
	buf.WriteByte(4) // memberlist's aliveMsg
	if err := codec.NewEncoder(&buf, &codec.MsgpackHandle{}).Encode(msg); err != nil {
		t.Fatal(err)
	}
	pkt, err := memberlist.AddLabelHeaderToPacket(buf.Bytes(), "kswitch/orders")
	if err != nil {
		t.Fatal(err)
	}
	conn, err := net.Dial("udp", to)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write(pkt); err != nil {
		t.Fatal(err)
	}
}

// aDownForADay is an agent's view claiming that every broker of A has
// refused its connections for a day, and that B is fine.
func aDownForADay(t *testing.T) []byte {
	t.Helper()
	b, err := json.Marshal(map[string]coordinator.ClusterView{
		"A": {Reachable: false, FailingMs: (24 * time.Hour).Milliseconds(), Refused: true, Error: "connection refused"},
		"B": {Reachable: true, LatencyMs: 1},
	})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// waitGossipMembers waits until every one of agents counts all of them
// as gossip members.
func waitGossipMembers(t *testing.T, timeout time.Duration, what string, agents ...*agent.Agent) {
	t.Helper()
	wait.For(t, timeout, what, func() error {
		for _, a := range agents {
			if got := len(a.Status().Gossip); got != len(agents) {
				return fmt.Errorf("%s sees %d gossip members", a.ID(), got)
			}
		}
		return nil
	})
}

// joinGossip starts a gossip node called name with the fleet's label and
// keys (the first to send with; none: plain gossip), has it join the
// agent gossiping at to, and makes it leave: whether a node with those
// keys is let in.
func joinGossip(t *testing.T, to, name string, keys ...[]byte) error {
	t.Helper()
	c := memberlist.DefaultLANConfig()
	c.Name, c.BindAddr, c.BindPort, c.Label = name, "127.0.0.1", 0, "kswitch/orders"
	c.Logger = log.New(io.Discard, "", 0)
	c.TCPTimeout = time.Second
	if len(keys) > 0 {
		kr, err := memberlist.NewKeyring(keys[1:], keys[0])
		if err != nil {
			t.Fatal(err)
		}
		c.Keyring = kr
	}
	m, err := memberlist.Create(c)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = m.Leave(time.Second)
		_ = m.Shutdown()
	}()
	_, err = m.Join([]string{to})
	return err
}

// forgedViewsSwitch runs a fleet on A (and B, its replica) with
// agent.gossip_encryption set to encryption, and sends the leader's gossip
// port forged "alive" packets of the two other agents, under their names
// and addresses, claiming that they have seen A refuse their connections
// for a day, every 50 ms for the failure window plus two push/pull
// intervals (the leader looks at the views at each change and probe
// interval: dozens of turns). It returns the switch history when the
// fleet switched, at once, or nil when it stayed on A all along.
func forgedViewsSwitch(t *testing.T, encryption string) []state.SwitchEvent {
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, agents, p := flowingFleet(t, d, func(c *config.Config) { c.Agent.GossipEncryption = encryption })
	defer p.halt()
	waitFlowing(t, d, l, 100)
	leader := leaderOf(t, agents...)
	var others []*agent.Agent
	for _, a := range agents {
		if a != leader {
			others = append(others, a)
		}
	}
	cfg := d.config("x")
	began := time.Now()
	// Long enough for the forged views to reach the leader and stay there
	// for the failure window: the keyed fleet must not switch in it. A
	// fleet with plain gossip is given longer to finish its switch (into
	// history/) on a loaded machine; it returns as soon as it has.
	deadline := began.Add(cfg.Failover.FailureWindow + 2*agent.PushPullInterval)
	if encryption == "off" {
		deadline = deadline.Add(20 * time.Second)
	}
	for time.Now().Before(deadline) {
		for _, a := range others {
			forgeAlive(t, leader.GossipAddr(), a.ID(), a.GossipAddr(), aDownForADay(t))
		}
		if h := readHistory(t, cli); len(h) > 0 {
			t.Logf("%s: the fleet switched %v after the first forged packet: %s", encryption, h[0].Started.Sub(began), h[0].Reason)
			return h
		}
		if c, err := activeOf(agents...); err == nil && c != "A" {
			t.Fatalf("%s: the fleet consumes %s with no switch in history", encryption, c)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return nil
}

// TestForgedViewsWithoutTheKeyMoveNothing: a fleet started with no key
// file encrypts its gossip with the fleet's key from etcd, so a
// stranger's plain "alive" packets claiming that two agents have seen A
// refuse connections for a day change nothing: the fleet stays on A, with
// no switch in history. With agent.gossip_encryption off, the same packets
// switch the fleet to B at once: the threat the key is for.
func TestForgedViewsWithoutTheKeyMoveNothing(t *testing.T) {
	t.Parallel()
	t.Run("auto", func(t *testing.T) {
		t.Parallel()
		if h := forgedViewsSwitch(t, "auto"); h != nil {
			t.Fatalf("forged plain gossip switched a fleet keyed by default: %s", h[0].Reason)
		}
	})
	t.Run("off", func(t *testing.T) {
		t.Parallel()
		if h := forgedViewsSwitch(t, "off"); h == nil {
			t.Fatal("the forged views did not switch a fleet with plain gossip: the test forges nothing the leader believes")
		}
	})
}

// TestFleetGossipKeyIsCreatedOnce: agents started at once with no key
// file agree on one key, which the first writes to etcd and nobody
// rewrites; an agent restarted reads it back and gossips with the others
// again.
func TestFleetGossipKeyIsCreatedOnce(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	cli := testenv.EtcdClientT(t, e)
	const n = 3
	agents := make([]*agent.Agent, n)
	var wg sync.WaitGroup
	for i := range n {
		a, err := agent.New(testConfig(e, fmt.Sprintf("agent-%d", i+1)), agent.Options{})
		if err != nil {
			t.Fatal(err)
		}
		agents[i] = a
		t.Cleanup(func() { _ = a.Stop(context.Background()) })
	}
	for _, a := range agents {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := a.Start(context.Background()); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	waitGossipMembers(t, 20*time.Second, "three agents gossiping with the fleet's key", agents...)
	key := func() *clientv3.GetResponse {
		resp, err := cli.Get(context.Background(), fleetKeys.GossipKey())
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Kvs) != 1 {
			t.Fatalf("%d values at %s", len(resp.Kvs), fleetKeys.GossipKey())
		}
		return resp
	}
	first := key().Kvs[0]
	if first.Version != 1 {
		t.Errorf("the fleet's gossip key was written %d times", first.Version)
	}
	keys, err := config.ParseGossipKeys(first.Value, "etcd")
	if err != nil || len(keys) != 1 || len(keys[0]) != 32 {
		t.Errorf("the fleet's gossip key %q: %d keys, %v; want one of 32 bytes", first.Value, len(keys), err)
	}

	if err := agents[0].Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	agents[0] = startFleetAgent(t, testConfig(e, "agent-1"), agent.Options{})
	waitGossipMembers(t, 20*time.Second, "the restarted agent gossiping with the others", agents...)
	if again := key().Kvs[0]; again.ModRevision != first.ModRevision || !bytes.Equal(again.Value, first.Value) {
		t.Errorf("the fleet's gossip key changed when an agent restarted: revision %d, was %d", again.ModRevision, first.ModRevision)
	}
}

// TestForgedViewsOfStrangersAreNotCounted: with plain gossip, a stranger's
// node under a name that is no agent's, and one under the name of an agent
// registered in etcd but gossiping from elsewhere than it registered,
// claim that A has refused them for a day. The leader counts neither: its
// verdict names no agent that sees A down, and the second is counted as
// a refused value. The same claim under a live agent's name and address
// is cut to the time since that agent started, and counted as refused.
func TestForgedViewsOfStrangersAreNotCounted(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	_, agents, p := flowingFleet(t, d, func(c *config.Config) { c.Agent.GossipEncryption = "off" })
	defer p.halt()
	leader := leaderOf(t, agents...)
	// A registration in etcd, on a lease of its own, for an agent whose
	// gossip runs nowhere.
	lease, err := cli.Grant(context.Background(), 60)
	if err != nil {
		t.Fatal(err)
	}
	reg, err := json.Marshal(state.Registration{ID: "agent-9", HTTP: "127.0.0.1:1", Gossip: "127.0.0.1:2", Started: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(context.Background(), fleetKeys.Agent("agent-9"), string(reg), clientv3.WithLease(lease.ID)); err != nil {
		t.Fatal(err)
	}
	stranger := "127.0.0.1:3"
	wait.For(t, 10*time.Second, "the leader refusing agent-9's views from another address", func() error {
		forgeAlive(t, leader.GossipAddr(), "ghost-1", stranger, aDownForADay(t))
		forgeAlive(t, leader.GossipAddr(), "agent-9", stranger, aDownForADay(t))
		if v, _ := metricValue(leader, "kswitch_refused_values_total", map[string]string{"kind": "gossip"}); v < 1 {
			return fmt.Errorf("%v gossip values refused", v)
		}
		return nil
	})
	var names []string
	for _, m := range leader.Status().Gossip {
		names = append(names, m.Name)
	}
	if st := leader.Status().Coordinator; st != nil && bytes.Contains([]byte(st.Verdict), []byte("unreachable from")) {
		t.Errorf("the leader counts a forged view: %q (gossip members %v)", st.Verdict, names)
	}
	if h := readHistory(t, cli); len(h) != 0 {
		t.Errorf("forged views switched the fleet: %+v", h)
	}
	t.Logf("gossip members %v; verdict %q", names, leader.Status().Coordinator.Verdict)

	var other *agent.Agent
	for _, a := range agents {
		if a != leader {
			other = a
		}
	}
	wait.For(t, 10*time.Second, "the leader cutting "+other.ID()+"'s claim of a day-long failure", func() error {
		forgeAlive(t, leader.GossipAddr(), other.ID(), other.GossipAddr(), aDownForADay(t))
		if v, _ := metricValue(leader, "kswitch_refused_values_total", map[string]string{"kind": "gossip"}); v < 2 {
			return fmt.Errorf("%v gossip values refused", v)
		}
		return nil
	})
}

// TestFleetGossipKeyRotatesWithoutARestart: the three steps of a rotation
// written to the fleet's key in etcd are applied by the running agents at
// once: with "old, new" a node sending with the new key (and knowing the
// old) joins; with "new, old" the agents send with the new key; with
// "new" alone a node knowing only the new key joins and one knowing only
// the old is refused. The agents gossip together throughout, and a value
// that is not keys changes nothing and is counted as refused.
func TestFleetGossipKeyRotatesWithoutARestart(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	cli := testenv.EtcdClientT(t, e)
	agents := []*agent.Agent{startAgent(t, e, "agent-1"), startAgent(t, e, "agent-2"), startAgent(t, e, "agent-3")}
	waitGossipMembers(t, 20*time.Second, "three agents gossiping with the fleet's key", agents...)
	resp, err := cli.Get(context.Background(), fleetKeys.GossipKey())
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("the fleet's gossip key: %v, %v", resp, err)
	}
	old, err := config.ParseGossipKeys(resp.Kvs[0].Value, "etcd")
	if err != nil {
		t.Fatal(err)
	}
	nu := bytes.Repeat([]byte{7}, 32)
	put := func(keys ...[]byte) {
		t.Helper()
		var val string
		for _, k := range keys {
			val += base64.StdEncoding.EncodeToString(k) + "\n"
		}
		if _, err := cli.Put(context.Background(), fleetKeys.GossipKey(), val); err != nil {
			t.Fatal(err)
		}
	}
	joins := func(name string, keys ...[]byte) error { return joinGossip(t, agents[1].GossipAddr(), name, keys...) }
	mustJoin := func(what, name string, keys ...[]byte) {
		t.Helper()
		wait.For(t, 10*time.Second, what, func() error { return joins(name, keys...) })
	}

	put(old[0], nu)
	mustJoin("a node sending with the new key joining (step 1: the agents accept it)", "step-1", nu, old[0])
	put(nu, old[0])
	mustJoin("a node knowing only the new key joining (step 2: the agents send with it)", "step-2", nu)
	put(nu)
	wait.For(t, 10*time.Second, "a node knowing only the old key refused (step 3)", func() error {
		if err := joins("old-only", old[0]); err == nil {
			return fmt.Errorf("joined")
		}
		return nil
	})
	mustJoin("a node knowing only the new key joining after step 3", "step-3", nu)
	waitGossipMembers(t, 20*time.Second, "the agents gossiping together after the rotation", agents...)

	put([]byte("not a key"))
	wait.For(t, 10*time.Second, "the value that is not keys refused", func() error {
		for _, a := range agents {
			if v, _ := metricValue(a, "kswitch_refused_values_total", map[string]string{"kind": "gossip_key"}); v < 1 {
				return fmt.Errorf("%s refused %v", a.ID(), v)
			}
		}
		return nil
	})
	mustJoin("a node knowing only the new key joining after the refused value", "after", nu)
}

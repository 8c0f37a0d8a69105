//go:build chaos

package chaos

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kswitch/kswitch/integration/netfault"
)

// Network faults. Each agent reaches etcd through a TCP proxy of its own
// and clusters A, B and C through a SOCKS5 server of its own (the
// clusters' proxy setting, so the brokers' advertised addresses go
// through it too), both run by the driver (agentNet, started by
// newAgent). A fault on the link between one agent and one peer leaves
// every other link alone; a restarted agent keeps its proxies, and so its
// links' faults.
const (
	NetCut       Kind = "net-cut"       // the link's connections closed, new ones refused; heal: restored
	NetBlackhole Kind = "net-blackhole" // the link's bytes dropped both ways, nothing closed; heal: restored
	NetSlow      Kind = "net-slow"      // 200 ms-1 s added each way (600 ms ± 400 ms a chunk, order kept); heal: restored
	NetThrottle  Kind = "net-throttle"  // 8 KiB/s each way per connection; heal: restored
)

// Fault sizes of net-slow and net-throttle.
const (
	netLatency   = 600 * time.Millisecond
	netJitter    = 400 * time.Millisecond
	netBandwidth = 8 << 10 // bytes a second
)

// netPeers are what an agent's links lead to.
var netPeers = []string{"etcd", "A", "B", "C"}

// netTargets are "<agents>/<peer>": each agent with each peer, and splits
// of several agents from one peer (agents joined by +), as a data-centre
// network split looks.
var netTargets = func() []string {
	var out []string
	for _, id := range agentIDs {
		for _, peer := range netPeers {
			out = append(out, id+"/"+peer)
		}
	}
	return append(out,
		"agent-1+agent-2/A", "agent-2+agent-3/B", "agent-1+agent-3/C", "agent-1+agent-2/etcd",
		"agent-1+agent-2+agent-3/A")
}()

// netKinds are the network faults. Two targets naming the same link (an
// agent alone and a split it is part of) may overlap: each link adds up
// the faults on it (agentNet.set), and a heal lifts only its own.
var netKinds = []kindSpec{
	{NetCut, netTargets, 2 * time.Second, 15 * time.Second, netFault(netfault.Fault{Cut: true})},
	{NetBlackhole, netTargets, 2 * time.Second, 15 * time.Second, netFault(netfault.Fault{Blackhole: true})},
	{NetSlow, netTargets, 5 * time.Second, 30 * time.Second, netFault(netfault.Fault{Latency: netLatency, Jitter: netJitter})},
	{NetThrottle, netTargets, 5 * time.Second, 30 * time.Second, netFault(netfault.Fault{Bandwidth: netBandwidth})},
}

// netFault puts f on the links a target names, or lifts it.
func netFault(f netfault.Fault) func(r *run, target string, heal bool) error {
	return func(r *run, target string, heal bool) error {
		ids, peer, err := parseNetTarget(target)
		if err != nil {
			return err
		}
		for _, id := range ids {
			a := r.agent(id)
			if a == nil {
				return fmt.Errorf("%s: no agent %s", target, id)
			}
			if err := a.net.set(peer, target, f, heal); err != nil {
				return fmt.Errorf("%s: %w", id, err)
			}
		}
		return nil
	}
}

// parseNetTarget splits "agent-1+agent-2/A".
func parseNetTarget(target string) (ids []string, peer string, err error) {
	agents, peer, ok := strings.Cut(target, "/")
	if !ok || !slices.Contains(netPeers, peer) {
		return nil, "", fmt.Errorf("%q is not a link target <agent>[+<agent>...]/<%s>", target, strings.Join(netPeers, "|"))
	}
	return strings.Split(agents, "+"), peer, nil
}

// agentNet is one agent's links: a TCP proxy to each etcd endpoint (link
// "etcd") and a SOCKS5 server whose destinations are the brokers of A, B
// and C (links "A", "B", "C"). The driver owns it; close ends it.
type agentNet struct {
	etcd  []*netfault.Proxy
	socks *netfault.SOCKS5
	links map[string]*netfault.Link

	mu     sync.Mutex
	faults map[string]map[string]netfault.Fault // peer → target → its fault
}

func startAgentNet(id string, in stackInfo) (_ *agentNet, err error) {
	n := &agentNet{links: map[string]*netfault.Link{}, faults: map[string]map[string]netfault.Fault{}}
	defer func() {
		if err != nil {
			n.close()
		}
	}()
	for _, peer := range netPeers {
		n.links[peer] = netfault.NewLink(id + "/" + peer)
	}
	for _, ep := range in.Etcd {
		p, err := netfault.ListenProxy("127.0.0.1:0", ep, n.links["etcd"])
		if err != nil {
			return nil, err
		}
		n.etcd = append(n.etcd, p)
	}
	dests := map[string]*netfault.Link{}
	for _, c := range []string{"A", "B", "C"} {
		if len(in.Clusters[c]) == 0 {
			return nil, fmt.Errorf("chaos: the stack names no broker of cluster %s", c)
		}
		for _, b := range in.Clusters[c] {
			dests[b] = n.links[c]
		}
	}
	if n.socks, err = netfault.ListenSOCKS5("127.0.0.1:0", dests); err != nil {
		return nil, err
	}
	return n, nil
}

// etcdEndpoints are the agent's etcd endpoints: its proxies.
func (n *agentNet) etcdEndpoints() []string {
	var out []string
	for _, p := range n.etcd {
		out = append(out, p.Addr())
	}
	return out
}

// proxyURL is the agent's clusters' proxy setting.
func (n *agentNet) proxyURL() string { return "socks5://" + n.socks.Addr() }

// set puts target's fault f on the link to peer, or lifts it, and gives
// the link the sum of the faults on it: cut or blackhole if any is, the
// largest latency and jitter, the smallest bandwidth.
func (n *agentNet) set(peer, target string, f netfault.Fault, heal bool) error {
	l := n.links[peer]
	if l == nil {
		return fmt.Errorf("no link to %q", peer)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	on := n.faults[peer]
	if on == nil {
		on = map[string]netfault.Fault{}
		n.faults[peer] = on
	}
	if heal {
		delete(on, target)
	} else {
		on[target] = f
	}
	var sum netfault.Fault
	for _, t := range slices.Sorted(maps.Keys(on)) {
		g := on[t]
		sum.Cut = sum.Cut || g.Cut
		sum.Blackhole = sum.Blackhole || g.Blackhole
		sum.Latency, sum.Jitter = max(sum.Latency, g.Latency), max(sum.Jitter, g.Jitter)
		if g.Bandwidth > 0 && (sum.Bandwidth == 0 || g.Bandwidth < sum.Bandwidth) {
			sum.Bandwidth = g.Bandwidth
		}
	}
	l.Set(sum)
	return nil
}

// close stops the proxies; the agent's connections through them close.
func (n *agentNet) close() {
	for _, p := range n.etcd {
		p.Close()
	}
	if n.socks != nil {
		n.socks.Close()
	}
}

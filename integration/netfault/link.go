// Package netfault puts network faults between processes: a TCP proxy
// (Proxy: a listen address to one upstream, for etcd) and a SOCKS5 server
// (SOCKS5: the upstream is each CONNECT's destination, for Kafka, whose
// clients connect to the addresses the brokers advertise) whose
// connections cross named Links. A Link's Fault is set at run time: cut,
// blackhole, latency with jitter, bandwidth; Heal lifts it.
//
// Where devstack.Link is a dialer inside the process under test, these
// sit between processes: a `kswitch agent` reaches etcd through its own
// Proxy and its Kafka clusters through its own SOCKS5 server (the
// cluster's `proxy` setting), so one agent can be cut from one cluster
// while every other agent keeps its links.
package netfault

import (
	"fmt"
	"strings"
	"sync"
	"time"
)

// Fault is what a Link does to the connections that cross it. The zero
// Fault is a healthy link. Cut and Blackhole take precedence over the
// others.
type Fault struct {
	// Cut closes every connection of the link, and new ones at once (a
	// SOCKS5 CONNECT is refused), like a firewall that rejects.
	Cut bool
	// Blackhole lets no byte through either way and closes nothing, like
	// a route that leads nowhere: a client sees its requests time out.
	// The bytes are held, not dropped: TCP retransmits what a network
	// loses, so once the route is back a connection that its ends kept
	// open carries every byte in order (dropping bytes inside a stream
	// would corrupt it, which no network does: an etcd client saw HTTP/2
	// PROTOCOL_ERROR on its connection after such a heal). A connection
	// opened meanwhile is accepted and connected upstream when the
	// blackhole is lifted.
	Blackhole bool
	// Latency delays the bytes of each direction by Latency plus a
	// uniform draw in [-Jitter, +Jitter] (never below 0), keeping their
	// order.
	Latency, Jitter time.Duration
	// Bandwidth caps each direction of each connection at this many
	// bytes a second; 0 is no cap.
	Bandwidth int64
}

func (f Fault) String() string {
	var s []string
	if f.Cut {
		s = append(s, "cut")
	}
	if f.Blackhole {
		s = append(s, "blackhole")
	}
	if f.Latency > 0 || f.Jitter > 0 {
		s = append(s, fmt.Sprintf("latency %v±%v", f.Latency, f.Jitter))
	}
	if f.Bandwidth > 0 {
		s = append(s, fmt.Sprintf("bandwidth %d B/s", f.Bandwidth))
	}
	if len(s) == 0 {
		return "healthy"
	}
	return strings.Join(s, ", ")
}

// delayed reports whether f delays or paces bytes.
func (f Fault) delayed() bool { return f.Latency > 0 || f.Jitter > 0 || f.Bandwidth > 0 }

// Link is a named path whose Fault applies to every connection crossing
// it, in any Proxy or SOCKS5 server. Its methods are safe for concurrent
// use.
type Link struct {
	name string

	mu      sync.Mutex
	fault   Fault
	changed chan struct{}      // closed and replaced by each Set
	pairs   map[*pair]struct{} // the connections open across the link
}

// NewLink returns a healthy link.
func NewLink(name string) *Link {
	return &Link{name: name, changed: make(chan struct{}), pairs: map[*pair]struct{}{}}
}

// Name returns the link's name.
func (l *Link) Name() string { return l.name }

// Set replaces the link's fault. A cut closes the link's connections
// before Set returns.
func (l *Link) Set(f Fault) {
	l.mu.Lock()
	l.fault = f
	close(l.changed)
	l.changed = make(chan struct{})
	var cut []*pair
	if f.Cut {
		for p := range l.pairs {
			cut = append(cut, p)
		}
		clear(l.pairs)
	}
	l.mu.Unlock()
	for _, p := range cut {
		p.close()
	}
}

// Heal lifts the link's fault.
func (l *Link) Heal() { l.Set(Fault{}) }

// Fault returns the link's fault.
func (l *Link) Fault() Fault {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.fault
}

// Conns returns how many connections are open across the link.
func (l *Link) Conns() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.pairs)
}

func (l *Link) String() string { return l.name + " (" + l.Fault().String() + ")" }

// state returns the fault and a channel closed when it next changes.
func (l *Link) state() (Fault, <-chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.fault, l.changed
}

// admit waits while the link is blackholed, and reports whether bytes or
// a new connection may pass (false: the link is cut, or done closed).
func (l *Link) admit(done <-chan struct{}) bool {
	for {
		f, changed := l.state()
		switch {
		case f.Cut:
			return false
		case !f.Blackhole:
			return true
		}
		select {
		case <-changed:
		case <-done:
			return false
		}
	}
}

// add registers p, unless the link was cut since admit.
func (l *Link) add(p *pair) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.fault.Cut {
		return false
	}
	l.pairs[p] = struct{}{}
	return true
}

func (l *Link) remove(p *pair) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.pairs, p)
}

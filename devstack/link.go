package devstack

import (
	"context"
	"errors"
	"net"
	"sync"
	"time"
)

// ErrLinkCut is the error of a Dial on a cut Link. Clients see it as a
// broker they cannot connect to.
var ErrLinkCut = errors.New("devstack: link cut")

// linkDialTimeout bounds a Dial: sarama applies no dial timeout of its own
// when it is given a dialer.
const linkDialTimeout = 3 * time.Second

// Link is a network link between one client and the servers it dials,
// which a test can cut and heal: it is an internal/kafka.Dialer (and a
// sarama Net.Proxy.Dialer), so one agent's connections to one Kafka
// cluster go through it while every other client keeps reaching the
// cluster. It models a broken route or a firewall between one host and a
// data centre, where Kafka.Fail models the data centre itself failing.
//
// Cut closes every connection made through the link and refuses new ones
// at once (ErrLinkCut) until Heal: clients see their requests fail with a
// closed connection and their reconnects refused, quickly, like a
// rejecting firewall. The zero value is not usable; use NewLink. All
// methods are safe for concurrent use.
type Link struct {
	d      net.Dialer
	mu     sync.Mutex
	conns  map[*linkConn]struct{}
	cut    bool
	ctx    context.Context    // cancelled by Cut, so that dials in flight fail too
	cancel context.CancelFunc // of ctx
	dials  int                // successful dials, for tests of tests
}

// NewLink returns a healed link.
func NewLink() *Link {
	ctx, cancel := context.WithCancel(context.Background())
	return &Link{d: net.Dialer{Timeout: linkDialTimeout}, conns: map[*linkConn]struct{}{}, ctx: ctx, cancel: cancel}
}

// Dial connects to addr unless the link is cut.
func (l *Link) Dial(network, addr string) (net.Conn, error) {
	l.mu.Lock()
	if l.cut {
		l.mu.Unlock()
		return nil, &net.OpError{Op: "dial", Net: network, Err: ErrLinkCut}
	}
	ctx := l.ctx
	l.mu.Unlock()
	c, err := l.d.DialContext(ctx, network, addr)
	if err != nil {
		if ctx.Err() != nil {
			return nil, &net.OpError{Op: "dial", Net: network, Err: ErrLinkCut}
		}
		return nil, err
	}
	lc := &linkConn{Conn: c, l: l}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.cut || l.ctx != ctx {
		// Cut while dialling (and maybe healed since): this connection
		// belongs to the cut link.
		c.Close()
		return nil, &net.OpError{Op: "dial", Net: network, Err: ErrLinkCut}
	}
	l.conns[lc] = struct{}{}
	l.dials++
	return lc, nil
}

// Cut closes every open connection of the link and makes Dial fail until
// Heal. Cutting a cut link does nothing.
func (l *Link) Cut() {
	l.mu.Lock()
	if l.cut {
		l.mu.Unlock()
		return
	}
	l.cut = true
	l.cancel()
	conns := l.conns
	l.conns = map[*linkConn]struct{}{}
	l.mu.Unlock()
	for c := range conns {
		c.Conn.Close()
	}
}

// Heal lets Dial connect again. Connections closed by Cut stay closed:
// clients reconnect by themselves.
func (l *Link) Heal() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.cut {
		return
	}
	l.cut = false
	l.ctx, l.cancel = context.WithCancel(context.Background())
}

// IsCut reports whether the link is cut.
func (l *Link) IsCut() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.cut
}

// Conns returns the number of connections open through the link.
func (l *Link) Conns() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.conns)
}

// Dials returns the number of connections the link has made.
func (l *Link) Dials() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.dials
}

// linkConn is a connection of a Link: it leaves the link's set when the
// client closes it.
type linkConn struct {
	net.Conn
	l *Link
}

func (c *linkConn) Close() error {
	c.l.mu.Lock()
	delete(c.l.conns, c)
	c.l.mu.Unlock()
	return c.Conn.Close()
}

package netfault

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"
)

// dialTimeout bounds a connection to an upstream.
const dialTimeout = 3 * time.Second

// errRefused is a connection the link's fault refuses.
var errRefused = errors.New("netfault: link cut")

// server accepts connections and joins each to an upstream across a link.
// It owns every goroutine it starts: close waits for them.
type server struct {
	ln net.Listener
	// connect makes a client's upstream connection (after a handshake,
	// for SOCKS5) and names the link it crosses. It returns with an error
	// when ctx ends.
	connect func(ctx context.Context, c net.Conn) (net.Conn, *Link, error)

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu sync.Mutex
	// clients are the connections accepted and not yet finished, each
	// with what closes it: the client connection, then its pair (both
	// connections) once joined. Closing the client alone does not end a
	// pair whose client side has half-closed: its other pipe reads the
	// upstream.
	clients map[net.Conn]func()
	closed  bool
}

func listen(addr string, connect func(context.Context, net.Conn) (net.Conn, *Link, error)) (*server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("netfault: listen %s: %w", addr, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &server{ln: ln, connect: connect, ctx: ctx, cancel: cancel, clients: map[net.Conn]func(){}}
	s.wg.Go(s.serve)
	return s, nil
}

func (s *server) addr() string { return s.ln.Addr().String() }

func (s *server) serve() {
	backoff := 5 * time.Millisecond
	for {
		c, err := s.ln.Accept()
		if err != nil {
			if s.ctx.Err() != nil {
				return
			}
			// Out of descriptors or the like: try again, as net/http does.
			select {
			case <-time.After(backoff):
			case <-s.ctx.Done():
				return
			}
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 5 * time.Millisecond
		if !s.track(c) {
			c.Close()
			return
		}
		s.wg.Go(func() {
			defer s.untrack(c)
			s.handle(c)
		})
	}
}

func (s *server) track(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.clients[c] = func() { c.Close() }
	return true
}

func (s *server) untrack(c net.Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.clients, c)
}

func (s *server) handle(c net.Conn) {
	up, l, err := s.connect(s.ctx, c)
	if err != nil {
		c.Close()
		return
	}
	p := newPair(l, c, up)
	s.mu.Lock()
	closed := s.closed
	s.clients[c] = p.close
	s.mu.Unlock()
	if closed {
		p.close()
		return
	}
	if !l.add(p) { // cut since connect
		p.close()
		return
	}
	defer l.remove(p)
	p.run()
}

// dial connects to an upstream within dialTimeout, or until ctx ends.
func dial(ctx context.Context, addr string) (net.Conn, error) {
	d := net.Dialer{Timeout: dialTimeout}
	return d.DialContext(ctx, "tcp", addr)
}

// close stops accepting, closes every connection and waits for every
// goroutine. Safe to call twice.
func (s *server) close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.cancel()
	err := s.ln.Close()
	for _, closeIt := range s.clients {
		closeIt()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return err
}

// Proxy is a TCP proxy from a listen address to one upstream across one
// Link: put its address where a client would name the upstream (an etcd
// endpoint).
type Proxy struct {
	s        *server
	upstream string
	link     *Link
}

// ListenProxy listens on addr ("127.0.0.1:0" for any port) and joins each
// connection to upstream across l. A connection accepted while l is cut
// is closed at once; while it is blackholed, it waits.
func ListenProxy(addr, upstream string, l *Link) (*Proxy, error) {
	p := &Proxy{upstream: upstream, link: l}
	s, err := listen(addr, func(ctx context.Context, _ net.Conn) (net.Conn, *Link, error) {
		if !l.admit(ctx.Done()) {
			return nil, nil, errRefused
		}
		up, err := dial(ctx, upstream)
		return up, l, err
	})
	if err != nil {
		return nil, err
	}
	p.s = s
	return p, nil
}

// Addr returns the address the proxy listens on.
func (p *Proxy) Addr() string { return p.s.addr() }

// Upstream returns the address the proxy connects to.
func (p *Proxy) Upstream() string { return p.upstream }

// Link returns the link the proxy's connections cross.
func (p *Proxy) Link() *Link { return p.link }

// Close stops the proxy: its connections close, and it returns when
// every goroutine of the proxy has ended. Safe to call twice.
func (p *Proxy) Close() error { return p.s.close() }

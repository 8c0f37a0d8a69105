package kafka

import (
	"net"
	"sync"

	"github.com/IBM/sarama"
)

// client is a sarama.Client whose Close ends the requests in flight.
// sarama's Close closes its brokers asynchronously, each once the request
// it has in flight ends: a request to a hung broker went on for the read
// timeout and its retries, and whoever waited for it (an agent stopping,
// kafkaConn.close waiting for the requests it gave up on) waited that
// long for a cluster it had given up on. Close closes the sockets under
// sarama first, which fails the request in flight at once.
type client struct {
	sarama.Client
	socks *sockets
}

func (c *client) Close() error {
	c.socks.closeAll()
	return c.Client.Close()
}

// sockets are the open sockets of one client: added as they are dialled,
// removed as sarama closes them.
type sockets struct {
	mu     sync.Mutex
	closed bool
	open   map[*socket]struct{}
}

func (s *sockets) closeAll() {
	s.mu.Lock()
	s.closed = true
	open := s.open
	s.open = nil
	s.mu.Unlock()
	for c := range open {
		_ = c.Conn.Close()
	}
}

// socketDialer dials through next and keeps the socket in socks.
type socketDialer struct {
	next  Dialer
	socks *sockets
}

func (d socketDialer) Dial(network, addr string) (net.Conn, error) {
	c, err := d.next.Dial(network, addr)
	if err != nil {
		return nil, err
	}
	s := &socket{Conn: c, socks: d.socks}
	d.socks.mu.Lock()
	defer d.socks.mu.Unlock()
	if d.socks.closed {
		_ = c.Close()
		return nil, net.ErrClosed
	}
	if d.socks.open == nil {
		d.socks.open = map[*socket]struct{}{}
	}
	d.socks.open[s] = struct{}{}
	return s, nil
}

// socket is a dialled connection that leaves its set when closed.
type socket struct {
	net.Conn
	socks *sockets
}

func (s *socket) Close() error {
	s.socks.mu.Lock()
	delete(s.socks.open, s)
	s.socks.mu.Unlock()
	return s.Conn.Close()
}

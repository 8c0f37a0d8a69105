package netfault

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"time"
)

// handshakeTimeout bounds a client's SOCKS5 greeting and request.
const handshakeTimeout = 5 * time.Second

// SOCKS5 replies (RFC 1928, section 6).
const (
	socksSucceeded          = 0x00
	socksGeneralFailure     = 0x01
	socksNotAllowed         = 0x02
	socksHostUnreachable    = 0x04
	socksConnRefused        = 0x05
	socksCommandUnsupported = 0x07
	socksAddrUnsupported    = 0x08
)

// SOCKS5 is a SOCKS5 server (RFC 1928: CONNECT, no authentication) whose
// connections cross the link of their destination: a Kafka client
// configured with it reaches the bootstrap brokers and then the addresses
// the brokers advertise through it, so all its connections to one cluster
// share that cluster's link.
type SOCKS5 struct {
	s     *server
	links map[string]*Link // by destination host:port

	mu       sync.Mutex
	connects map[string]int
}

// ListenSOCKS5 listens on addr ("127.0.0.1:0" for any port). links maps
// each destination ("127.0.0.1:9092", as the client names it: an IP
// address or a host name, and the port) to the link it crosses; a CONNECT
// to any other destination is refused (not allowed by ruleset), so that
// no connection escapes the faults unnoticed. A CONNECT across a cut link
// is refused (connection refused); across a blackholed one it waits.
func ListenSOCKS5(addr string, links map[string]*Link) (*SOCKS5, error) {
	x := &SOCKS5{links: maps.Clone(links), connects: map[string]int{}}
	s, err := listen(addr, x.connect)
	if err != nil {
		return nil, err
	}
	x.s = s
	return x, nil
}

// Addr returns the address the server listens on.
func (x *SOCKS5) Addr() string { return x.s.addr() }

// Connects returns how many CONNECT requests each destination received,
// refused ones included.
func (x *SOCKS5) Connects() map[string]int {
	x.mu.Lock()
	defer x.mu.Unlock()
	return maps.Clone(x.connects)
}

// Close stops the server: its connections close, and it returns when
// every goroutine of the server has ended. Safe to call twice.
func (x *SOCKS5) Close() error { return x.s.close() }

// connect runs the handshake of client c and connects it to its
// destination.
func (x *SOCKS5) connect(ctx context.Context, c net.Conn) (net.Conn, *Link, error) {
	_ = c.SetDeadline(time.Now().Add(handshakeTimeout))
	if err := greet(c); err != nil {
		return nil, nil, err
	}
	dest, status, err := readRequest(c)
	if err != nil {
		if status != 0 {
			_ = reply(c, status, nil)
		}
		return nil, nil, err
	}
	x.mu.Lock()
	x.connects[dest]++
	x.mu.Unlock()
	l := x.links[dest]
	if l == nil {
		_ = reply(c, socksNotAllowed, nil)
		return nil, nil, fmt.Errorf("netfault: socks5: no link for destination %s (links: %v)", dest, slices.Sorted(maps.Keys(x.links)))
	}
	_ = c.SetDeadline(time.Time{}) // a blackhole holds the client for as long as it lasts
	if !l.admit(ctx.Done()) {
		_ = reply(c, socksConnRefused, nil)
		return nil, nil, errRefused
	}
	up, err := dial(ctx, dest)
	if err != nil {
		status := byte(socksHostUnreachable)
		if errors.Is(err, syscall.ECONNREFUSED) {
			status = socksConnRefused
		}
		_ = reply(c, status, nil)
		return nil, nil, err
	}
	_ = c.SetWriteDeadline(time.Now().Add(handshakeTimeout))
	if err := reply(c, socksSucceeded, up.LocalAddr()); err != nil {
		up.Close()
		return nil, nil, err
	}
	_ = c.SetWriteDeadline(time.Time{})
	return up, l, nil
}

// greet reads the client's methods and chooses "no authentication".
func greet(c net.Conn) error {
	var h [2]byte
	if _, err := io.ReadFull(c, h[:]); err != nil {
		return err
	}
	if h[0] != 5 {
		return fmt.Errorf("netfault: socks5: version %d, want 5", h[0])
	}
	methods := make([]byte, h[1])
	if _, err := io.ReadFull(c, methods); err != nil {
		return err
	}
	if !slices.Contains(methods, 0) {
		_, _ = c.Write([]byte{5, 0xff})
		return fmt.Errorf("netfault: socks5: the client offers methods %v, not 0 (no authentication)", methods)
	}
	_, err := c.Write([]byte{5, 0})
	return err
}

// readRequest reads a CONNECT request and returns its destination
// host:port. On an error, status is the reply to send (0: none).
func readRequest(c net.Conn) (dest string, status byte, err error) {
	var h [4]byte // VER CMD RSV ATYP
	if _, err := io.ReadFull(c, h[:]); err != nil {
		return "", 0, err
	}
	if h[0] != 5 {
		return "", socksGeneralFailure, fmt.Errorf("netfault: socks5: request version %d, want 5", h[0])
	}
	var host string
	switch h[3] {
	case 1, 4: // IPv4, IPv6
		b := make([]byte, 4)
		if h[3] == 4 {
			b = make([]byte, 16)
		}
		if _, err := io.ReadFull(c, b); err != nil {
			return "", 0, err
		}
		ip, _ := netip.AddrFromSlice(b)
		host = ip.String()
	case 3: // a domain name
		var n [1]byte
		if _, err := io.ReadFull(c, n[:]); err != nil {
			return "", 0, err
		}
		b := make([]byte, n[0])
		if _, err := io.ReadFull(c, b); err != nil {
			return "", 0, err
		}
		host = string(b)
	default:
		return "", socksAddrUnsupported, fmt.Errorf("netfault: socks5: address type %d", h[3])
	}
	var port [2]byte
	if _, err := io.ReadFull(c, port[:]); err != nil {
		return "", 0, err
	}
	if h[1] != 1 {
		return "", socksCommandUnsupported, fmt.Errorf("netfault: socks5: command %d, only CONNECT (1) is served", h[1])
	}
	return net.JoinHostPort(host, strconv.Itoa(int(binary.BigEndian.Uint16(port[:])))), 0, nil
}

// reply sends a reply with status and the bound address (nil: 0.0.0.0:0).
func reply(c net.Conn, status byte, bound net.Addr) error {
	addr := netip.AddrPortFrom(netip.IPv4Unspecified(), 0)
	if t, ok := bound.(*net.TCPAddr); ok {
		addr = t.AddrPort()
	}
	b := []byte{5, status, 0}
	if ip := addr.Addr().Unmap(); ip.Is4() {
		b = append(append(b, 1), ip.AsSlice()...)
	} else {
		b = append(append(b, 4), ip.AsSlice()...)
	}
	b = binary.BigEndian.AppendUint16(b, addr.Port())
	_, err := c.Write(b)
	return err
}

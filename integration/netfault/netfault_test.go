package netfault_test

import (
	"bytes"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/net/proxy"

	"github.com/kswitch/kswitch/integration/netfault"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// silence is how long a test waits to see that bytes do not arrive: the
// check of an absence, not of a bound (the bytes would arrive in
// microseconds over loopback).
const silence = 300 * time.Millisecond

// echo starts a TCP server that writes back what it reads. It stops when
// the test ends.
func echo(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns []net.Conn
	)
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() {
				_, _ = io.Copy(c, c)
				c.Close()
			})
		}
	})
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String()
}

func proxyTo(t *testing.T, upstream string, l *netfault.Link) *netfault.Proxy {
	t.Helper()
	p, err := netfault.ListenProxy("127.0.0.1:0", upstream, l)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func dialTCP(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// roundTrip writes msg and reads it back within timeout.
func roundTrip(c net.Conn, msg string, timeout time.Duration) error {
	_ = c.SetDeadline(time.Now().Add(timeout))
	defer c.SetDeadline(time.Time{})
	if _, err := io.WriteString(c, msg); err != nil {
		return err
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return err
	}
	if string(got) != msg {
		return errors.New("read " + string(got) + ", want " + msg)
	}
	return nil
}

// nothingArrives checks that c reads nothing for silence.
func nothingArrives(t *testing.T, c net.Conn, what string) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(silence))
	defer c.SetReadDeadline(time.Time{})
	b := make([]byte, 64)
	n, err := c.Read(b)
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("%s: read %q, %v; want nothing (a timeout) for %v", what, b[:n], err, silence)
	}
}

// closedSoon checks that c is closed by the other side: a read ends with
// an error other than a timeout.
func closedSoon(t *testing.T, c net.Conn, what string) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	b := make([]byte, 64)
	n, err := c.Read(b)
	var ne net.Error
	if err == nil || (errors.As(err, &ne) && ne.Timeout()) {
		t.Fatalf("%s: read %q, %v; want the connection closed", what, b[:n], err)
	}
}

func TestProxyCutClosesAndRefuses(t *testing.T) {
	l := netfault.NewLink("etcd")
	p := proxyTo(t, echo(t), l)
	c := dialTCP(t, p.Addr())
	if err := roundTrip(c, "hello", 5*time.Second); err != nil {
		t.Fatal(err)
	}
	l.Set(netfault.Fault{Cut: true})
	closedSoon(t, c, "a connection open when the link was cut")
	if n := l.Conns(); n != 0 {
		t.Errorf("%d connections across the cut link, want 0", n)
	}
	closedSoon(t, dialTCP(t, p.Addr()), "a connection made while the link is cut")

	l.Heal()
	if err := roundTrip(dialTCP(t, p.Addr()), "again", 5*time.Second); err != nil {
		t.Fatalf("after Heal: %v", err)
	}
}

func TestProxyBlackholeHoldsAndKeeps(t *testing.T) {
	l := netfault.NewLink("etcd")
	p := proxyTo(t, echo(t), l)
	c := dialTCP(t, p.Addr())
	if err := roundTrip(c, "hello", 5*time.Second); err != nil {
		t.Fatal(err)
	}
	l.Set(netfault.Fault{Blackhole: true})
	if _, err := io.WriteString(c, "held"); err != nil {
		t.Fatal(err)
	}
	nothingArrives(t, c, "an open connection, blackholed")
	late := dialTCP(t, p.Addr())
	if _, err := io.WriteString(late, "waits"); err != nil {
		t.Fatal(err)
	}
	nothingArrives(t, late, "a connection made while blackholed")

	l.Heal()
	// The open connection was kept, and carries what was sent into the
	// blackhole, then what is sent now, in order: as TCP's
	// retransmissions would.
	if _, err := io.WriteString(c, "after"); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	got := make([]byte, len("heldafter"))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != "heldafter" {
		t.Fatalf("the open connection after Heal: read %q, %v; want heldafter", got, err)
	}
	// The connection made meanwhile reaches the upstream now, with the
	// bytes it had sent.
	_ = late.SetReadDeadline(time.Now().Add(5 * time.Second))
	got = make([]byte, len("waits"))
	if _, err := io.ReadFull(late, got); err != nil || string(got) != "waits" {
		t.Fatalf("the waiting connection after Heal: read %q, %v; want waits", got, err)
	}
}

func TestProxyLatencyDelaysEachDirection(t *testing.T) {
	l := netfault.NewLink("etcd")
	p := proxyTo(t, echo(t), l)
	c := dialTCP(t, p.Addr())
	const latency = 400 * time.Millisecond
	l.Set(netfault.Fault{Latency: latency})
	start := time.Now()
	if err := roundTrip(c, "slow", 10*time.Second); err != nil {
		t.Fatal(err)
	}
	// There and back: twice the latency at least.
	if took := time.Since(start); took < 2*latency {
		t.Fatalf("round trip took %v under latency %v each way, want >= %v", took, latency, 2*latency)
	}
	l.Set(netfault.Fault{Latency: latency, Jitter: latency / 2})
	start = time.Now()
	if err := roundTrip(c, "jitter", 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took < latency {
		t.Fatalf("round trip took %v under latency %v±%v each way, want >= %v", took, latency, latency/2, latency)
	}
	l.Heal()
	start = time.Now()
	if err := roundTrip(c, "fast", 10*time.Second); err != nil {
		t.Fatal(err)
	}
	// Still delayed, it would take 2 × latency at least.
	if took := time.Since(start); took >= 2*latency {
		t.Fatalf("after Heal the round trip took %v, as long as under the latency", took)
	}
}

func TestProxyBandwidthCaps(t *testing.T) {
	l := netfault.NewLink("etcd")
	p := proxyTo(t, echo(t), l)
	c := dialTCP(t, p.Addr())
	const rate = 40 << 10 // bytes a second
	l.Set(netfault.Fault{Bandwidth: rate})
	send := func(n int, timeout time.Duration) time.Duration {
		t.Helper()
		msg := bytes.Repeat([]byte("0123456789abcdef"), n/16)
		start := time.Now()
		_ = c.SetDeadline(start.Add(timeout))
		defer c.SetDeadline(time.Time{})
		var wg sync.WaitGroup
		wg.Go(func() { _, _ = c.Write(msg) })
		got := make([]byte, len(msg))
		_, err := io.ReadFull(c, got)
		wg.Wait()
		if err != nil || !bytes.Equal(got, msg) {
			t.Fatalf("%d bytes echoed: %v (equal: %v)", n, err, bytes.Equal(got, msg))
		}
		return time.Since(start)
	}
	// 40 KiB at 40 KiB/s: a second, less the first piece that goes at
	// once (50 ms of the cap).
	if took := send(rate, 30*time.Second); took < 900*time.Millisecond {
		t.Fatalf("%d bytes at %d B/s took %v, want >= 900ms", rate, rate, took)
	}
	l.Heal()
	// 10 × the cap: 10 s if it were still capped.
	if took := send(10*rate, 30*time.Second); took >= 10*time.Second {
		t.Fatalf("after Heal, %d bytes took %v, as long as under the cap", 10*rate, took)
	}
}

func socksDialer(t *testing.T, addr string) proxy.Dialer {
	t.Helper()
	d, err := proxy.SOCKS5("tcp", addr, nil, &net.Dialer{Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestSOCKS5RoutesByDestination(t *testing.T) {
	a, b := echo(t), echo(t)
	la, lb := netfault.NewLink("A"), netfault.NewLink("B")
	s, err := netfault.ListenSOCKS5("127.0.0.1:0", map[string]*netfault.Link{a: la, b: lb})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	d := socksDialer(t, s.Addr())
	dial := func(addr string) (net.Conn, error) {
		c, err := d.Dial("tcp", addr)
		if err == nil {
			t.Cleanup(func() { c.Close() })
		}
		return c, err
	}
	ca, err := dial(a)
	if err != nil {
		t.Fatal(err)
	}
	cb, err := dial(b)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []net.Conn{ca, cb} {
		if err := roundTrip(c, "hello", 5*time.Second); err != nil {
			t.Fatal(err)
		}
	}

	// A destination without a link is refused, so none escapes the faults.
	other := echo(t)
	if _, err := dial(other); err == nil || !strings.Contains(err.Error(), "not allowed") {
		t.Errorf("CONNECT to %s without a link: %v, want not allowed", other, err)
	}

	// Cutting A leaves B alone.
	la.Set(netfault.Fault{Cut: true})
	closedSoon(t, ca, "A's connection, A cut")
	if err := roundTrip(cb, "B stays", 5*time.Second); err != nil {
		t.Fatalf("B's connection, A cut: %v", err)
	}
	if _, err := dial(a); err == nil || !strings.Contains(err.Error(), "refused") {
		t.Errorf("CONNECT to A while cut: %v, want connection refused", err)
	}
	la.Heal()

	// A CONNECT across a blackholed link waits for its end.
	lb.Set(netfault.Fault{Blackhole: true})
	type result struct {
		c   net.Conn
		err error
	}
	res := make(chan result, 1)
	go func() { c, err := dial(b); res <- result{c, err} }()
	select {
	case r := <-res:
		t.Fatalf("CONNECT to B while blackholed returned %v, %v; want it to wait", r.c, r.err)
	case <-time.After(silence):
	}
	lb.Heal()
	r := <-res
	if r.err != nil {
		t.Fatalf("CONNECT to B after Heal: %v", r.err)
	}
	if err := roundTrip(r.c, "through", 5*time.Second); err != nil {
		t.Fatal(err)
	}

	want := map[string]int{a: 2, b: 2, other: 1}
	if got := s.Connects(); !mapsEqual(got, want) {
		t.Errorf("Connects() = %v, want %v", got, want)
	}
}

func mapsEqual(a, b map[string]int) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// TestCloseEndsEverything: Close returns once every goroutine has ended,
// with connections open, one waiting in a blackhole and bytes held by a
// latency (TestMain's goleak checks the goroutines).
func TestCloseEndsEverything(t *testing.T) {
	up := echo(t)
	slow, dark := netfault.NewLink("slow"), netfault.NewLink("dark")
	p, err := netfault.ListenProxy("127.0.0.1:0", up, slow)
	if err != nil {
		t.Fatal(err)
	}
	s, err := netfault.ListenSOCKS5("127.0.0.1:0", map[string]*netfault.Link{up: dark})
	if err != nil {
		t.Fatal(err)
	}
	c := dialTCP(t, p.Addr())
	if err := roundTrip(c, "hello", 5*time.Second); err != nil {
		t.Fatal(err)
	}
	slow.Set(netfault.Fault{Latency: time.Hour, Bandwidth: 1})
	if _, err := io.WriteString(c, "held for an hour"); err != nil {
		t.Fatal(err)
	}
	dark.Set(netfault.Fault{Blackhole: true})
	waiting := make(chan error, 1)
	go func() {
		_, err := socksDialer(t, s.Addr()).Dial("tcp", up)
		waiting <- err
	}()
	// The CONNECT is waiting in the blackhole once the server has read it.
	wait.For(t, 5*time.Second, "the CONNECT reaches the server", func() error {
		if s.Connects()[up] == 0 {
			return errors.New("no CONNECT yet")
		}
		return nil
	})
	done := make(chan struct{})
	go func() {
		p.Close()
		s.Close()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return within 10 s")
	}
	if err := <-waiting; err == nil {
		t.Error("the CONNECT waiting in the blackhole succeeded after Close")
	}
	closedSoon(t, c, "a proxied connection after Close")
	if err := p.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// TestCloseEndsAHalfClosedPair: a client that has half-closed its side
// (its request sent, CloseWrite) while the upstream keeps the connection
// open and sends nothing. Close must end the pair: closing the client's
// connection alone does not unblock the read from the upstream (a chaos
// run hung in Close on such a connection for 7 minutes).
func TestCloseEndsAHalfClosedPair(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			accepted <- c
		}
		close(accepted)
	}()
	t.Cleanup(func() {
		ln.Close()
		for c := range accepted {
			c.Close()
		}
	})
	p, err := netfault.ListenProxy("127.0.0.1:0", ln.Addr().String(), netfault.NewLink("quiet"))
	if err != nil {
		t.Fatal(err)
	}
	c := dialTCP(t, p.Addr())
	if _, err := io.WriteString(c, "request"); err != nil {
		t.Fatal(err)
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	// The upstream reads the request and its end, and stays silent.
	var up net.Conn
	select {
	case up = <-accepted:
	case <-time.After(5 * time.Second):
		t.Fatal("the proxy never connected upstream")
	}
	if b, err := io.ReadAll(up); err != nil || string(b) != "request" {
		t.Fatalf("upstream read %q, %v", b, err)
	}
	done := make(chan struct{})
	go func() {
		p.Close()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return within 10 s")
	}
}

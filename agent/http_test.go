package agent_test

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"testing"
	"time"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// keptConn is a client's keep-alive connection to an agent's HTTP
// listener.
type keptConn struct {
	c  net.Conn
	br *bufio.Reader
}

// dialKept opens a connection to addr and sends GET /healthz on it,
// keeping the connection open.
func dialKept(t *testing.T, addr string) *keptConn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: kswitch\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	return &keptConn{c: c, br: bufio.NewReader(c)}
}

// answer reads the answer to the request sent, waiting at most d.
func (k *keptConn) answer(d time.Duration) error {
	_ = k.c.SetReadDeadline(time.Now().Add(d))
	resp, err := http.ReadResponse(k.br, nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("/healthz answered %d", resp.StatusCode)
	}
	return nil
}

// closedByServer reports whether the server has closed the connection
// (it has answered the request, so nothing else is to be read).
func (k *keptConn) closedByServer() bool {
	_ = k.c.SetReadDeadline(time.Now().Add(5 * time.Millisecond))
	_, err := k.br.Peek(1)
	return err != nil && !errors.Is(err, os.ErrDeadlineExceeded)
}

// An idle keep-alive connection is closed after the idle timeout: clients
// that open connections and leave them cannot pile them up.
func TestHTTPClosesIdleKeepAliveConnections(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	const idle = time.Second
	a := startFleetAgent(t, testConfig(e, "agent-1"), agent.WithHooks(agent.Options{}, agent.Hooks{HTTPIdleTimeout: idle}))
	const n = 100
	conns := make([]*keptConn, n)
	for i := range conns {
		conns[i] = dialKept(t, a.HTTPAddr())
		if err := conns[i].answer(5 * time.Second); err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
	}
	opened := time.Now()
	// The server closes each one idle for 1 s; the rest of the bound is
	// for a loaded machine.
	wait.For(t, idle+15*time.Second, "the idle connections closed by the agent", func() error {
		open := 0
		for _, c := range conns {
			if !c.closedByServer() {
				open++
			}
		}
		if open > 0 {
			return fmt.Errorf("%d of %d still open after %s", open, n, time.Since(opened).Round(time.Millisecond))
		}
		return nil
	})
	t.Logf("%d idle connections closed within %s of their answer (idle timeout %s)", n, time.Since(opened).Round(time.Millisecond), idle)
	if err := dialKept(t, a.HTTPAddr()).answer(5 * time.Second); err != nil {
		t.Fatalf("a new connection after the idle ones closed: %v", err)
	}
}

// The open connections are capped: past the cap a connection waits for
// one to close, and /healthz answers it then.
func TestHTTPCapsOpenConnections(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	const limit = 8
	a := startFleetAgent(t, testConfig(e, "agent-1"), agent.WithHooks(agent.Options{}, agent.Hooks{HTTPMaxConns: limit, HTTPIdleTimeout: time.Minute}))
	held := make([]*keptConn, limit)
	for i := range held {
		held[i] = dialKept(t, a.HTTPAddr())
		if err := held[i].answer(5 * time.Second); err != nil {
			t.Fatalf("connection %d of %d: %v", i+1, limit, err)
		}
	}
	// The cap is reached: the requests of further connections wait in the
	// kernel's accept queue, unanswered.
	extra := make([]*keptConn, 3)
	for i := range extra {
		extra[i] = dialKept(t, a.HTTPAddr())
	}
	for i, c := range extra {
		if err := c.answer(300 * time.Millisecond); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("connection %d past the cap of %d: want no answer while %d are open, got %v", i+1, limit, limit, err)
		}
	}
	// Half the held connections close: the waiting ones are answered, and
	// a new client is served too.
	for _, c := range held[:limit/2] {
		c.c.Close()
	}
	for i, c := range extra {
		if err := c.answer(10 * time.Second); err != nil {
			t.Fatalf("connection %d past the cap, once others closed: %v", i+1, err)
		}
	}
	var body map[string]string
	if code, err := getJSON("http://"+a.HTTPAddr()+"/healthz", &body); err != nil || code != http.StatusOK {
		t.Fatalf("/healthz on a new connection once others closed: %d %v", code, err)
	}
}

// Go's profiles are served under /debug/pprof/ only when agent.pprof is
// set: off, the path is the status page's 404; on, a heap profile comes
// back in the profile format go tool pprof reads (gzip).
func TestPprofOnlyWhenAsked(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	off := startFleetAgent(t, testConfig(e, "agent-1"), agent.Options{})
	if code, _ := httpGet(t, off.HTTPAddr(), "/debug/pprof/heap"); code != http.StatusNotFound {
		t.Errorf("agent.pprof off: /debug/pprof/heap answered %d, want 404", code)
	}
	cfg := testConfig(e, "agent-2")
	cfg.Agent.Pprof = true
	on := startFleetAgent(t, cfg, agent.Options{})
	code, body := httpGet(t, on.HTTPAddr(), "/debug/pprof/heap")
	if code != http.StatusOK || len(body) < 2 || body[0] != 0x1f || body[1] != 0x8b {
		t.Errorf("agent.pprof on: /debug/pprof/heap answered %d with %d bytes, want 200 and a gzipped profile", code, len(body))
	}
	if code, _ := httpGet(t, on.HTTPAddr(), "/debug/pprof/"); code != http.StatusOK {
		t.Errorf("agent.pprof on: /debug/pprof/ answered %d, want 200", code)
	}
}

// httpGet GETs path of the agent serving HTTP at addr, and returns the
// status code and the body.
func httpGet(t *testing.T, addr, path string) (int, []byte) {
	t.Helper()
	resp, err := http.Get("http://" + addr + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, body
}

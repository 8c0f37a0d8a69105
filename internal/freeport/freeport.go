// Package freeport picks free loopback ports for the processes tests
// start: outside the kernel's ephemeral range when it can, so that a port
// chosen now is not taken by some outgoing connection before the process
// that needs it binds it.
package freeport

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strings"
	"sync"
	"syscall"
)

// Ports are chosen outside the kernel's ephemeral range when possible. A
// stopped service keeps its ports for Restart; a port from the ephemeral
// range could meanwhile become the local port of some outgoing connection
// (any client in any test process), and binding it would fail until that
// connection closed. Ports outside the range are only ever taken by
// listeners.
const (
	minStablePort = 10000 // stay clear of well-known service ports
	maxPort       = 65535
	portTries     = 200
)

// handed holds every port Ports returned in this process. A port is
// free when picked but bound only later, sometimes seconds later (a Kafka
// broker formats its storage and starts a JVM first); another caller in
// the same process (the etcd members a test starts meanwhile, another
// test) must not be given it in between. So a port is handed out once per
// process.
var handed struct {
	sync.Mutex
	ports map[int]bool
}

// Ports returns n distinct loopback ports that were free a moment ago and
// that no earlier call in this process returned. All n listeners are held
// open together so no port is returned twice; another process can still
// take a port between our close and the caller's bind, so callers retry
// on IsBindError.
func Ports(n int) ([]int, error) {
	handed.Lock()
	defer handed.Unlock()
	if handed.ports == nil {
		handed.ports = map[int]bool{}
	}
	var lns []net.Listener
	defer func() {
		for _, ln := range lns {
			ln.Close()
		}
	}()
	pick := stablePicker()
	ports := make([]int, 0, n)
	for len(ports) < n {
		ln, err := listenFree(pick)
		if err != nil {
			return nil, fmt.Errorf("freeport: pick a free port: %w", err)
		}
		lns = append(lns, ln) // held, so that the next pick differs
		if port := ln.Addr().(*net.TCPAddr).Port; !handed.ports[port] {
			ports = append(ports, port)
		}
		if len(lns) > n+portTries {
			return nil, fmt.Errorf("freeport: %d ports picked, %d of them not handed out before in this process; want %d", len(lns), len(ports), n)
		}
	}
	for _, p := range ports {
		handed.ports[p] = true
	}
	return ports, nil
}

// listenFree listens on a random port from pick, or on a kernel-chosen port
// when pick is nil or no tried port is free.
func listenFree(pick func() int) (net.Listener, error) {
	if pick != nil {
		for range portTries {
			if ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", fmt.Sprint(pick()))); err == nil {
				return ln, nil
			}
		}
	}
	return net.Listen("tcp", "127.0.0.1:0")
}

// stablePicker returns a function drawing random ports outside the
// ephemeral range, or nil if that range cannot be read or leaves too little.
func stablePicker() func() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return nil
	}
	var lo, hi int
	if _, err := fmt.Sscan(strings.TrimSpace(string(b)), &lo, &hi); err != nil || lo > hi {
		return nil
	}
	below := max(0, lo-minStablePort)                 // [minStablePort, lo)
	above := max(0, maxPort-max(hi, minStablePort-1)) // (hi, maxPort]
	if below+above < 1000 {
		return nil
	}
	return func() int {
		i := rand.IntN(below + above)
		if i < below {
			return minStablePort + i
		}
		return max(hi, minStablePort-1) + 1 + (i - below)
	}
}

// IsBindError reports whether err comes from binding a port that is taken.
// etcd does not always wrap the syscall error, hence the text match.
func IsBindError(err error) bool {
	return errors.Is(err, syscall.EADDRINUSE) || strings.Contains(err.Error(), "address already in use")
}

// Port returns one loopback port that was free a moment ago (see Ports).
func Port() (int, error) {
	ps, err := Ports(1)
	if err != nil {
		return 0, err
	}
	return ps[0], nil
}

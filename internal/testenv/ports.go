package testenv

import (
	"errors"
	"fmt"
	"net"
	"syscall"
)

// freePorts returns n distinct loopback ports that were free a moment ago.
// All n listeners are held open together so the kernel cannot hand out the
// same port twice; another process can still take a port between our close
// and the caller's bind, so callers retry on isAddrInUse.
func freePorts(n int) ([]int, error) {
	lns := make([]net.Listener, 0, n)
	defer func() {
		for _, ln := range lns {
			ln.Close()
		}
	}()
	ports := make([]int, 0, n)
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("testenv: pick free port: %w", err)
		}
		lns = append(lns, ln)
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// isAddrInUse reports whether err comes from binding a port that is taken.
func isAddrInUse(err error) bool {
	return errors.Is(err, syscall.EADDRINUSE)
}

func hostPort(port int) string {
	return net.JoinHostPort("127.0.0.1", fmt.Sprint(port))
}

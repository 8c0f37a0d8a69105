package devstack

import (
	"fmt"
	"net"
)

func hostPort(port int) string {
	return net.JoinHostPort("127.0.0.1", fmt.Sprint(port))
}

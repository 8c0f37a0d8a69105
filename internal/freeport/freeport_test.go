package freeport

import (
	"fmt"
	"os"
	"strings"
	"testing"
)

func TestPortsAvoidEphemeralRange(t *testing.T) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		t.Skipf("no ephemeral port range to check: %v", err)
	}
	var lo, hi int
	if _, err := fmt.Sscan(strings.TrimSpace(string(b)), &lo, &hi); err != nil {
		t.Fatal(err)
	}
	ports, err := Ports(20)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	for _, p := range ports {
		if seen[p] {
			t.Fatalf("port %d returned twice in %v", p, ports)
		}
		seen[p] = true
		if stablePicker() != nil && p >= lo && p <= hi {
			t.Fatalf("port %d is in the ephemeral range %d-%d", p, lo, hi)
		}
	}
}

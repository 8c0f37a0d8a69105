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

// A port is bound by its caller only later (a Kafka broker formats its
// storage and starts a JVM first); another caller in the process must not
// be given it meanwhile, though it is still free.
func TestAPortIsHandedOutOncePerProcess(t *testing.T) {
	seen := map[int]bool{}
	for range 2000 { // about 90 repeats among random picks without the record
		p, err := Port()
		if err != nil {
			t.Fatal(err)
		}
		if seen[p] {
			t.Fatalf("port %d handed out twice, though nobody bound it between", p)
		}
		seen[p] = true
	}
}

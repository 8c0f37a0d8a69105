package state_test

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/state"
)

func digestTestConfig() config.Config {
	cfg := config.Default()
	cfg.Fleet = "orders"
	cfg.Agent.ID = "agent-1"
	cfg.Etcd.Endpoints = []string{"127.0.0.1:2379"}
	cfg.Clusters = map[string]config.Cluster{
		"A": {Brokers: []string{"a1:9092", "a2:9092"}, Role: config.RolePrimary},
		"B": {Brokers: []string{"b1:9092"}, Role: config.RoleStandby},
		"C": {Brokers: []string{"c1:9092"}, Role: config.RoleSink},
	}
	cfg.Source.Topics = []string{"orders"}
	cfg.Source.Group = "orders"
	cfg.Routing = config.Routing{
		Default:  []string{"out"},
		Rules:    []config.RoutingRule{{Name: "big", Match: `len(value) > 100`, Channels: []string{"out"}}},
		Channels: map[string]config.RoutingChannel{"out": {Cluster: "C", Topic: "orders-out"}},
	}
	return cfg
}

func TestDigestConfigCoversTheFleetWideParts(t *testing.T) {
	base := state.DigestConfig(digestTestConfig())
	same := []struct {
		name   string
		change func(*config.Config)
	}{
		{"agent id and addresses", func(c *config.Config) { c.Agent.ID, c.Agent.HTTP, c.Agent.Gossip = "agent-9", "0.0.0.0:9", "0.0.0.0:7" }},
		{"etcd", func(c *config.Config) { c.Etcd.Endpoints, c.Etcd.Username = []string{"other:2379"}, "me" }},
		{"log", func(c *config.Config) { c.Log.Level = "debug" }},
		{"a cluster's TLS files, SASL, proxy and client id", func(c *config.Config) {
			a := c.Clusters["A"]
			a.TLS.CAFile, a.SASL.Username, a.SASL.Password, a.ClientID = "/etc/ca.pem", "u", "secret", "host-2"
			a.Proxy = "socks5://bastion-2:1080"
			c.Clusters["A"] = a
		}},
		{"the order of the brokers", func(c *config.Config) {
			a := c.Clusters["A"]
			a.Brokers = []string{"a2:9092", "a1:9092"}
			c.Clusters["A"] = a
		}},
		{"max_in_flight_mib", func(c *config.Config) { c.Source.MaxInFlightMiB = 256 }},
	}
	for _, tc := range same {
		cfg := digestTestConfig()
		tc.change(&cfg)
		if d := state.DigestConfig(cfg); d != base {
			t.Errorf("%s changed the digest: %+v, was %+v", tc.name, d, base)
		}
	}
	differ := []struct {
		name, part string
		change     func(*config.Config)
	}{
		{"a rule's match", "routing", func(c *config.Config) { c.Routing.Rules[0].Match = `len(value) > 10` }},
		{"a channel's topic", "routing", func(c *config.Config) {
			c.Routing.Channels["out"] = config.RoutingChannel{Cluster: "C", Topic: "elsewhere"}
		}},
		{"the topics", "source", func(c *config.Config) { c.Source.Topics = []string{"orders", "payments"} }},
		{"initial_offset", "source", func(c *config.Config) { c.Source.InitialOffset = "newest" }},
		{"a cluster's brokers", "clusters", func(c *config.Config) {
			b := c.Clusters["B"]
			b.Brokers = []string{"b9:9092"}
			c.Clusters["B"] = b
		}},
		{"the failure window", "failover", func(c *config.Config) { c.Failover.FailureWindow += time.Second }},
	}
	for _, tc := range differ {
		cfg := digestTestConfig()
		tc.change(&cfg)
		d := state.DigestConfig(cfg)
		reg := func(id string, d state.ConfigDigest) state.Registration {
			return state.Registration{ID: id, Version: "v1", Config: &d}
		}
		got := state.CompareConfigs([]state.Registration{reg("a", base), reg("b", base), reg("c", d)}, "a")
		if len(got) != 1 || got[0].Agent != "c" || !slices.Equal(got[0].Differs, []string{tc.part}) || got[0].Fleet != base.Digest {
			t.Errorf("%s: CompareConfigs = %+v, want c differing in %s only", tc.name, got, tc.part)
		}
	}
}

func TestCompareConfigs(t *testing.T) {
	x, y := state.DigestConfig(digestTestConfig()), state.DigestConfig(config.Default())
	reg := func(id, version string, d *state.ConfigDigest) state.Registration {
		return state.Registration{ID: id, Version: version, Config: d}
	}
	for _, tc := range []struct {
		name   string
		regs   []state.Registration
		leader string
		want   []string
	}{
		{"all agree", []state.Registration{reg("a", "v1", &x), reg("b", "v1", &x)}, "a", nil},
		{"the minority is flagged", []state.Registration{reg("a", "v1", &y), reg("b", "v1", &x), reg("c", "v1", &x)}, "a", []string{"a"}},
		{"a tie goes to the leader", []state.Registration{reg("a", "v1", &x), reg("b", "v1", &y)}, "b", []string{"a"}},
		{"a tie without the leader goes to the smaller digest", []state.Registration{reg("a", "v1", &x), reg("b", "v1", &y)}, "",
			[]string{map[bool]string{true: "b", false: "a"}[x.Digest < y.Digest]}},
		{"versions are not compared", []state.Registration{reg("a", "v1", &x), reg("b", "v2", &y)}, "a", nil},
		{"an older agent without a digest is skipped", []state.Registration{reg("a", "v1", &x), reg("b", "v0", nil), reg("c", "v1", &x)}, "b", nil},
	} {
		var got []string
		for _, d := range state.CompareConfigs(tc.regs, tc.leader) {
			got = append(got, d.Agent)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s: flagged %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestParseRegistrationDigest(t *testing.T) {
	old := `{"id":"agent-1","http":"h:1","gossip":"h:2","version":"v0","started":"2026-01-02T03:04:05Z"}`
	if r, err := state.ParseRegistration("agent-1", []byte(old)); err != nil || r.Config != nil {
		t.Fatalf("a registration without a digest (an older agent): %+v, %v", r, err)
	}
	good := `{"id":"agent-1","config":{"digest":"0123456789ab","routing":"0123456789ab","source":"0123456789ab","clusters":"0123456789ab","failover":"0123456789ab"}}`
	if r, err := state.ParseRegistration("agent-1", []byte(good)); err != nil || r.Config == nil || r.Config.Routing != "0123456789ab" {
		t.Fatalf("a registration with a digest: %+v, %v", r, err)
	}
	for _, bad := range []string{`"0123456789AB"`, `"0123"`, `"` + fmt.Sprint(make([]int, 200)) + `"`} {
		val := `{"id":"agent-1","config":{"digest":"0123456789ab","routing":` + bad + `,"source":"0123456789ab","clusters":"0123456789ab","failover":"0123456789ab"}}`
		if _, err := state.ParseRegistration("agent-1", []byte(val)); err == nil {
			t.Errorf("a routing digest %.20s… was accepted", bad)
		}
	}
}

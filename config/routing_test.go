package config

import (
	"reflect"
	"strings"
	"testing"
)

const routingFile = minimal + `
routing:
  mode: all
  default: [copy]
  dead_letter: dlq
  rules:
    - name: big
      match: '(json?.amount ?? 0) > 1000'
      channels: [audit, copy]
    - name: tests
      match: 'headers["test"] == "true"'
      drop: true
  channels:
    audit: {cluster: A, topic: orders-audit, partitioner: roundrobin, compression: lz4, acks: leader}
    copy: {cluster: A, topic: orders-copy, key: 'json?.customer'}
    dlq: {cluster: A, topic: orders-dlq}
`

func TestRoutingParses(t *testing.T) {
	c, err := Parse([]byte(routingFile), "r.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	want := Routing{
		Mode: "all", Default: []string{"copy"}, DeadLetter: "dlq",
		Rules: []RoutingRule{
			{Name: "big", Match: "(json?.amount ?? 0) > 1000", Channels: []string{"audit", "copy"}},
			{Name: "tests", Match: `headers["test"] == "true"`, Drop: true},
		},
		Channels: map[string]RoutingChannel{
			"audit": {Name: "audit", Cluster: "A", Topic: "orders-audit", Partitioner: "roundrobin", Compression: "lz4", Acks: "leader"},
			"copy":  {Name: "copy", Cluster: "A", Topic: "orders-copy", Key: "json?.customer"},
			"dlq":   {Name: "dlq", Cluster: "A", Topic: "orders-dlq"},
		},
	}
	if !reflect.DeepEqual(c.Routing, want) {
		t.Errorf("routing =\n%+v\nwant\n%+v", c.Routing, want)
	}
	if !c.Routing.Configured() || Default().Routing.Configured() {
		t.Error("Configured() wrong")
	}

	// Clone is deep.
	d := c.Clone()
	d.Routing.Rules[0].Channels[0] = "x"
	d.Routing.Default[0] = "x"
	d.Routing.Channels["new"] = RoutingChannel{}
	if c.Routing.Rules[0].Channels[0] == "x" || c.Routing.Default[0] == "x" || len(c.Routing.Channels) != 3 {
		t.Error("Clone shares routing slices or maps")
	}
}

func TestRoutingParseErrors(t *testing.T) {
	for _, tc := range []struct{ name, src, want string }{
		{"unknown rule field", "routing:\n  rules:\n    - {name: a, matches: x, drop: true}\n",
			`line 3: unknown field "matches" in routing.rules[0] (known: name, match, channels, drop)`},
		{"drop not a bool", "routing:\n  rules:\n    - {name: a, drop: yes}\n", `routing.rules[0].drop: "yes" is not true or false`},
		{"rules not a list", "routing:\n  rules: {name: a}\n", "routing.rules: expected a list, got a mapping"},
		{"null rule", "routing:\n  rules:\n    -\n", "routing.rules[0]: empty list item"},
		{"unknown channel field", "routing:\n  channels:\n    c: {cluster: A, topik: t}\n", `unknown field "topik" in routing.channels.c`},
		{"channel name field", "routing:\n  channels:\n    c: {name: c, cluster: A, topic: t}\n", `unknown field "name" in routing.channels.c`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.src), "f.yaml")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want %q", err, tc.want)
			}
		})
	}
}

func TestRoutingValidateErrors(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mutate func(r *Routing)
		want   string
	}{
		{"bad mode", func(r *Routing) { r.Mode = "any" }, `config: routing.mode: "any" is not one of first, all`},
		{"undefined channel in rule", func(r *Routing) { r.Rules[0].Channels[1] = "nope" },
			`config: routing.rules[0].channels[1]: channel "nope" is not defined`},
		{"undefined default", func(r *Routing) { r.Default = []string{"nope"} }, `config: routing.default[0]: channel "nope" is not defined`},
		{"undefined dead letter", func(r *Routing) { r.DeadLetter = "nope" }, `config: routing.dead_letter: channel "nope" is not defined`},
		{"unknown cluster", func(r *Routing) { setChannel(r, "audit", func(c *RoutingChannel) { c.Cluster = "Z" }) },
			`config: routing.channels.audit.cluster: "Z" is not a configured cluster (configured: A, B)`},
		{"no topic", func(r *Routing) { setChannel(r, "audit", func(c *RoutingChannel) { c.Topic = "" }) },
			`config: routing.channels.audit.topic: required`},
		{"bad topic", func(r *Routing) { setChannel(r, "audit", func(c *RoutingChannel) { c.Topic = "a/b" }) },
			`config: routing.channels.audit.topic: "a/b" is not a Kafka topic name`},
		{"bad partitioner", func(r *Routing) { setChannel(r, "audit", func(c *RoutingChannel) { c.Partitioner = "murmur" }) },
			`config: routing.channels.audit.partitioner: "murmur" is not one of hash, random, roundrobin, manual-same-partition`},
		{"bad compression", func(r *Routing) { setChannel(r, "audit", func(c *RoutingChannel) { c.Compression = "brotli" }) },
			`routing.channels.audit.compression: "brotli" is not one of none, gzip, snappy, lz4, zstd`},
		{"bad acks", func(r *Routing) { setChannel(r, "audit", func(c *RoutingChannel) { c.Acks = "1" }) },
			`routing.channels.audit.acks: "1" is not one of all, leader, none`},
		{"bad channel name", func(r *Routing) { r.Channels["a b"] = RoutingChannel{Cluster: "A", Topic: "t"} },
			`config: routing.channels.a b: channel name "a b" must not contain`},
		{"rule without name", func(r *Routing) { r.Rules[1].Name = "" }, "config: routing.rules[1].name: required"},
		{"duplicate rule", func(r *Routing) { r.Rules[1].Name = "big" }, `config: routing.rules[1].name: "big" is also the name of rules[0]`},
		{"drop and channels", func(r *Routing) { r.Rules[1].Channels = []string{"audit"} }, `config: routing.rules[1]: rule "tests" has both drop and channels`},
		{"neither drop nor channels", func(r *Routing) { r.Rules[0].Channels = nil }, `config: routing.rules[0]: rule "big" has no channels`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Parse([]byte(routingFile), "r.yaml")
			if err != nil {
				t.Fatal(err)
			}
			c.Clusters["B"] = Cluster{Brokers: []string{"127.0.0.1:9093"}, Role: RoleStandby}
			c.Routing = c.Routing.Clone()
			tc.mutate(&c.Routing)
			err = c.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error\n%v\nwant %q", err, tc.want)
			}
		})
	}
}

func setChannel(r *Routing, name string, f func(c *RoutingChannel)) {
	ch := r.Channels[name]
	f(&ch)
	r.Channels[name] = ch
}

func TestRoutingOverrides(t *testing.T) {
	c, err := Parse([]byte(routingFile), "r.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := (*Overrides)(nil).Apply(&c, []string{"KSWITCH_ROUTING_MODE=first", "KSWITCH_ROUTING_DEFAULT=audit, copy", "KSWITCH_ROUTING_DEAD_LETTER="}); err != nil {
		t.Fatal(err)
	}
	if c.Routing.Mode != "first" || !reflect.DeepEqual(c.Routing.Default, []string{"audit", "copy"}) || c.Routing.DeadLetter != "dlq" {
		t.Errorf("routing after env = %+v", c.Routing)
	}
	for _, env := range []string{"KSWITCH_ROUTING_RULES=x", "KSWITCH_ROUTING_CHANNELS_AUDIT_TOPIC=t"} {
		err := (*Overrides)(nil).Apply(&c, []string{env})
		if err == nil || !strings.Contains(err.Error(), "has no environment variable; set it in the configuration file, or in etcd") {
			t.Errorf("%s: error %v", env, err)
		}
	}
	err = (*Overrides)(nil).Apply(&c, []string{"KSWITCH_ROUTING_MODEL=x"})
	if err == nil || !strings.Contains(err.Error(), "unknown variable (known: KSWITCH_ROUTING_MODE, KSWITCH_ROUTING_DEFAULT, KSWITCH_ROUTING_DEAD_LETTER, KSWITCH_ROUTING_REFUSED)") {
		t.Errorf("typo: error %v", err)
	}
	if !reflect.DeepEqual(fileOnlyPaths, []string{"replication", "routing.rules", "routing.channels"}) {
		t.Errorf("fileOnlyPaths = %v", fileOnlyPaths)
	}
}

func TestParseRoutingAndChannel(t *testing.T) {
	r, err := ParseRouting([]byte("mode: all\nrules:\n  - {name: a, channels: [c]}\nchannels:\n  c: {cluster: A, topic: t}\n"), "routes")
	if err != nil {
		t.Fatal(err)
	}
	if r.Mode != "all" || len(r.Rules) != 1 || r.Channels["c"].Name != "c" {
		t.Errorf("ParseRouting = %+v", r)
	}
	if errs := r.Check(map[string]Cluster{"A": {}}); errs != nil {
		t.Errorf("Check: %v", errs)
	}
	if r, err := ParseRouting(nil, "empty"); err != nil || !reflect.DeepEqual(r, Routing{}) {
		t.Errorf("ParseRouting(empty) = %+v, %v", r, err)
	}
	if _, err := ParseRouting([]byte("rules: [{name: a, chanels: [c]}]"), "routes"); err == nil || !strings.Contains(err.Error(), `config: routes line 1: unknown field "chanels" in rules[0]`) {
		t.Errorf("ParseRouting typo: %v", err)
	}
	if _, err := ParseRouting([]byte("mode: all\n---\nmode: first\n"), "routes"); err == nil || !strings.Contains(err.Error(), "second YAML document") {
		t.Errorf("ParseRouting two documents: %v", err)
	}
	ch, err := ParseChannel([]byte("cluster: C\ntopic: t\nacks: none\n"), "channels/x")
	if err != nil || ch != (RoutingChannel{Cluster: "C", Topic: "t", Acks: "none"}) {
		t.Errorf("ParseChannel = %+v, %v", ch, err)
	}
	if errs := CheckChannel("x", ch, map[string]Cluster{"A": {}}); len(errs) != 1 || !strings.Contains(errs[0].Error(), `cluster: "C" is not a configured cluster (configured: A)`) {
		t.Errorf("CheckChannel = %v", errs)
	}
}

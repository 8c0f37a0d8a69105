package config

import (
	"errors"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
	"go.uber.org/goleak"
	"go.yaml.in/yaml/v3"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const examplePath = "../examples/kswitch.yaml"

// minimal is the smallest file that validates.
const minimal = `
fleet: orders
etcd:
  endpoints: [127.0.0.1:2379]
clusters:
  A: {brokers: [127.0.0.1:9092], role: primary}
source:
  topics: [orders]
  group: orders
`

// valid returns a configuration that passes Validate, for tests to break.
func valid(t *testing.T) Config {
	t.Helper()
	c, err := Parse([]byte(minimal), "valid.yaml")
	if err != nil {
		t.Fatal(err)
	}
	c.Clusters["B"] = Cluster{Brokers: []string{"127.0.0.1:9093"}, Role: RoleStandby}
	if err := c.Validate(); err != nil {
		t.Fatalf("valid config does not validate: %v", err)
	}
	return c
}

func TestExampleLoadsAndValidates(t *testing.T) {
	c, err := Load(examplePath)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if name, _ := c.Primary(); name != "A" {
		t.Errorf("primary = %q, want A", name)
	}
	if name, _, ok := c.Standby(); !ok || name != "B" {
		t.Errorf("standby = %q, %v, want B, true", name, ok)
	}
	if c.Agent.ID != "agent-1" {
		t.Errorf("agent.id = %q", c.Agent.ID)
	}
}

// TestExampleDocumentsEveryField keeps the example complete: each leaf must
// be set in it and its environment variable named in a comment.
func TestExampleDocumentsEveryField(t *testing.T) {
	data, err := os.ReadFile(examplePath)
	if err != nil {
		t.Fatal(err)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		t.Fatal(err)
	}
	has := func(path string) bool {
		n := doc.Content[0]
	next:
		for name := range strings.SplitSeq(path, ".") {
			for i := 0; i+1 < len(n.Content); i += 2 {
				if n.Content[i].Value == name {
					n = n.Content[i+1]
					continue next
				}
			}
			return false
		}
		return true
	}
	for _, l := range configLeaves {
		if !has(l.path) {
			t.Errorf("example does not set %s", l.path)
		}
		if !strings.Contains(string(data), l.env()) {
			t.Errorf("example does not mention %s", l.env())
		}
	}
	for _, l := range clusterLeaves {
		if !has("clusters.A." + l.path) {
			t.Errorf("example does not set clusters.A.%s", l.path)
		}
		if env := "KSWITCH_CLUSTERS_A_" + l.envField(); !strings.Contains(string(data), env) {
			t.Errorf("example does not mention %s", env)
		}
	}
}

func TestDefaultsAppliedWhenAbsent(t *testing.T) {
	c, err := Parse([]byte(minimal), "min.yaml")
	if err != nil {
		t.Fatal(err)
	}
	want := Default()
	want.Fleet = "orders"
	want.Etcd.Endpoints = []string{"127.0.0.1:2379"}
	want.Clusters["A"] = Cluster{Brokers: []string{"127.0.0.1:9092"}, Role: RolePrimary, Version: "3.6.0", ClientID: "kswitch", Delivery: AtLeastOnce, TransactionInterval: DefaultTransactionInterval}
	want.Source.Topics = []string{"orders"}
	want.Source.Group = "orders"
	if !reflect.DeepEqual(c, want) {
		t.Errorf("Parse(minimal) =\n%+v\nwant\n%+v", c, want)
	}

	d := Default()
	for _, tc := range []struct {
		name      string
		got, want any
	}{
		{"log.format", d.Log.Format, "json"},
		{"log.level", d.Log.Level, "info"},
		{"agent.id", d.Agent.ID, ""},
		{"agent.http", d.Agent.HTTP, "127.0.0.1:8080"},
		{"agent.gossip", d.Agent.Gossip, "127.0.0.1:7946"},
		{"agent.death_detection", d.Agent.DeathDetection, "gossip"},
		{"agent.memory_limit_mib", d.Agent.MemoryLimitMiB, 96},
		{"etcd.session_ttl", d.Etcd.SessionTTL, 5 * time.Second},
		{"etcd.dial_timeout", d.Etcd.DialTimeout, 3 * time.Second},
		{"etcd.request_timeout", d.Etcd.RequestTimeout, 2 * time.Second},
		{"source.initial_offset", d.Source.InitialOffset, "oldest"},
		{"source.refresh_interval", d.Source.RefreshInterval, time.Second},
		{"source.commit_interval", d.Source.CommitInterval, time.Second},
		{"source.commit_budget_kib", d.Source.CommitBudgetKiB, 512},
		{"failover.probe_interval", d.Failover.ProbeInterval, 500 * time.Millisecond},
		{"failover.failure_window", d.Failover.FailureWindow, 3 * time.Second},
		{"failover.probe_timeout", d.Failover.ProbeTimeout, time.Second},
		{"failover.timestamp_margin", d.Failover.TimestampMargin, 5 * time.Second},
		{"failover.failback", d.Failover.Failback, "auto"},
		{"failover.failback_stable", d.Failover.FailbackStable, 30 * time.Second},
		{"failover.max_failed_switches", d.Failover.MaxFailedSwitches, 3},
		{"failover.breaker_window", d.Failover.BreakerWindow, 5 * time.Minute},
		{"failover.breaker_cooldown", d.Failover.BreakerCooldown, 10 * time.Minute},
	} {
		if tc.got != tc.want {
			t.Errorf("Default() %s = %v, want %v", tc.name, tc.got, tc.want)
		}
	}

	// Empty files and explicit nulls mean "all defaults".
	for _, src := range []string{"", "# nothing\n", "log:\netcd: ~\n", "---\n", "---\nlog:\n---\n"} {
		c, err := Parse([]byte(src), "empty.yaml")
		if err != nil {
			t.Errorf("Parse(%q): %v", src, err)
			continue
		}
		if !reflect.DeepEqual(c, Default()) {
			t.Errorf("Parse(%q) = %+v, want Default()", src, c)
		}
	}
}

func TestValidateFillsAgentID(t *testing.T) {
	c := valid(t)
	c.Agent.ID = ""
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	host, _ := os.Hostname()
	if want := "-" + strconv.Itoa(os.Getpid()); !strings.HasSuffix(c.Agent.ID, want) || !strings.HasPrefix(c.Agent.ID, host) {
		t.Errorf("agent.id = %q, want <hostname>-<pid>", c.Agent.ID)
	}
}

func TestParseErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		src  string
		want []string // substrings of the error
	}{
		{
			name: "unknown cluster field",
			src: `fleet: orders
etcd:
  endpoints: [127.0.0.1:2379]
clusters:
  A:
    role: primary
    brokerz: [127.0.0.1:9092]
`,
			want: []string{`config: f.yaml line 7: unknown field "brokerz" in clusters.A (known: brokers, role, priority, version, client_id, tls, sasl, proxy, replication_policy, source_alias, offset_syncs_topic, offset_syncs_on, checkpoints_topic, delivery, transaction_interval)`},
		},
		{
			name: "unknown top-level field",
			src:  "fleet: x\nfailure_window: 3s\n",
			want: []string{`line 2: unknown field "failure_window" at the top level (known: fleet, log, agent, etcd, clusters, replication, source, failover, routing)`},
		},
		{
			name: "unknown nested field",
			src:  "etcd:\n  endpoints: [a:1]\n  ttl: 5s\n",
			want: []string{`line 3: unknown field "ttl" in etcd`, "session_ttl"},
		},
		{
			name: "every unknown field is reported",
			src:  "fleet: x\nflet: y\nsource:\n  topic: [a]\n",
			want: []string{`line 2: unknown field "flet"`, `line 4: unknown field "topic" in source`},
		},
		{
			name: "duration in words",
			src:  "etcd:\n  session_ttl: 5 seconds\n",
			want: []string{`line 2: etcd.session_ttl: "5 seconds" is not a duration; write a Go duration such as "5s"`},
		},
		{
			name: "bare number duration",
			src:  "failover:\n  probe_interval: 500\n",
			want: []string{`line 2: failover.probe_interval: "500" has no unit; write a Go duration such as "500ms"`},
		},
		{
			name: "scalar where a list is expected",
			src:  "clusters:\n  A:\n    brokers: 127.0.0.1:9092\n",
			want: []string{`line 3: clusters.A.brokers: expected a list, got the single value "127.0.0.1:9092"; write [127.0.0.1:9092]`},
		},
		{
			name: "mapping where a value is expected",
			src:  "fleet: {name: x}\n",
			want: []string{`line 1: fleet: expected a single value, got a mapping`},
		},
		{
			name: "list where a mapping is expected",
			src:  "clusters: [A, B]\n",
			want: []string{`line 1: clusters: expected a mapping`},
		},
		{
			name: "key set twice",
			src:  "fleet: a\nlog:\n  level: info\n  level: debug\n",
			want: []string{`line 4: log.level: set twice (first on line 3)`},
		},
		{
			name: "cluster defined twice",
			src:  "clusters:\n  A: {role: primary}\n  A: {role: standby}\n",
			want: []string{`line 3: clusters.A: set twice (first on line 2)`},
		},
		{
			name: "top level is not a mapping",
			src:  "- fleet\n",
			want: []string{`line 1: top level: expected a mapping`},
		},
		{
			name: "second document",
			src:  "fleet: a\n---\nfleet: b\n",
			want: []string{`f.yaml line 2: a second YAML document`},
		},
		{
			name: "syntax error",
			src:  "fleet: a\n  log: [\n",
			want: []string{`config: f.yaml: yaml: line`},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.src), "f.yaml")
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error\n%v\ndoes not contain\n%s", err, w)
				}
			}
		})
	}
}

func TestLoadMissingFile(t *testing.T) {
	_, err := Load(filepath.Join(t.TempDir(), "nope.yaml"))
	if !errors.Is(err, os.ErrNotExist) || !strings.HasPrefix(err.Error(), "config: ") {
		t.Errorf("Load(missing) = %v, want a wrapped not-exist error", err)
	}
}

func TestAnchorsAndMergeKeys(t *testing.T) {
	c, err := Parse([]byte(`
clusters:
  A: &kafka
    brokers: [a:9092]
    role: primary
    version: "3.9.0"
  B:
    <<: *kafka
    brokers: [b:9092]
    role: standby
`), "f.yaml")
	if err != nil {
		t.Fatal(err)
	}
	want := Cluster{Brokers: []string{"b:9092"}, Role: RoleStandby, Version: "3.9.0", ClientID: "kswitch", Delivery: AtLeastOnce, TransactionInterval: DefaultTransactionInterval}
	if got := c.Clusters["B"]; !reflect.DeepEqual(got, want) {
		t.Errorf("B = %+v, want %+v", got, want)
	}
}

func TestValidateErrors(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mutate func(c *Config)
		want   []string
	}{
		{"missing brokers", func(c *Config) {
			c.Clusters["A"] = Cluster{Role: RolePrimary}
		}, []string{"config: clusters.A.brokers: required: list at least one host:port"}},
		{"broker without port", func(c *Config) {
			c.Clusters["A"] = Cluster{Brokers: []string{"kafka1"}, Role: RolePrimary}
		}, []string{`clusters.A.brokers[0]: "kafka1" is not host:port`}},
		{"broker with named port", func(c *Config) {
			c.Clusters["A"] = Cluster{Brokers: []string{"kafka1:kafka"}, Role: RolePrimary}
		}, []string{`clusters.A.brokers[0]: "kafka1:kafka": port must be a number`}},
		{"identity on the primary", func(c *Config) {
			a := c.Clusters["A"]
			a.ReplicationPolicy = "identity"
			c.Clusters["A"] = a
		}, []string{`config: clusters.A.replication_policy: "identity" on the primary: its replication fields describe MirrorMaker 2's copies of the standby's topics on it`}},
		{"a flow back under the identity policy", func(c *Config) {
			a, b := c.Clusters["A"], c.Clusters["B"]
			a.OffsetSyncsOn, b.ReplicationPolicy = "target", "identity"
			c.Clusters["A"], c.Clusters["B"] = a, b
		}, []string{"config: clusters.A: replication fields on the primary describe a flow back from the standby, but clusters.B.replication_policy is identity, which is one way"}},
		{"duplicate primary", func(c *Config) {
			c.Clusters["B"] = Cluster{Brokers: []string{"b:1"}, Role: RolePrimary}
		}, []string{`config: clusters.B.role: "primary" is also the role of cluster A; exactly one cluster may be primary (set the other to standby or sink)`}},
		{"a second standby without its order or flows", func(c *Config) {
			c.Clusters["C"] = Cluster{Brokers: []string{"c:1"}, Role: RoleStandby}
		}, []string{"clusters.B.priority: required with more than one standby (B, C)", "clusters.C.priority: required with more than one standby (B, C)",
			"config: replication: required with more than one standby (B, C): list MirrorMaker 2's flows"}},
		{"no primary", func(c *Config) {
			c.Clusters["A"] = Cluster{Brokers: []string{"a:1"}, Role: RoleSink}
		}, []string{"clusters: no cluster has role primary"}},
		{"bad role", func(c *Config) {
			c.Clusters["S"] = Cluster{Brokers: []string{"s:1"}, Role: "backup"}
		}, []string{`clusters.S.role: "backup" is not a role; use primary, standby or sink`}},
		{"no clusters", func(c *Config) { c.Clusters = nil }, []string{"clusters: required"}},
		{"bad cluster name", func(c *Config) {
			c.Clusters["dc 2"] = Cluster{Brokers: []string{"s:1"}, Role: RoleSink}
		}, []string{`clusters.dc 2: cluster name "dc 2" may contain only`}},
		{"cluster names differing in case", func(c *Config) {
			c.Clusters["a"] = Cluster{Brokers: []string{"s:1"}, Role: RoleSink}
		}, []string{"clusters.a: name differs from cluster A only in case"}},
		{"bad kafka version", func(c *Config) {
			c.Clusters["A"] = Cluster{Brokers: []string{"a:1"}, Role: RolePrimary, Version: "3.9"}
		}, []string{`clusters.A.version: "3.9" is not a Kafka version`}},
		{"no topics or regex", func(c *Config) { c.Source.Topics = nil }, []string{"source.topics: required: list the topics to consume, or set source.topic_regex"}},
		{"bad topic", func(c *Config) { c.Source.Topics = []string{"orders", "a/b"} }, []string{`source.topics[1]: "a/b" is not a Kafka topic name`}},
		{"bad regex", func(c *Config) {
			c.Source.Topics = nil
			c.Source.TopicRegex = "orders.(["
		}, []string{`source.topic_regex: "orders.([" does not compile`}},
		{"no group", func(c *Config) { c.Source.Group = "" }, []string{"source.group: required"}},
		{"bad initial offset", func(c *Config) { c.Source.InitialOffset = "earliest" }, []string{`source.initial_offset: "earliest" is not one of oldest, newest`}},
		{"zero commit interval", func(c *Config) { c.Source.CommitInterval = 0 }, []string{`source.commit_interval: "0s" must be positive`}},
		{"negative commit budget", func(c *Config) { c.Source.CommitBudgetKiB = -1 }, []string{`source.commit_budget_kib: -1 must be between 0 (no bound) and 1048576`}},
		{"session_ttl too small", func(c *Config) { c.Etcd.SessionTTL = time.Second }, []string{`config: etcd.session_ttl: "1s" is below etcd's minimum lease TTL of 2s`}},
		{"session_ttl not whole seconds", func(c *Config) { c.Etcd.SessionTTL = 2500 * time.Millisecond }, []string{`etcd.session_ttl: "2.5s" is not a whole number of seconds`}},
		{"request_timeout not below session_ttl", func(c *Config) { c.Etcd.RequestTimeout = 5 * time.Second }, []string{`etcd.request_timeout: "5s" must be shorter than etcd.session_ttl (5s)`}},
		{"no endpoints", func(c *Config) { c.Etcd.Endpoints = nil }, []string{"etcd.endpoints: required"}},
		{"bad endpoint scheme", func(c *Config) { c.Etcd.Endpoints = []string{"unix://x:1"} }, []string{`etcd.endpoints[0]: "unix://x:1": the scheme must be http or https`}},
		{"endpoint with path", func(c *Config) { c.Etcd.Endpoints = []string{"http://x:1/v3"} }, []string{`etcd.endpoints[0]: "http://x:1/v3": write host:port`}},
		{"fleet with slash", func(c *Config) { c.Fleet = "orders/eu" }, []string{`config: fleet: "orders/eu" must not contain '/' or whitespace`}},
		{"no fleet", func(c *Config) { c.Fleet = "" }, []string{"fleet: required"}},
		{"agent id with space", func(c *Config) { c.Agent.ID = "agent 1" }, []string{`agent.id: "agent 1" must not contain`}},
		{"bad http address", func(c *Config) { c.Agent.HTTP = "8080" }, []string{`agent.http: "8080" is not host:port`}},
		{"advertise port 0", func(c *Config) { c.Agent.GossipAdvertise = "10.0.0.1:0" }, []string{`agent.gossip_advertise: "10.0.0.1:0": port must be a number from 1`}},
		{"bad death detection", func(c *Config) { c.Agent.DeathDetection = "memberlist" }, []string{`agent.death_detection: "memberlist" is not one of gossip, lease`}},
		{"memory limit without room for the records in flight", func(c *Config) { c.Agent.MemoryLimitMiB = 64 }, []string{`agent.memory_limit_mib: 64 leaves no room: the limit must be 0 (none) or between source.max_in_flight_mib + 64 = 96 and 1048576 MiB`}},
		{"memory limit raised with the records in flight", func(c *Config) { c.Source.MaxInFlightMiB = 256; c.Agent.MemoryLimitMiB = 128 }, []string{`source.max_in_flight_mib + 64 = 320`}},
		{"bad log level", func(c *Config) { c.Log.Level = "verbose" }, []string{`log.level: "verbose" is not one of debug, info, warn, error`}},
		{"bad log format", func(c *Config) { c.Log.Format = "text" }, []string{`log.format: "text"`}},
		{"failure window not above probe interval", func(c *Config) { c.Failover.FailureWindow = 500 * time.Millisecond }, []string{"failover.failure_window: 500ms must be longer than failover.probe_interval (500ms)"}},
		{"hard failure window above the failure window", func(c *Config) { c.Failover.HardFailureWindow = 4 * time.Second },
			[]string{"failover.hard_failure_window: 4s must be between 0 (hard failures wait for failover.failure_window too) and failover.failure_window (3s)"}},
		{"bad replication policy", func(c *Config) { editCluster(c, "B", func(b *Cluster) { b.ReplicationPolicy = "default" }) },
			[]string{`config: clusters.B.replication_policy: "default" is not a replication policy; use prefix`}},
		{"bad offset_syncs_on", func(c *Config) { editCluster(c, "B", func(b *Cluster) { b.OffsetSyncsOn = "standby" }) },
			[]string{`config: clusters.B.offset_syncs_on: "standby" is not one of source, target`}},
		{"bad source alias", func(c *Config) { editCluster(c, "B", func(b *Cluster) { b.SourceAlias = "dc 1" }) },
			[]string{`config: clusters.B.source_alias: "dc 1" is not usable in Kafka topic names`}},
		{"bad offset-syncs topic", func(c *Config) { editCluster(c, "B", func(b *Cluster) { b.OffsetSyncsTopic = "mm2/syncs" }) },
			[]string{`config: clusters.B.offset_syncs_topic: "mm2/syncs" is not a Kafka topic name`, "leave it empty for the default mm2-offset-syncs.<name>.internal"}},
		{"too long checkpoints topic", func(c *Config) {
			editCluster(c, "B", func(b *Cluster) { b.CheckpointsTopic = strings.Repeat("c", 250) })
		},
			[]string{`config: clusters.B.checkpoints_topic: "ccc`, "is not a Kafka topic name"}},
		{"checkpoints topic dot", func(c *Config) { editCluster(c, "B", func(b *Cluster) { b.CheckpointsTopic = ".." }) },
			[]string{`clusters.B.checkpoints_topic: ".." is not a Kafka topic name`}},
		{"bad replication field on the primary", func(c *Config) {
			a := c.Clusters["A"]
			a.ReplicationPolicy = "mirror"
			c.Clusters["A"] = a
		}, []string{`clusters.A.replication_policy: "mirror" is not a replication policy`}},
		{"bad failback", func(c *Config) { c.Failover.Failback = "automatic" }, []string{`config: failover.failback: "automatic" is not one of auto, manual`}},
		{"zero probe timeout", func(c *Config) { c.Failover.ProbeTimeout = 0 }, []string{`config: failover.probe_timeout: "0s" must be positive`}},
		{"probe timeout beyond failure window", func(c *Config) { c.Failover.ProbeTimeout = 4 * time.Second },
			[]string{`config: failover.probe_timeout: "4s" must not exceed failover.failure_window (3s): a probe that cannot time out inside the window cannot decide it`}},
		{"negative timestamp margin", func(c *Config) { c.Failover.TimestampMargin = -time.Second },
			[]string{`config: failover.timestamp_margin: "-1s" must not be negative`}},
		{"zero failback_stable", func(c *Config) { c.Failover.FailbackStable = 0 }, []string{`config: failover.failback_stable: "0s" must be positive`}},
		{"zero max_failed_switches", func(c *Config) { c.Failover.MaxFailedSwitches = 0 },
			[]string{`config: failover.max_failed_switches: 0 must be at least 1`}},
		{"negative max_failed_switches", func(c *Config) { c.Failover.MaxFailedSwitches = -2 },
			[]string{`config: failover.max_failed_switches: -2 must be at least 1`}},
		{"zero breaker window", func(c *Config) { c.Failover.BreakerWindow = 0 }, []string{`config: failover.breaker_window: "0s" must be positive`}},
		{"negative breaker cooldown", func(c *Config) { c.Failover.BreakerCooldown = -time.Minute },
			[]string{`config: failover.breaker_cooldown: "-1m0s" must be positive`}},
		{"every problem reported", func(c *Config) {
			c.Fleet = ""
			c.Source.Group = ""
			c.Etcd.SessionTTL = time.Second
		}, []string{"fleet: required", "source.group: required", "etcd.session_ttl"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := valid(t)
			tc.mutate(&c)
			err := c.Validate()
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error\n%v\ndoes not contain\n%s", err, w)
				}
			}
			for line := range strings.SplitSeq(err.Error(), "\n") {
				if !strings.HasPrefix(line, "config: ") {
					t.Errorf("error line %q lacks the config: prefix", line)
				}
			}
		})
	}
}

func TestValidateAccepts(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mutate func(c *Config)
	}{
		{"regex only", func(c *Config) { c.Source.Topics, c.Source.TopicRegex = nil, `^orders\.` }},
		{"no standby", func(c *Config) { delete(c.Clusters, "B") }},
		{"sinks", func(c *Config) {
			c.Clusters["S1"] = Cluster{Brokers: []string{"s:1"}, Role: RoleSink}
			c.Clusters["S2"] = Cluster{Brokers: []string{"s:2"}, Role: RoleSink}
		}},
		{"https endpoint", func(c *Config) {
			c.Etcd.Endpoints = []string{"https://etcd-0:2379", "http://[::1]:2379/", "etcd-1:2379"}
		}},
		{"port 0 listeners", func(c *Config) { c.Agent.HTTP, c.Agent.Gossip = "127.0.0.1:0", ":0" }},
		{"old kafka version", func(c *Config) {
			c.Clusters["A"] = Cluster{Brokers: []string{"a:1"}, Role: RolePrimary, Version: "0.10.2.0"}
		}},
		{"cluster without version", func(c *Config) { c.Clusters["A"] = Cluster{Brokers: []string{"a:1"}, Role: RolePrimary} }},
		{"replication fields on the standby", func(c *Config) {
			editCluster(c, "B", func(b *Cluster) {
				b.ReplicationPolicy, b.SourceAlias, b.OffsetSyncsOn = "identity", "dc-east.1", "target"
				b.OffsetSyncsTopic, b.CheckpointsTopic = "mm2-offset-syncs.dr.internal", "dc-east.1.checkpoints.internal"
			})
		}},
		{"replication fields explicitly default", func(c *Config) {
			editCluster(c, "B", func(b *Cluster) { b.ReplicationPolicy, b.OffsetSyncsOn = "prefix", "source" })
		}},
		// The primary's fields describe the flow back from the standby;
		// Validate cannot warn, so those of a sink are accepted (and
		// ignored).
		{"replication fields on the primary and a sink", func(c *Config) {
			a := c.Clusters["A"]
			a.ReplicationPolicy, a.SourceAlias, a.OffsetSyncsOn = "prefix", "X", "target"
			c.Clusters["A"] = a
			c.Clusters["S"] = Cluster{Brokers: []string{"s:1"}, Role: RoleSink, ReplicationPolicy: "identity", CheckpointsTopic: "X.checkpoints.internal"}
		}},
		{"no standby with replication fields nowhere", func(c *Config) { delete(c.Clusters, "B") }},
		{"manual failback", func(c *Config) { c.Failover.Failback = "manual" }},
		{"zero timestamp margin", func(c *Config) { c.Failover.TimestampMargin = 0 }},
		{"probe timeout equal to failure window", func(c *Config) { c.Failover.ProbeTimeout = c.Failover.FailureWindow }},
		{"one failed switch trips the breaker", func(c *Config) { c.Failover.MaxFailedSwitches = 1 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := valid(t)
			tc.mutate(&c)
			if err := c.Validate(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestPrecedence checks flag > env > file > default for a scalar
// (etcd.session_ttl), a list (source.topics) and a cluster field
// (clusters.B.brokers).
func TestPrecedence(t *testing.T) {
	const file = `
etcd:
  endpoints: [127.0.0.1:2379]
  session_ttl: 6s
clusters:
  A: {brokers: [127.0.0.1:9092], role: primary}
  B: {brokers: [file:9093], role: standby}
source:
  topics: [file-topic]
  group: orders
fleet: orders
`
	env := []string{
		"KSWITCH_ETCD_SESSION_TTL=7s",
		"KSWITCH_SOURCE_TOPICS=env-a, env-b",
		"KSWITCH_CLUSTERS_B_BROKERS=env:9093",
	}
	args := []string{
		"--etcd.session_ttl=8s",
		"--source.topics", "flag-a,flag-b",
		"--cluster", "B.brokers=flag:9093",
	}
	for _, tc := range []struct {
		name       string
		src        string
		env, args  []string
		wantTTL    time.Duration
		wantTopics []string
		wantB      []string
	}{
		{"default", minimal, nil, nil, 5 * time.Second, []string{"orders"}, nil},
		{"file", file, nil, nil, 6 * time.Second, []string{"file-topic"}, []string{"file:9093"}},
		{"env over file", file, env, nil, 7 * time.Second, []string{"env-a", "env-b"}, []string{"env:9093"}},
		{"flag over env", file, env, args, 8 * time.Second, []string{"flag-a", "flag-b"}, []string{"flag:9093"}},
		{"flag over file", file, nil, args, 8 * time.Second, []string{"flag-a", "flag-b"}, []string{"flag:9093"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Parse([]byte(tc.src), "f.yaml")
			if err != nil {
				t.Fatal(err)
			}
			fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
			o := BindFlags(fs)
			if err := fs.Parse(tc.args); err != nil {
				t.Fatal(err)
			}
			if err := o.Apply(&c, tc.env); err != nil {
				t.Fatal(err)
			}
			if c.Etcd.SessionTTL != tc.wantTTL {
				t.Errorf("etcd.session_ttl = %v, want %v", c.Etcd.SessionTTL, tc.wantTTL)
			}
			if !slices.Equal(c.Source.Topics, tc.wantTopics) {
				t.Errorf("source.topics = %q, want %q", c.Source.Topics, tc.wantTopics)
			}
			if got := c.Clusters["B"].Brokers; !slices.Equal(got, tc.wantB) {
				t.Errorf("clusters.B.brokers = %q, want %q", got, tc.wantB)
			}
			// Fields not overridden keep their file values.
			if c.Fleet != "orders" || c.Source.Group != "orders" {
				t.Errorf("untouched fields changed: fleet %q group %q", c.Fleet, c.Source.Group)
			}
		})
	}
}

func TestEnvOverrides(t *testing.T) {
	c, err := Parse([]byte(`
fleet: orders
etcd: {endpoints: [127.0.0.1:2379]}
source: {topics: [orders], group: orders, topic_regex: x}
clusters:
  A: {brokers: [a:1], role: primary}
  dc_east: {brokers: [e:1], role: standby}
`), "f.yaml")
	if err != nil {
		t.Fatal(err)
	}
	err = (*Overrides)(nil).Apply(&c, []string{
		"KSWITCH_FLEET=payments",
		"KSWITCH_AGENT_GOSSIP_ADVERTISE=10.0.0.1:7946",
		"KSWITCH_SOURCE_TOPIC_REGEX=", // empty: ignored
		"KSWITCH_CLUSTERS_a_ROLE=sink",
		"KSWITCH_CLUSTERS_DC_EAST_CLIENT_ID=east",
		"KSWITCH_CLUSTERS_NEW_BROKERS=n1:1,n2:2",
		"KSWITCH_CLUSTERS_NEW_ROLE=primary",
		"KSWITCH_CONFIG=/etc/kswitch.yaml", // not a config section: left alone
		"OTHER=1",
	})
	if err != nil {
		t.Fatal(err)
	}
	if c.Fleet != "payments" || c.Agent.GossipAdvertise != "10.0.0.1:7946" || c.Source.TopicRegex != "x" {
		t.Errorf("scalars: fleet %q advertise %q regex %q", c.Fleet, c.Agent.GossipAdvertise, c.Source.TopicRegex)
	}
	if c.Clusters["A"].Role != RoleSink {
		t.Errorf("clusters.A.role = %q, want sink (matched case-insensitively)", c.Clusters["A"].Role)
	}
	if got := c.Clusters["dc_east"]; got.ClientID != "east" || got.Role != RoleStandby {
		t.Errorf("clusters.dc_east = %+v", got)
	}
	want := Cluster{Brokers: []string{"n1:1", "n2:2"}, Role: RolePrimary, Version: DefaultKafkaVersion, ClientID: DefaultClientID, Delivery: AtLeastOnce, TransactionInterval: DefaultTransactionInterval}
	if got := c.Clusters["NEW"]; !reflect.DeepEqual(got, want) {
		t.Errorf("clusters.NEW = %+v, want %+v", got, want)
	}
	if got := slices.Sorted(maps.Keys(c.Clusters)); !slices.Equal(got, []string{"A", "NEW", "dc_east"}) {
		t.Errorf("clusters = %q, want A NEW dc_east", got)
	}
	if err := c.Validate(); err != nil {
		t.Error(err)
	}
}

func TestFlagOverrides(t *testing.T) {
	c := Default()
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	o := BindFlags(fs)
	err := fs.Parse([]string{
		"--fleet=orders",
		"--etcd.endpoints=e1:2379", "--etcd.endpoints=e2:2379", // repeated list flags append
		"--cluster", "dc.1.brokers=a:1",
		"--cluster", "dc.1.brokers=b:1",
		"--cluster", "dc.1.role=primary",
		"--source.topics=t",
		"--source.group=g",
		"--agent.gossip_advertise=",
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Apply(&c, nil); err != nil {
		t.Fatal(err)
	}
	if want := []string{"e1:2379", "e2:2379"}; !slices.Equal(c.Etcd.Endpoints, want) {
		t.Errorf("etcd.endpoints = %q, want %q", c.Etcd.Endpoints, want)
	}
	want := Cluster{Brokers: []string{"a:1", "b:1"}, Role: RolePrimary, Version: DefaultKafkaVersion, ClientID: DefaultClientID, Delivery: AtLeastOnce, TransactionInterval: DefaultTransactionInterval}
	if got := c.Clusters["dc.1"]; !reflect.DeepEqual(got, want) {
		t.Errorf("clusters[dc.1] = %+v, want %+v", got, want)
	}
	// Flags not given leave the config alone.
	if c.Etcd.SessionTTL != 5*time.Second || c.Log.Format != "json" {
		t.Errorf("unset flags changed the config: %+v", c)
	}
	if err := c.Validate(); err != nil {
		t.Error(err)
	}
}

func TestBadOverrides(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  []string
		args []string
		want []string // substrings of the Parse or Apply error
	}{
		{"env duration", []string{"KSWITCH_ETCD_SESSION_TTL=5 seconds"}, nil,
			[]string{`config: KSWITCH_ETCD_SESSION_TTL="5 seconds": "5 seconds" is not a duration; write a Go duration such as "5s"`}},
		{"env bare number", []string{"KSWITCH_FAILOVER_FAILURE_WINDOW=3"}, nil,
			[]string{`KSWITCH_FAILOVER_FAILURE_WINDOW="3": "3" has no unit`}},
		{"env unknown variable", []string{"KSWITCH_ETCD_ENDPOINT=x:1"}, nil,
			[]string{"config: KSWITCH_ETCD_ENDPOINT: unknown variable (known: KSWITCH_ETCD_ENDPOINTS,"}},
		{"env unknown cluster field", []string{"KSWITCH_CLUSTERS_A_BROKER=x:1"}, nil,
			[]string{"config: KSWITCH_CLUSTERS_A_BROKER: not a cluster field"}},
		{"both env errors", []string{"KSWITCH_SOURCE_COMMIT_INTERVAL=soon", "KSWITCH_LOG_LEVL=debug"}, nil,
			[]string{"KSWITCH_SOURCE_COMMIT_INTERVAL", "KSWITCH_LOG_LEVL"}},
		{"flag duration", nil, []string{"--etcd.session_ttl=5 seconds"},
			[]string{`invalid argument "5 seconds" for "--etcd.session_ttl" flag: "5 seconds" is not a duration; write a Go duration such as "5s"`}},
		{"flag cluster syntax", nil, []string{"--cluster=A:brokers=x"},
			[]string{`for "--cluster" flag: want NAME.field=value`}},
		{"flag cluster field", nil, []string{"--cluster=A.brokerz=x:1"},
			[]string{`for "--cluster" flag: unknown cluster field "brokerz" (known: brokers, role, priority, version, client_id, tls.enabled, tls.ca_file, tls.cert_file, tls.key_file, tls.server_name, tls.insecure_skip_verify, sasl.mechanism, sasl.username, sasl.password, sasl.password_file, proxy, replication_policy, source_alias, offset_syncs_topic, offset_syncs_on, checkpoints_topic, delivery, transaction_interval)`}},
		{"flag ambiguous cluster", nil, []string{"--cluster=AB.role=sink"},
			[]string{`config: --cluster AB.role: cluster "AB" matches clusters Ab and aB, which differ only in case`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := Default()
			c.Clusters = map[string]Cluster{"Ab": {}, "aB": {}}
			fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
			fs.SetOutput(new(strings.Builder))
			o := BindFlags(fs)
			err := fs.Parse(tc.args)
			if err == nil {
				err = o.Apply(&c, tc.env)
			}
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error\n%v\ndoes not contain\n%s", err, w)
				}
			}
		})
	}
}

func TestFlagHelp(t *testing.T) {
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	BindFlags(fs)
	usage := fs.FlagUsages()
	for _, want := range []string{
		"--etcd.session_ttl duration",
		"(default 5s)",
		"KSWITCH_ETCD_SESSION_TTL",
		`--log.format string`,
		`(default "json")`,
		"--etcd.endpoints strings",
		"--cluster NAME.field=value",
		"default <hostname>-<pid>",
		"--failover.max_failed_switches int",
		"(default 3)",
		"KSWITCH_FAILOVER_MAX_FAILED_SWITCHES",
	} {
		if !strings.Contains(usage, want) {
			t.Errorf("usage lacks %q:\n%s", want, usage)
		}
	}
	for _, l := range configLeaves {
		f := fs.Lookup(l.path)
		if f == nil {
			t.Errorf("no flag --%s", l.path)
			continue
		}
		if l.help == "" {
			t.Errorf("field %s has no help tag", l.path)
		}
		if f.DefValue != l.def {
			t.Errorf("--%s default %q, want %q", l.path, f.DefValue, l.def)
		}
	}
	for _, l := range clusterLeaves {
		if l.help == "" {
			t.Errorf("cluster field %s has no help tag", l.path)
		}
	}
}

// TestMarshalRoundTrip checks that the yaml tags are the schema in both
// directions, so a Config can be printed as a valid file.
func TestMarshalRoundTrip(t *testing.T) {
	c, err := Load(examplePath)
	if err != nil {
		t.Fatal(err)
	}
	out, err := yaml.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	back, err := Parse(out, "marshalled")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if !reflect.DeepEqual(back, c) {
		t.Errorf("round trip:\n%+v\nwant\n%+v", back, c)
	}
}

func TestCloneIsDeep(t *testing.T) {
	c := valid(t)
	d := c.Clone()
	d.Etcd.Endpoints[0] = "changed:1"
	d.Source.Topics[0] = "changed"
	a := d.Clusters["A"]
	a.Brokers[0] = "changed:1"
	d.Clusters["Z"] = Cluster{}
	if c.Etcd.Endpoints[0] == "changed:1" || c.Source.Topics[0] == "changed" || c.Clusters["A"].Brokers[0] == "changed:1" {
		t.Error("Clone shares slices")
	}
	if _, ok := c.Clusters["Z"]; ok {
		t.Error("Clone shares the clusters map")
	}
}

func TestPrimaryStandby(t *testing.T) {
	c := valid(t)
	if name, cl := c.Primary(); name != "A" || cl.Role != RolePrimary {
		t.Errorf("Primary() = %q, %+v", name, cl)
	}
	if name, cl, ok := c.Standby(); !ok || name != "B" || cl.Role != RoleStandby {
		t.Errorf("Standby() = %q, %+v, %v", name, cl, ok)
	}
	delete(c.Clusters, "B")
	if name, _, ok := c.Standby(); ok || name != "" {
		t.Errorf("Standby() without standby = %q, %v", name, ok)
	}
}

// TestIntLeaf checks failover.max_failed_switches, an int leaf, from the
// file, the environment and a flag, and the errors of each.
func TestIntLeaf(t *testing.T) {
	t.Run("yaml", func(t *testing.T) {
		c, err := Parse([]byte("failover:\n  max_failed_switches: 5\n"), "f.yaml")
		if err != nil {
			t.Fatal(err)
		}
		if c.Failover.MaxFailedSwitches != 5 {
			t.Errorf("max_failed_switches = %d, want 5", c.Failover.MaxFailedSwitches)
		}
	})
	for _, tc := range []struct{ name, value, want string }{
		{"yaml word", "three", `config: f.yaml line 2: failover.max_failed_switches: "three" is not a whole number`},
		{"yaml quoted number", `"5"`, `config: f.yaml line 2: failover.max_failed_switches: expected a whole number, got the string "5"; write it without quotes`},
		{"yaml float", "5.0", `config: f.yaml line 2: failover.max_failed_switches: "5.0" is not a whole number`},
		{"yaml bool", "true", `config: f.yaml line 2: failover.max_failed_switches: "true" is not a whole number`},
		{"yaml list", "[5]", `config: f.yaml line 2: failover.max_failed_switches: expected a single value, got a list`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte("failover:\n  max_failed_switches: "+tc.value+"\n"), "f.yaml")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error\n%v\ndoes not contain\n%s", err, tc.want)
			}
		})
	}

	apply := func(env, args []string) (Config, error) {
		c := valid(t)
		fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
		fs.SetOutput(new(strings.Builder))
		o := BindFlags(fs)
		if err := fs.Parse(args); err != nil {
			return c, err
		}
		return c, o.Apply(&c, env)
	}
	for _, tc := range []struct {
		name      string
		env, args []string
		want      int
	}{
		{"env", []string{"KSWITCH_FAILOVER_MAX_FAILED_SWITCHES=5"}, nil, 5},
		{"env with blanks", []string{"KSWITCH_FAILOVER_MAX_FAILED_SWITCHES= 7 "}, nil, 7},
		{"flag", nil, []string{"--failover.max_failed_switches", "5"}, 5},
		{"flag over env", []string{"KSWITCH_FAILOVER_MAX_FAILED_SWITCHES=4"}, []string{"--failover.max_failed_switches=6"}, 6},
		{"neither", nil, nil, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := apply(tc.env, tc.args)
			if err != nil {
				t.Fatal(err)
			}
			if c.Failover.MaxFailedSwitches != tc.want {
				t.Errorf("max_failed_switches = %d, want %d", c.Failover.MaxFailedSwitches, tc.want)
			}
			if err := c.Validate(); err != nil {
				t.Error(err)
			}
		})
	}
	for _, tc := range []struct {
		name      string
		env, args []string
		want      string
	}{
		{"env word", []string{"KSWITCH_FAILOVER_MAX_FAILED_SWITCHES=three"}, nil,
			`config: KSWITCH_FAILOVER_MAX_FAILED_SWITCHES="three": "three" is not a whole number`},
		{"flag word", nil, []string{"--failover.max_failed_switches", "three"},
			`invalid argument "three" for "--failover.max_failed_switches" flag: "three" is not a whole number`},
		{"flag fraction", nil, []string{"--failover.max_failed_switches=2.5"},
			`invalid argument "2.5" for "--failover.max_failed_switches" flag: "2.5" is not a whole number`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := apply(tc.env, tc.args)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error\n%v\ndoes not contain\n%s", err, tc.want)
			}
		})
	}
}

// flow returns c's flow from → to, the zero Replication when there is none.
func flow(c Config, from, to string) Replication {
	r, _ := c.Flow(from, to)
	return r
}

func TestReplication(t *testing.T) {
	c := valid(t) // A primary, B standby, no replication fields
	want := Replication{
		From:               "A",
		To:                 "B",
		Policy:             "prefix",
		SourceAlias:        "A",
		OffsetSyncsTopic:   "mm2-offset-syncs.B.internal",
		OffsetSyncsCluster: "A",
		CheckpointsTopic:   "A.checkpoints.internal",
	}
	r := flow(c, "A", "B")
	if r != want {
		t.Errorf("Replication(B) defaults = %+v, want %+v", r, want)
	}
	if got := r.RemoteTopic("orders"); got != "A.orders" {
		t.Errorf("prefix RemoteTopic(orders) = %q, want A.orders", got)
	}
	// The flow back, B → A: B's orders is B.orders on A.
	back := Replication{
		From:               "B",
		To:                 "A",
		Policy:             "prefix",
		SourceAlias:        "B",
		OffsetSyncsTopic:   "mm2-offset-syncs.A.internal",
		OffsetSyncsCluster: "B",
		CheckpointsTopic:   "B.checkpoints.internal",
	}
	if r := flow(c, "B", "A"); r != back {
		t.Errorf("Replication(A) defaults = %+v, want %+v", r, back)
	}

	// Explicit source alias: the prefix and the checkpoints topic follow it.
	editCluster(&c, "B", func(b *Cluster) { b.SourceAlias, b.OffsetSyncsOn = "east", "target" })
	r = flow(c, "A", "B")
	want = Replication{
		From:               "A",
		To:                 "B",
		Policy:             "prefix",
		SourceAlias:        "east",
		OffsetSyncsTopic:   "mm2-offset-syncs.east.internal", // named after the source when on the target
		OffsetSyncsCluster: "B",
		CheckpointsTopic:   "east.checkpoints.internal",
	}
	if r != want {
		t.Errorf("Replication(B) with alias = %+v, want %+v", r, want)
	}
	if got := r.RemoteTopic("orders"); got != "east.orders" {
		t.Errorf("prefix RemoteTopic(orders) = %q, want east.orders", got)
	}

	// Everything explicit, identity policy.
	editCluster(&c, "B", func(b *Cluster) {
		b.ReplicationPolicy, b.OffsetSyncsOn = "identity", "source"
		b.OffsetSyncsTopic, b.CheckpointsTopic = "syncs", "checkpoints"
	})
	r = flow(c, "A", "B")
	want = Replication{
		From:               "A",
		To:                 "B",
		Policy:             "identity",
		SourceAlias:        "east",
		OffsetSyncsTopic:   "syncs",
		OffsetSyncsCluster: "A",
		CheckpointsTopic:   "checkpoints",
	}
	if r != want {
		t.Errorf("Replication(B) explicit = %+v, want %+v", r, want)
	}
	if got := r.RemoteTopic("orders"); got != "orders" {
		t.Errorf("identity RemoteTopic(orders) = %q, want orders", got)
	}
	// Identity is one way: nothing flows back into A.
	if r, ok := c.Flow("B", "A"); ok {
		t.Errorf("Replication(A) under identity = %+v, want no flow", r)
	}
	if err := c.Validate(); err != nil {
		t.Error(err)
	}
}

// TestReplicationOverrides sets the replication fields of a cluster by
// flag and by environment.
func TestReplicationOverrides(t *testing.T) {
	c := valid(t)
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	o := BindFlags(fs)
	if err := fs.Parse([]string{"--cluster", "B.replication_policy=identity", "--cluster=b.source_alias=east"}); err != nil {
		t.Fatal(err)
	}
	err := o.Apply(&c, []string{
		"KSWITCH_CLUSTERS_B_OFFSET_SYNCS_ON=target",
		"KSWITCH_CLUSTERS_B_CHECKPOINTS_TOPIC=east.cp",
		"KSWITCH_CLUSTERS_B_REPLICATION_POLICY=prefix", // the flag wins
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	b := c.Clusters["B"]
	if b.ReplicationPolicy != "identity" || b.SourceAlias != "east" || b.OffsetSyncsOn != "target" || b.CheckpointsTopic != "east.cp" {
		t.Errorf("clusters.B = %+v", b)
	}
	if r := flow(c, "A", "B"); r.RemoteTopic("orders") != "orders" || r.OffsetSyncsCluster != "B" {
		t.Errorf("Replication(B) = %+v", r)
	}
	if len(c.Clusters) != 2 {
		t.Errorf("clusters = %v, want A and B only", slices.Sorted(maps.Keys(c.Clusters)))
	}
}

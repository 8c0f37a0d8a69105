package dynconfig_test

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/dynconfig"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// fuzzFile is a valid configuration file the fuzzed layers apply over.
func fuzzFile() config.Config {
	cfg := config.Default()
	cfg.Fleet, cfg.Agent.ID = "orders", "agent-1"
	cfg.Etcd.Endpoints = []string{"127.0.0.1:2379"}
	cfg.Clusters = map[string]config.Cluster{
		"A": {Brokers: []string{"127.0.0.1:9092"}, Role: config.RolePrimary, Version: config.DefaultKafkaVersion},
		"B": {Brokers: []string{"127.0.0.1:9093"}, Role: config.RoleStandby, Version: config.DefaultKafkaVersion},
	}
	cfg.Source.Topics, cfg.Source.Group = []string{"orders"}, "orders"
	return cfg
}

// FuzzParseVersion feeds state/config values, as a stranger could write
// them, to ParseVersion and applies what it accepts over a valid file: no
// panic, and an accepted version has a positive number.
func FuzzParseVersion(f *testing.F) {
	good, _ := json.Marshal(state.ConfigVersion{Number: 3, Revision: 40, At: time.Unix(1_700_000_000, 0).UTC(), Leader: "agent-1",
		Changed: []string{"clusters/B"}, Overrides: state.ConfigOverrides{Clusters: map[string]config.Cluster{"B": {Brokers: []string{"10.0.0.2:9092"}, Role: config.RoleStandby}}}})
	for _, seed := range []string{
		string(good), `{"version":0}`, `{"version":1,"extra":true}`, `{"version":1,"overrides":{"source":{"topics":[]}}}`,
		`{"version":1,"overrides":{"clusters":{"Z":{"role":"primary"}}}}`, `{"version":"1"}`, `null`, ``, `{"version":1}{}`,
	} {
		f.Add([]byte(seed))
	}
	file := fuzzFile()
	f.Fuzz(func(t *testing.T, b []byte) {
		v, err := state.ParseConfigVersion(b)
		if err != nil {
			return
		}
		if v.Number <= 0 {
			t.Fatalf("accepted version number %d", v.Number)
		}
		_, _ = v.Overrides.Apply(file.Clone())
	})
}

// FuzzLayerDecode feeds config/source and config/clusters/<name> values to
// what the leader's gate does with them (Decode over the file, then
// Apply): no panic.
func FuzzLayerDecode(f *testing.F) {
	for _, seed := range []struct{ source, name, cluster string }{
		{"topics: [orders, payments]\n", "B", "brokers: [10.0.0.2:9092]\nrole: standby\n"},
		{"initial_offset: newest\n", "C", "brokers: [c:9092]\nrole: sink\n"},
		{"topics: 7\n", "B", "role: [x]\n"},
		{"", "", ""},
		{"  \n", "../x", "brokers: []\n"},
		{"topic_regex: '('\n", "A", "brokers: [a:1]\nrole: primary\nsasl: {mechanism: SCRAM-SHA-512, username: u}\n"},
		{"a: &a [*a, *a]\nb: &b [*a, *a]\n", "B", "unknown: 1\n"},
	} {
		f.Add([]byte(seed.source), seed.name, []byte(seed.cluster))
	}
	file := fuzzFile()
	k := keys.New(file.Fleet)
	f.Fuzz(func(t *testing.T, source []byte, name string, cluster []byte) {
		l := dynconfig.Layer{Source: source, Clusters: map[string][]byte{name: cluster}}
		o, err := l.Decode(k, file)
		if err != nil {
			return
		}
		_, _ = o.Apply(file.Clone())
	})
}

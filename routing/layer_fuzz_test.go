package routing

import (
	"errors"
	"strings"
	"testing"

	"github.com/kswitch/kswitch/config"
)

// FuzzMergeAndCompile feeds the routes value and a channels/<name> value,
// as a stranger could write them, through what the router does with them
// (Merge, then Compile): it never panics, and a refusal is an
// *InvalidError with reasons and the kinds of the values at fault.
func FuzzMergeAndCompile(f *testing.F) {
	for _, seed := range []struct{ routes, name, channel string }{
		{"rules: [{name: all, channels: [b]}]\n", "b", "cluster: B\ntopic: b\n"},
		{"mode: all\nrules:\n- name: big\n  match: (json?.amount ?? 0) > 1000\n  channels: [b]\n- name: rest\n  drop: true\ndefault: [b]\ndead_letter: b\n", "b", "cluster: B\ntopic: b\nkey: key + '-x'\npartitioner: roundrobin\ncompression: zstd\nacks: leader\n"},
		{"rules: [{name: all, channels: [nowhere]}]\n", "x", "cluster: Z\ntopic: t\n"},
		{"rules: [{name: all, match: 'topic ==', channels: [b]}]\n", "b", "cluster: B\ntopic: 'bad topic'\n"},
		{"rules: [{name: all, chanels: [b]}]\n", "b", "{cluster: B, topic: b, key: '"},
		{"", "b", ""},
		{"   \n", "b", "\t"},
		{"- a\n- b\n", "..", "cluster: [B]\n"},
		{"rules: &a [*a]\n", "b", "topic: &x b\ncluster: *x\n"},
		{"channels: {b: {cluster: B, topic: b}}\n", "b", "cluster: B\ntopic: b\nunknown: 1\n"},
		{"rules: [{name: m, match: 'headers[\"h\"] matches \"[\"', channels: [b]}]\n", "b", "cluster: B\ntopic: b\nkey: 1/0\n"},
		{strings.Repeat("#", MaxValueSize+1), "b", "cluster: B\ntopic: b\n"},
	} {
		f.Add([]byte(seed.routes), seed.name, []byte(seed.channel))
	}
	clusters := map[string]config.Cluster{
		"A": {Brokers: []string{"127.0.0.1:1"}, Role: config.RolePrimary, Version: config.DefaultKafkaVersion},
		"B": {Brokers: []string{"127.0.0.1:2"}, Role: config.RoleSink, Version: config.DefaultKafkaVersion},
	}
	static := Config{Channels: map[string]Channel{"b": {Cluster: "B", Topic: "b"}}}
	f.Fuzz(func(t *testing.T, routes []byte, name string, channel []byte) {
		chans := map[string][]byte{name: channel}
		spec, _, err := Merge(static, testKeys, routes, chans)
		if err == nil {
			_, err = Compile(spec, clusters)
		}
		if err == nil {
			return
		}
		var ie *InvalidError
		if !errors.As(err, &ie) || len(ie.Problems) == 0 {
			t.Fatalf("refusal %v is not an *InvalidError with problems", err)
		}
		if len(refusedKinds(err)) == 0 {
			t.Fatalf("refusal %v names no kind of value", err)
		}
	})
}

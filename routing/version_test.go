package routing

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/record"
)

var testClusters = map[string]config.Cluster{
	"A": {Brokers: []string{"a:9092"}, Role: config.RolePrimary, Version: "3.6.0"},
	"B": {Brokers: []string{"b:9092"}, Role: config.RoleSink, Version: "3.6.0"},
	"C": {Brokers: []string{"c:9092"}, Role: config.RoleSink, Version: "3.6.0"},
}

func testChannels() map[string]Channel {
	return map[string]Channel{
		"x":   {Cluster: "B", Topic: "tx"},
		"y":   {Cluster: "C", Topic: "ty"},
		"z":   {Cluster: "C", Topic: "tz", Key: "json?.customer"},
		"dlq": {Cluster: "B", Topic: "dead"},
	}
}

func mustCompile(t *testing.T, c Config) *Version {
	t.Helper()
	if c.Channels == nil {
		c.Channels = testChannels()
	}
	v, err := Compile(c, testClusters)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func rec(topic string, key, value string, headers ...string) *record.Record {
	r := &record.Record{Cluster: "A", Topic: topic, SourceTopic: topic, Partition: 3, Offset: 42,
		Key: []byte(key), Value: []byte(value), Timestamp: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
	if key == "" {
		r.Key = nil
	}
	for i := 0; i+1 < len(headers); i += 2 {
		r.Headers = append(r.Headers, record.Header{Key: []byte(headers[i]), Value: []byte(headers[i+1])})
	}
	return r
}

func TestRoute(t *testing.T) {
	t.Parallel()
	orders := Rule{Name: "orders", Match: `topic == "orders"`, Channels: []string{"x"}}
	everything := Rule{Name: "everything", Channels: []string{"y", "x"}}
	tests := []Rule{{Name: "tests", Match: `headers["test"] == "true"`, Drop: true}}
	replica := rec("A.orders", "k", "v")
	replica.SourceTopic = "orders"
	for _, tc := range []struct {
		name string
		cfg  Config
		rec  *record.Record
		want Decision
	}{
		{"first: first match decides", Config{Rules: []Rule{orders, everything}}, rec("orders", "k", "v"),
			Decision{Channels: []string{"x"}, Rules: []string{"orders"}}},
		{"first: falls through", Config{Rules: []Rule{orders, everything}}, rec("payments", "k", "v"),
			Decision{Channels: []string{"y", "x"}, Rules: []string{"everything"}}},
		{"all: every match, each channel once", Config{Mode: ModeAll, Rules: []Rule{orders, everything}}, rec("orders", "k", "v"),
			Decision{Channels: []string{"x", "y"}, Rules: []string{"orders", "everything"}}},
		{"all: drop first drops", Config{Mode: ModeAll, Rules: append(tests, orders)}, rec("orders", "k", "v", "test", "true"),
			Decision{Rules: []string{"tests"}, Dropped: DropRule, DropRule: "tests"}},
		{"all: drop after a match ends evaluation", Config{Mode: ModeAll, Rules: []Rule{orders, tests[0], everything}}, rec("orders", "k", "v", "test", "true"),
			Decision{Channels: []string{"x"}, Rules: []string{"orders", "tests"}}},
		{"no match: default", Config{Rules: []Rule{orders}, Default: []string{"y"}}, rec("payments", "k", "v"),
			Decision{Channels: []string{"y"}}},
		{"no match, no default: dropped", Config{Rules: []Rule{orders}}, rec("payments", "k", "v"),
			Decision{Dropped: DropNoMatch}},
		{"no rules at all: dropped", Config{}, rec("orders", "k", "v"), Decision{Dropped: DropNoMatch}},
		{"logical topic name on a replica", Config{Rules: []Rule{orders}}, replica,
			Decision{Channels: []string{"x"}, Rules: []string{"orders"}}},
		{"json field", Config{Rules: []Rule{{Name: "big", Match: `json?.amount > 1000`, Channels: []string{"x"}}}},
			rec("orders", "k", `{"amount": 1500}`), Decision{Channels: []string{"x"}, Rules: []string{"big"}}},
		{"json field, small", Config{Rules: []Rule{{Name: "big", Match: `(json?.amount ?? 0) > 1000`, Channels: []string{"x"}}}},
			rec("orders", "k", `{"amount": 15}`), Decision{Dropped: DropNoMatch}},
		{"not json", Config{Rules: []Rule{{Name: "nojson", Match: `json == nil`, Channels: []string{"x"}}}},
			rec("orders", "k", `amount=15`), Decision{Channels: []string{"x"}, Rules: []string{"nojson"}}},
		{"key, value, partition, offset, cluster", Config{Rules: []Rule{{Name: "r",
			Match: `key startsWith "cust-" && value contains "EUR" && partition == 3 && offset >= 42 && cluster == "A"`, Channels: []string{"x"}}}},
			rec("orders", "cust-1", "12 EUR"), Decision{Channels: []string{"x"}, Rules: []string{"r"}}},
		{"timestamp", Config{Rules: []Rule{{Name: "recent", Match: `timestamp > date("2026-01-01")`, Channels: []string{"x"}}}},
			rec("orders", "k", "v"), Decision{Channels: []string{"x"}, Rules: []string{"recent"}}},
		{"missing header", Config{Rules: []Rule{{Name: "h", Match: `headers["region"] == "eu"`, Channels: []string{"x"}}}},
			rec("orders", "k", "v"), Decision{Dropped: DropNoMatch}},
		{"key expression", Config{Rules: []Rule{{Name: "z", Channels: []string{"z", "x"}}}},
			rec("orders", "k", `{"customer": "c-7"}`), Decision{Channels: []string{"z", "x"}, Rules: []string{"z"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := mustCompile(t, tc.cfg)
			got, err := v.Route(tc.rec)
			if err != nil {
				t.Fatal(err)
			}
			got.Keys = nil
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("Route = %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestKeys(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		key  string
		rec  *record.Record
		want []byte
	}{
		{"", rec("orders", "k1", "v"), []byte("k1")},
		{"keep", rec("orders", "", "v"), nil},
		{"json?.customer", rec("orders", "k1", `{"customer": "c-7"}`), []byte("c-7")},
		{"json?.customer", rec("orders", "k1", `{"customer": 7}`), []byte("7")},
		{"json?.customer", rec("orders", "k1", `not json`), nil},
		{`topic + "/" + string(partition)`, rec("orders", "k1", "v"), []byte("orders/3")},
		{`json?.ids`, rec("orders", "k1", `{"ids": [1, 2]}`), []byte("[1,2]")},
	} {
		chans := testChannels()
		chans["k"] = Channel{Cluster: "B", Topic: "t", Key: tc.key}
		v := mustCompile(t, Config{Rules: []Rule{{Name: "r", Channels: []string{"k"}}}, Channels: chans})
		d, err := v.Route(tc.rec)
		if err != nil {
			t.Errorf("key %q: %v", tc.key, err)
			continue
		}
		if !reflect.DeepEqual(d.Keys[0], tc.want) {
			t.Errorf("key %q on %s: %q, want %q", tc.key, tc.rec.Value, d.Keys[0], tc.want)
		}
	}
}

func TestEvalErrors(t *testing.T) {
	t.Parallel()
	v := mustCompile(t, Config{Rules: []Rule{
		{Name: "amount", Match: `json.amount > 10`, Channels: []string{"x"}},
	}})
	_, err := v.Route(rec("orders", "k", "not json"))
	var ee *EvalError
	if !errors.As(err, &ee) || ee.Rule != "amount" || !strings.Contains(err.Error(), "routing: rule amount:") {
		t.Errorf("error %v, want an EvalError of rule amount", err)
	}

	chans := testChannels()
	chans["k"] = Channel{Cluster: "B", Topic: "t", Key: `json.customer.id`}
	v = mustCompile(t, Config{Default: []string{"k"}, Channels: chans})
	_, err = v.Route(rec("orders", "k", `{}`))
	if !errors.As(err, &ee) || ee.Rule != "default" || ee.Channel != "k" || !strings.Contains(err.Error(), "routing: channel k key (record routed by rule default)") {
		t.Errorf("error %v, want an EvalError of channel k", err)
	}
}

func TestNeeds(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		match string
		want  needs
	}{
		{`topic == "orders"`, needs{}},
		{`json?.a == 1`, needs{json: true}},
		{`key == "a" || value == "b"`, needs{key: true, value: true}},
		{`headers["x"] == "1"`, needs{headers: true}},
		{`"json" == topic`, needs{}},
	} {
		v := mustCompile(t, Config{Rules: []Rule{{Name: "r", Match: tc.match, Channels: []string{"x"}}}, Channels: map[string]Channel{"x": {Cluster: "B", Topic: "t"}}})
		if v.needs != tc.want {
			t.Errorf("%s: needs %+v, want %+v", tc.match, v.needs, tc.want)
		}
	}
}

func TestCompileRefuses(t *testing.T) {
	t.Parallel()
	old := map[string]config.Cluster{"A": {Brokers: []string{"a:1"}, Version: "0.10.2.0"}, "Z": {Brokers: []string{"z:1"}, Version: "2.0.0"}}
	for _, tc := range []struct {
		name     string
		cfg      Config
		clusters map[string]config.Cluster
		want     []string
	}{
		{"match does not parse", Config{Rules: []Rule{{Name: "r", Match: `topic ==`, Channels: []string{"x"}}}}, nil,
			[]string{"rules[0].match: unexpected token EOF (column"}},
		{"match not bool", Config{Rules: []Rule{{Name: "r", Match: `topic`, Channels: []string{"x"}}}}, nil,
			[]string{"rules[0].match: expected bool, but got string"}},
		{"unknown name", Config{Rules: []Rule{{Name: "r", Match: `tpoic == "a"`, Channels: []string{"x"}}}}, nil,
			[]string{"rules[0].match: unknown name tpoic"}},
		{"key does not compile", Config{Channels: map[string]Channel{"x": {Cluster: "B", Topic: "t", Key: "json?.("}}}, nil,
			[]string{"channels.x.key: "}},
		{"undefined channel", Config{Rules: []Rule{{Name: "r", Channels: []string{"nope"}}}}, nil,
			[]string{`rules[0].channels[0]: channel "nope" is not defined`}},
		{"unknown cluster", Config{Channels: map[string]Channel{"x": {Cluster: "D", Topic: "t"}}}, nil,
			[]string{`channels.x.cluster: "D" is not a configured cluster (configured: A, B, C)`}},
		{"bad mode", Config{Mode: "some"}, nil, []string{`mode: "some" is not one of first, all`}},
		{"idempotence on Kafka 0.10", Config{Channels: map[string]Channel{"x": {Cluster: "A", Topic: "t"}}}, old,
			[]string{"channels.x: acks all uses the idempotent producer, which needs Kafka 0.11 or later"}},
		{"zstd on Kafka 2.0", Config{Channels: map[string]Channel{"x": {Cluster: "Z", Topic: "t", Compression: "zstd", Acks: "leader"}}}, old,
			[]string{"channels.x: producer configuration:", "zstd"}},
		{"every problem reported", Config{Mode: "some", Rules: []Rule{{Name: "r", Match: `topic`, Channels: []string{"nope"}}}}, nil,
			[]string{"mode:", "rules[0].match:", "rules[0].channels[0]:"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.cfg.Channels == nil {
				tc.cfg.Channels = testChannels()
			}
			_, err := Compile(tc.cfg, cmpOr(tc.clusters, testClusters))
			var ie *InvalidError
			if !errors.As(err, &ie) {
				t.Fatalf("error %v, want an *InvalidError", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error\n%v\nlacks %q", err, w)
				}
			}
		})
	}
}

func cmpOr[M ~map[K]V, K comparable, V any](a, b M) M {
	if a != nil {
		return a
	}
	return b
}

func TestMerge(t *testing.T) {
	t.Parallel()
	static := Config{Mode: ModeAll, Rules: []Rule{{Name: "s", Channels: []string{"x"}}}, Channels: testChannels()}
	k := testKeys
	spec, src, err := Merge(static, k, nil, nil)
	if err != nil || src != "file" || !reflect.DeepEqual(spec, static) {
		t.Errorf("Merge(nothing) = %+v, %q, %v", spec, src, err)
	}
	spec, src, err = Merge(static, k, []byte("rules: [{name: e, channels: [n]}]\ndefault: [x]\n"), map[string][]byte{"n": []byte("{cluster: C, topic: tn}"), "x": []byte("{cluster: C, topic: tx2}")})
	if err != nil || src != "file+etcd" {
		t.Fatalf("Merge = %q, %v", src, err)
	}
	if spec.Mode != "" || len(spec.Rules) != 1 || spec.Rules[0].Name != "e" || spec.Channels["x"].Topic != "tx2" || spec.Channels["n"].Name != "n" || spec.Channels["y"].Topic != "ty" {
		t.Errorf("Merge = %+v", spec)
	}
	_, _, err = Merge(static, k, []byte("rules: [{name: e, chanels: [n]}]\nchannels: {n: {cluster: C, topic: t}}"), map[string][]byte{"bad": []byte("{cluster: C, topic: t, partitions: 3}"), "empty": []byte(" ")})
	for _, w := range []string{
		`/kswitch/test/routes line 1: unknown field "chanels" in rules[0]`,
		`/kswitch/test/channels/bad line 1: unknown field "partitions"`,
		`/kswitch/test/channels/empty: empty value; delete the key instead`,
	} {
		if err == nil || !strings.Contains(err.Error(), w) {
			t.Errorf("Merge error\n%v\nlacks %q", err, w)
		}
	}
	_, _, err = Merge(static, k, []byte("channels: {n: {cluster: C, topic: t}}"), nil)
	if err == nil || !strings.Contains(err.Error(), "channels are not part of the routes value; write each channel to /kswitch/test/channels/<name>") {
		t.Errorf("Merge with channels in routes: %v", err)
	}
}

// The rules run once per partition when they read nothing but where a
// record comes from; a rule that reads anything else (or now()) runs for
// every record. Either way every record gets the decision of its own.
func TestDecisionsKeptPerPartitionOnlyWhenTheRulesAllowIt(t *testing.T) {
	t.Parallel()
	// Each cluster holds two copies of orders: its own (origin the
	// cluster) and the other's (A.orders on B, B.orders on A), with the
	// same partition numbers, decided apart.
	other := map[string]string{"A": "B", "B": "A"}
	at := func(cluster string, copied bool, partition int32, offset int64) *record.Record {
		r := rec("orders", "k", "v")
		r.Cluster, r.Partition, r.Offset, r.Origin = cluster, partition, offset, cluster
		if copied {
			r.Origin = other[cluster]
			r.Topic = r.Origin + ".orders"
		}
		return r
	}
	for _, tc := range []struct {
		name  string
		match string
		kept  bool
		want  func(r *record.Record) string // the channel of r
	}{
		{"partition", `partition == 1`, true, func(r *record.Record) string { return map[bool]string{true: "x", false: "y"}[r.Partition == 1] }},
		{"cluster and topic", `cluster == "B" && topic startsWith "ord"`, true, func(r *record.Record) string { return map[bool]string{true: "x", false: "y"}[r.Cluster == "B"] }},
		{"offset", `offset % 2 == 0`, false, func(r *record.Record) string { return map[bool]string{true: "x", false: "y"}[r.Offset%2 == 0] }},
		{"a variable", `let p = offset; p > 1`, false, func(r *record.Record) string { return map[bool]string{true: "x", false: "y"}[r.Offset > 1] }},
		{"now", `now().Year() > 3000 || partition == 1`, false, func(r *record.Record) string { return map[bool]string{true: "x", false: "y"}[r.Partition == 1] }},
		{"origin", `origin == "B"`, true, func(r *record.Record) string { return map[bool]string{true: "x", false: "y"}[r.Origin == "B"] }},
		{"physical topic", `physical_topic == "orders"`, true, func(r *record.Record) string { return map[bool]string{true: "x", false: "y"}[r.Topic == "orders"] }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := mustCompile(t, Config{Rules: []Rule{{Name: "r", Match: tc.match, Channels: []string{"x"}}}, Default: []string{"y"}})
			if kept := v.decisions != nil; kept != tc.kept {
				t.Fatalf("decisions kept per partition: %v, want %v", kept, tc.kept)
			}
			for round := range 2 { // the second round meets the kept decisions
				for _, cl := range []string{"A", "B"} {
					for p := range int32(3) {
						for _, copied := range []bool{false, true} {
							for off := range int64(4) {
								r := at(cl, copied, p, off)
								d, err := v.Route(r)
								if err != nil {
									t.Fatal(err)
								}
								if want := tc.want(r); len(d.Channels) != 1 || d.Channels[0] != want {
									t.Fatalf("round %d, %s %s/%d@%d: channels %v, want [%s]", round, cl, r.Topic, p, off, d.Channels, want)
								}
							}
						}
					}
				}
			}
		})
	}
}

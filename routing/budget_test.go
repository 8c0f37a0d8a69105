package routing

import (
	"errors"
	"fmt"
	"os"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/expr-lang/expr"
	"go.yaml.in/yaml/v3"

	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/record"
)

// fleetDownRule is a rule found to take every agent down in turn: cheap
// on ordinary records, 5 TB of work on a 5 MiB one.
const fleetDownRule = `topic == "orders" && (key != "x" || len(repeat(value, 999999)) > 0)`

func TestFleetDownRuleIsRefused(t *testing.T) {
	t.Parallel()
	_, err := Compile(Config{Rules: []Rule{{Name: "orders", Match: fleetDownRule, Channels: []string{"x"}}}, Channels: testChannels()}, testClusters)
	var ie *InvalidError
	if !errors.As(err, &ie) {
		t.Fatalf("Compile = %v, want the rule refused", err)
	}
	for _, want := range []string{
		`rules[0].match: refused: on a JSON record of 1 KB with topic "orders", key "x", the expression exceeded its evaluation budget: repeat would build 965.1 MiB`,
		"build less from the record",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error\n%v\nlacks %q", err, want)
		}
	}
}

// TestProbesAreAsLargeAsKafkaAllows: a rule too costly on a record of
// Kafka's default largest size is refused; one whose cost is only reached
// past that size is accepted, and a record that reaches it fails with
// ErrBudget.
func TestProbesAreAsLargeAsKafkaAllows(t *testing.T) {
	t.Parallel()
	_, err := Compile(Config{Rules: []Rule{{Name: "r", Match: `len(repeat(value, 20)) > 0`, Channels: []string{"x"}}}, Channels: testChannels()}, testClusters)
	if want := "rules[0].match: refused: on a record whose value is 1.0 MiB of text, the expression exceeded its evaluation budget: repeat would build 20.0 MiB"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("Compile = %v, want %q", err, want)
	}
	v := mustCompile(t, Config{Rules: []Rule{{Name: "r", Match: `len(value) > 2000000 && len(repeat(value, 100)) > 0`, Channels: []string{"x"}}}})
	if _, err := v.Route(rec("orders", "k", strings.Repeat("x", fiveMiB))); !errors.Is(err, ErrBudget) {
		t.Errorf("Route of 5 MiB = %v, want ErrBudget", err)
	}
}

// fiveMiB is the size of the record that took fleetDownRule's agents down.
const fiveMiB = 5 << 20

// TestGuardsRefuseBeforeAllocating runs each construct whose result can
// outgrow its arguments on a record of 5 MiB: each must fail with
// ErrBudget, having allocated less than maxAlloc (unguarded, each
// allocates from 80 MiB to terabytes).
func TestGuardsRefuseBeforeAllocating(t *testing.T) {
	const maxAlloc = 64 << 20
	items := make([]any, 500_000) // json.items: 8 MB of elements, shared by the cases
	for _, tc := range []struct {
		name, expr string
		value      byte // the value's bytes: 'x', or 0xff (invalid UTF-8)
		want       string
	}{
		{"repeat, fleetDownRule's count", `repeat(value, 999999)`, 'x', "repeat would build"},
		{"repeat, a small count", `repeat(value, 100)`, 'x', "repeat would build"},
		{"+ doubling in lets", `let a = value + value; let b = a + a; let c = b + b; let d = c + c; d + d`, 'x', "+ would build"},
		{"+ in a closure", `reduce(1..100, #acc + value, "")`, 'x', "budget: "}, // + or the closure's count
		{"join", `join([value, value, value, value, value, value, value, value, value, value, value, value, value, value], value)`, 'x', "join would build"},
		{"replace", `replace(value, "x", "xxxxxxxxxxxxxxxxxxxx")`, 'x', "replace would build"},
		{"split", `split(value, "")`, 'x', "split would build"},
		{"splitAfter", `splitAfter(value, "x")`, 'x', "splitAfter would build"},
		{"upper of invalid UTF-8", `[upper(value), upper(value), upper(value), upper(value), upper(value)]`, 0xff, "upper would build"},
		{"lower of invalid UTF-8", `[lower(value), lower(value), lower(value), lower(value), lower(value)]`, 0xff, "lower would build"},
		{"toBase64", `[toBase64(value), toBase64(value), toBase64(value), toBase64(value), toBase64(value), toBase64(value)]`, 'x', "toBase64 would build"},
		{"toJSON of a shared structure", `let a = [value, value]; let b = [a, a]; let c = [b, b]; let d = [c, c]; toJSON(d)`, 'x', "toJSON would build"},
		{"string of a shared structure", `let a = [value, value]; let b = [a, a]; let c = [b, b]; let d = [c, c]; string(d)`, 'x', "string would build"},
		{"concat", `let a = json.items; concat(a, a, a, a, a, a, a, a, a, a)`, 'x', "concat would build"},
		{"flatten of a shared structure", `let a = [json.items, json.items]; let b = [a, a]; let c = [b, b]; let d = [c, c]; flatten([d, d])`, 'x', "flatten would build"},
		{"fromJSON", `fromJSON("[" + replace(value[0:2000000], "xx", "[],") + "[]]")`, 'x', "fromJSON would build"},
		{"matches with a pattern from the record", `key matches value`, 'x', "matches would build"},
		{"range", `1..100000000`, 'x', "memory budget exceeded"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := compileExpr(tc.expr)
			if err != nil {
				t.Fatal(err)
			}
			r := &record.Record{Cluster: "A", Topic: "orders", Key: []byte("k"), Value: []byte(strings.Repeat(string([]byte{tc.value}), fiveMiB))}
			e := (&Version{needs: needs{key: true, value: true}}).env(r)
			e.JSON = map[string]any{"items": items}
			alloc, err := allocated(func() error {
				_, err := run(p, e)
				return err
			})
			if !errors.Is(err, ErrBudget) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want ErrBudget: …%s…", err, tc.want)
			}
			if alloc > maxAlloc {
				t.Errorf("allocated %d MiB, want at most %d MiB", alloc>>20, maxAlloc>>20)
			}
		})
	}
}

// allocated runs f and returns the bytes allocated meanwhile (by the
// whole process: run it alone) and f's error.
func allocated(f func() error) (uint64, error) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	err := f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc, err
}

// TestBudgetGrowsWithTheRecord: what copies a large record a few times
// routes it; what multiplies it does not.
func TestBudgetGrowsWithTheRecord(t *testing.T) {
	t.Parallel()
	const size = 20 << 20 // over MaxBuiltBytes alone
	big := strings.Repeat("x", size)
	for _, tc := range []struct {
		expr string
		ok   bool
	}{
		{`len(value + "x") > 0`, true},
		{`len(upper(value) + lower(key)) > 0`, true},
		{`len(toJSON({"v": value})) > 0`, true},
		{`len(split(value, ",")) == 1`, true},
		{`len(replace(value, "x", "yy")) > 0`, true},
		{`len(value + value + value) > 0`, false},
	} {
		p, err := compileExpr(tc.expr, expr.AsBool())
		if err != nil {
			t.Fatal(err)
		}
		e := (&Version{needs: needs{key: true, value: true}}).env(&record.Record{Key: []byte("k"), Value: []byte(big)})
		out, err := run(p, e)
		if tc.ok && (err != nil || out != true) {
			t.Errorf("%s on %d MiB: %v, %v; want true", tc.expr, size>>20, out, err)
		}
		if !tc.ok && !errors.Is(err, ErrBudget) {
			t.Errorf("%s on %d MiB: %v, want ErrBudget", tc.expr, size>>20, err)
		}
	}
}

// TestGuardsKeepExpressionsMeaning: the guarded builtins and operators
// return what expr's own do, and keep their type errors at compile time.
func TestGuardsKeepExpressionsMeaning(t *testing.T) {
	t.Parallel()
	env := func() *Env {
		return (&Version{needs: needs{true, true, true, true}}).env(&record.Record{Cluster: "A", Topic: "orders",
			Key: []byte("k-1"), Value: []byte(`{"a": [1, [2, 3]], "s": "x,y", "n": 2, "t": "<b>"}`),
			Headers: []record.Header{{Key: []byte("h"), Value: []byte("é")}}})
	}
	for _, src := range []string{
		`key + "@" + cluster`, `json.s + json.t`, `json.n + 1`, `1 + 2`, `"a" + "b"`, `timestamp + duration("1h")`,
		`repeat(key, 3)`, `repeat(key, json.n)`, `join(split(json.s, ","), "|")`, `join(["a", "b"])`, `replace(json.s, ",", ";")`,
		`replace(json.s, "", "-", 2)`, `split(json.s, ",", 1)`, `splitAfter(json.s, ",")`, `upper(headers["h"])`, `lower("ÀB")`,
		`toBase64(key)`, `toJSON(json)`, `string(json.a)`, `string(key)`, `concat(json.a, [4])`, `flatten(json.a)`,
		`fromJSON("[1, {\"b\": null}]")`, `key matches "^k-"`, `key matches json.s`, `key matches ("^" + "k")`,
	} {
		plain, err := expr.Compile(src, expr.Env(Env{}))
		if err != nil {
			t.Fatalf("%s: %v", src, err)
		}
		want, err := expr.Run(plain, env())
		if err != nil {
			t.Fatalf("%s: %v", src, err)
		}
		p, err := compileExpr(src)
		if err != nil {
			t.Fatalf("%s: %v", src, err)
		}
		got, err := run(p, env())
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("%s = %#v, %v; expr alone: %#v", src, got, err, want)
		}
	}
	for src, want := range map[string]string{
		`repeat(1, 2)`:          "to call repeat",
		`join(1)`:               "to call join",
		`concat(1)`:             "cannot concat int",
		`split("a")`:            "to call split",
		`upper(key, key)`:       "to call upper",
		`flatten(1)`:            "cannot flatten int",
		`"a" + 1`:               "invalid operation: + (mismatched types string and int)",
		`key matches 1`:         "invalid operation: matches",
		`toBase64(partition)`:   "to call toBase64",
		`replace(key, "a", 1)`:  "to call replace",
		`splitAfter(key, 1, 2)`: "to call splitAfter",
	} {
		if _, err := compileExpr(src); err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), guardPrefix) {
			t.Errorf("%s: error %v, want expr's own, with %q", src, err, want)
		}
	}
}

// TestAKeyTooLargeAsJSONIsRefused: a key expression's value that is
// neither a string nor a number is written as JSON, within the budget.
func TestAKeyTooLargeAsJSONIsRefused(t *testing.T) {
	t.Parallel()
	chans := testChannels()
	chans["k"] = Channel{Cluster: "B", Topic: "t", Key: `len(value) < 100000 ? key : let a = [value, value]; let b = [a, a]; let c = [b, b]; [c, c]`}
	v := mustCompile(t, Config{Default: []string{"k"}, Channels: chans})
	if _, err := v.Route(rec("orders", "k", strings.Repeat("x", 4<<20))); !errors.Is(err, ErrBudget) {
		t.Errorf("Route = %v, want ErrBudget", err)
	}
}

// TestExampleRoutesRouteUnchanged: examples/routes.yaml routes as it did
// before the guards, a 5 MiB order included.
func TestExampleRoutesRouteUnchanged(t *testing.T) {
	t.Parallel()
	v, err := Compile(exampleRoutes(t), testClusters)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		rec  *record.Record
		want Decision
		key  string // on the first channel
	}{
		{rec("orders", "k", `{"amount": 5000, "customer": "c-1"}`), Decision{Channels: []string{"audit", "orders-copy"}, Rules: []string{"big-orders"}}, "c-1"},
		{rec("orders", "k", `{"amount": 5000, "customer": "c-2", "pad": "`+strings.Repeat("x", fiveMiB)+`"}`), Decision{Channels: []string{"audit", "orders-copy"}, Rules: []string{"big-orders"}}, "c-2"},
		{rec("orders", "k", `not json`), Decision{Channels: []string{"orders-copy"}, Rules: []string{"orders"}}, "k"},
		{rec("orders", "k", strings.Repeat("y", fiveMiB)), Decision{Channels: []string{"orders-copy"}, Rules: []string{"orders"}}, "k"},
		{rec("orders", "k", `{}`, "test", "true"), Decision{Rules: []string{"no-tests"}, Dropped: DropRule, DropRule: "no-tests"}, ""},
		{rec("payments", "k", `{"amount": 5000}`), Decision{Channels: []string{"everything"}}, "k"},
	} {
		got, err := v.Route(tc.rec)
		if err != nil {
			t.Fatal(err)
		}
		if len(got.Keys) > 0 && string(got.Keys[0]) != tc.key {
			t.Errorf("%.40s: key %q, want %q", tc.rec.Value, got.Keys[0], tc.key)
		}
		got.Keys = nil
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%.40s: Route = %+v, want %+v", tc.rec.Value, got, tc.want)
		}
	}
}

// TestARecordOverTheBudgetIsDeadLettered: a rule that passed validation
// (its cost depends on what the test records do not have: commas) meets a
// record on which it would build 90 MB. The record is dead-lettered with
// the reason budget, having cost the evaluation nothing, and the next
// records of its partition route.
func TestARecordOverTheBudgetIsDeadLettered(t *testing.T) {
	t.Parallel()
	w := newWorld(t, map[string][]string{"B": {"b", "dead"}}, "A", "B")
	w.cfg.Routing = Config{
		Rules:      []Rule{{Name: "commas", Match: `len(replace(value, ",", repeat(" ", 100))) > 0`, Channels: []string{"b"}}},
		DeadLetter: "dead",
		Channels:   map[string]Channel{"b": {Cluster: "B", Topic: "b"}, "dead": {Cluster: "B", Topic: "dead"}},
	}
	r := w.start(nil)
	before := testRecord("orders", 0, 0, "")
	w.handle(before, 10*time.Second)
	// 900 000 commas: within the producer's default 1 MiB, a 90 MB result.
	costly := testRecord("orders", 0, 1, strings.Repeat(",", 900_000))
	alloc, err := allocated(func() error { return deliver(t.Context(), w.router, costly, 10*time.Second) })
	if err != nil {
		t.Fatal(err)
	}
	// The record's copy as the rule's value (0.9 MB) and its dead letter.
	if alloc > 16<<20 {
		t.Errorf("handling the costly record allocated %d MiB, want at most 16", alloc>>20)
	}
	after := []*record.Record{testRecord("orders", 0, 2, ""), testRecord("orders", 0, 3, "")}
	for _, rec := range after {
		w.handle(rec, 10*time.Second)
	}
	wait.For(t, 10*time.Second, "every record acknowledged", func() error {
		for _, rec := range append([]*record.Record{before, costly}, after...) {
			if !w.acks.has(rec) {
				return fmt.Errorf("%s not acknowledged", sourceOf(rec))
			}
		}
		return nil
	})
	dead := w.read("B", "dead", 1)
	if len(dead) != 1 || header(dead[0], HeaderSource) != "orders/0@1" ||
		!strings.Contains(header(dead[0], HeaderError), "routing: rule commas: the expression exceeded its evaluation budget: replace would build") {
		t.Errorf("dead letters: %d, the first from %q with error %q", len(dead), header(dead[0], HeaderSource), header(dead[0], HeaderError))
	}
	if got := metricValue(r.m.dead.WithLabelValues("budget")); got != 1 {
		t.Errorf("dead_lettered{budget} = %v, want 1", got)
	}
	if onB := values(w.read("B", "b", 3)); len(onB) != 3 || !onB[string(after[1].Value)] {
		t.Errorf("on b: %v, want the 3 other records", onB)
	}
}

// exampleRoutes is examples/routes.yaml, the rules file of the README.
func exampleRoutes(tb testing.TB) Config {
	tb.Helper()
	b, err := os.ReadFile("../examples/routes.yaml")
	if err != nil {
		tb.Fatal(err)
	}
	var c Config
	if err := yaml.Unmarshal(b, &c); err != nil {
		tb.Fatal(err)
	}
	return c
}

// BenchmarkCompileExampleRoutes is what validating examples/routes.yaml
// costs an agent or 'kswitch routes check': compile and probe.
func BenchmarkCompileExampleRoutes(b *testing.B) {
	c := exampleRoutes(b)
	for b.Loop() {
		if _, err := Compile(c, testClusters); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRouteStringConcat evaluates, per 150 B record, a rule and a
// key expression that concatenate strings.
func BenchmarkRouteStringConcat(b *testing.B) {
	v, err := Compile(Config{
		Rules:    []Rule{{Name: "r", Match: `topic + "/" + key != "orders/x"`, Channels: []string{"k"}}},
		Channels: map[string]Channel{"k": {Cluster: "B", Topic: "t", Key: `key + "@" + cluster`}},
	}, testClusters)
	if err != nil {
		b.Fatal(err)
	}
	r := &record.Record{Cluster: "A", Topic: "orders", Key: []byte("customer-42"), Value: []byte(strings.Repeat("v", 150))}
	for b.Loop() {
		if _, err := v.Route(r); err != nil {
			b.Fatal(err)
		}
	}
}

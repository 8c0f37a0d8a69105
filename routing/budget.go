package routing

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/expr-lang/expr"
	"github.com/expr-lang/expr/ast"
	"github.com/expr-lang/expr/parser"
	"github.com/expr-lang/expr/vm"
)

// The evaluation budget of one expression on one record: its size, its
// closure iterations, its time, and the bytes it builds. Every closure body
// is wrapped to count one iteration and the length of what it returned,
// and every builtin or operator whose result can outgrow its arguments
// (repeat, + on strings, join, replace, split, toJSON, … : guards.go) is
// charged the size of its result before it allocates it. One budget of
// bytes takes both: MaxBuiltBytes plus BuiltBytesPerRecordByte for each
// byte of the record's key and value, so that a rule that copies a large
// record a few times (value + "x", upper(value), toBase64(value)) still
// routes it, and one that multiplies it (repeat(value, 1000)) does not.
const (
	// MaxRuleNodes bounds the size of one expression (expr.MaxNodes).
	MaxRuleNodes = 2000
	// MaxIterations bounds the closure iterations of one evaluation.
	MaxIterations = 100_000
	// MaxBuiltBytes is the part of the byte budget every record gets.
	MaxBuiltBytes = 16 << 20
	// BuiltBytesPerRecordByte is the part that grows with the record.
	BuiltBytesPerRecordByte = 2
	// MaxEvalTime bounds one evaluation's time on the clock, for what the
	// counts above do not see.
	MaxEvalTime = 100 * time.Millisecond
	// ProbeRecordBytes is the size of the largest test record: Kafka's
	// default largest record batch (message.max.bytes, 1 048 588 bytes).
	// A source whose brokers allow larger records can deliver records a
	// rule was not tried on; past their budget, they are dead-lettered.
	ProbeRecordBytes = 1_048_588

	budgetClockEvery = 1024
	// stepFunc and budgetVar are the names the closure bodies are wrapped
	// with: stepFunc(budgetVar, body).
	stepFunc  = "kswitch_step"
	budgetVar = "kswitch_budget"
)

// ErrBudget is the error of an evaluation that exceeded its budget: the
// record goes to the dead-letter channel with the reason.
var ErrBudget = errors.New("the expression exceeded its evaluation budget")

// budgetBytes is the byte budget of one evaluation on a record whose key
// and value have recordBytes bytes.
func budgetBytes(recordBytes int) int {
	return MaxBuiltBytes + BuiltBytesPerRecordByte*recordBytes
}

// evalBudget is what one evaluation has spent.
type evalBudget struct {
	iterations int
	built      int
	limit      int // budgetBytes of the record
	start      time.Time
}

// room is the number of bytes the evaluation may still build.
func (b *evalBudget) room() int { return max(b.limit-b.built, 0) }

// charge counts the n bytes that what is about to build, or refuses them.
func (b *evalBudget) charge(what string, n int) error {
	if n > b.room() {
		return fmt.Errorf("%w: %s would build %s, and %s of the %s this record allows are left (%s + %d × its %s of key and value); build less from the record, or test its size first",
			ErrBudget, what, sizeText(n), sizeText(b.room()), sizeText(b.limit), sizeText(MaxBuiltBytes), BuiltBytesPerRecordByte, sizeText((b.limit-MaxBuiltBytes)/BuiltBytesPerRecordByte))
	}
	b.built += n
	return nil
}

// step counts one run of a closure body whose value is x.
func (b *evalBudget) step(x any) error {
	if b.iterations == 0 {
		b.start = time.Now()
	}
	b.iterations++
	switch v := x.(type) {
	case string:
		b.built = addSat(b.built, len(v))
	case []any:
		b.built = addSat(b.built, 8*len(v))
	case map[string]any:
		b.built = addSat(b.built, 16*len(v))
	}
	switch {
	case b.iterations > MaxIterations:
		return fmt.Errorf("%w: more than %d closure iterations on one record (simplify the rule, or bound its ranges)", ErrBudget, MaxIterations)
	case b.built > b.limit:
		return fmt.Errorf("%w: closures built more than the %s this record allows (an accumulator that grows with every step?)", ErrBudget, sizeText(b.limit))
	case b.iterations%budgetClockEvery == 0 && time.Since(b.start) > MaxEvalTime:
		return fmt.Errorf("%w: ran for more than %v on one record", ErrBudget, MaxEvalTime)
	}
	return nil
}

// sizeText writes n bytes for a person: 812 B, 1.0 MiB, 5.0 TiB.
func sizeText(n int) string {
	if n < 1<<10 {
		return fmt.Sprintf("%d B", n)
	}
	f, unit := float64(n), 0
	for f >= 1<<10 && unit < 6 {
		f /= 1 << 10
		unit++
	}
	return fmt.Sprintf("%.1f %ciB", f, "BKMGTPE"[unit])
}

// compileExpr compiles src as a routing expression: checked first as
// written, so that its errors are expr's own and name the builtins the
// rule calls, then compiled with its closures counted and its guards.
func compileExpr(src string, extra ...expr.Option) (*vm.Program, error) {
	if _, err := expr.Compile(src, append([]expr.Option{expr.Env(Env{}), expr.MaxNodes(MaxRuleNodes)}, extra...)...); err != nil {
		return nil, err
	}
	return expr.Compile(src, append(budgetOptions(), extra...)...)
}

// budgetOptions are the options of every routing expression: the
// environment, the size bound, the closure accounting and the guards.
var budgetOptions = sync.OnceValue(func() []expr.Option {
	return append([]expr.Option{
		expr.Env(Env{}),
		expr.MaxNodes(MaxRuleNodes),
		expr.Function(stepFunc, func(params ...any) (any, error) {
			b, ok := params[0].(*evalBudget)
			if !ok || b == nil {
				return nil, fmt.Errorf("%s: the evaluation budget is not set", stepFunc)
			}
			return params[1], b.step(params[1])
		}, new(func(*evalBudget, any) any)),
		expr.Patch(closureCounter{}),
		expr.Patch(allocGuard{}),
	}, guardOptions()...)
})

// closureCounter wraps every closure body x as stepFunc(budgetVar, x).
type closureCounter struct{}

// Visit implements ast.Visitor.
func (closureCounter) Visit(n *ast.Node) {
	p, ok := (*n).(*ast.PredicateNode)
	if !ok {
		return
	}
	if c, ok := p.Node.(*ast.CallNode); ok {
		if id, ok := c.Callee.(*ast.IdentifierNode); ok && id.Value == stepFunc {
			return // wrapped already: the checker runs visitors more than once
		}
	}
	body := p.Node
	ast.Patch(&p.Node, &ast.CallNode{
		Callee:    &ast.IdentifierNode{Value: stepFunc},
		Arguments: []ast.Node{&ast.IdentifierNode{Value: budgetVar}, body},
	})
}

// probe is a record every expression is tried on before a version is
// accepted: one that exceeds its budget on it would exceed it on every
// record like it, so the version is refused instead of dead-lettering
// them all.
type probe struct {
	what string
	env  Env
}

// probes are an empty record, a small JSON one, and records of the largest
// size Kafka accepts by default: plain and JSON values, and a key.
var probes = sync.OnceValue(func() []probe {
	small := strings.Repeat("x", 1000)
	large := strings.Repeat("x", ProbeRecordBytes)
	const jsonOpen, jsonClose = `{"probe":"`, `"}`
	inJSON := large[:ProbeRecordBytes-len(jsonOpen)-len(jsonClose)]
	rec := func(key, value string, j any) Env {
		return Env{Key: key, Value: value, JSON: j, Headers: map[string]string{"probe": "x"}, recordBytes: len(key) + len(value)}
	}
	return []probe{
		{"an empty record", Env{}},
		{"a JSON record of 1 KB", rec(probeKey, jsonOpen+small+jsonClose, map[string]any{"probe": small})},
		{"a record whose value is " + sizeText(ProbeRecordBytes) + " of text", rec(probeKey, large, nil)},
		{"a record whose value is " + sizeText(ProbeRecordBytes) + " of JSON", rec(probeKey, jsonOpen+inJSON+jsonClose, map[string]any{"probe": inJSON})},
		{"a record whose key is " + sizeText(ProbeRecordBytes), rec(large, "", nil)},
	}
})

// maxProbeVariants bounds the records a probe is varied into.
const maxProbeVariants = 64

// tryProbes runs p, compiled from src, on the probe records and returns
// the budget's error, if any (other errors depend on the record and are
// left to the run). Each probe is also tried with the values src compares
// the record's coordinates, key and headers with (topic == "orders", key
// != "x", headers["h"] in ["a", "b"]), in every combination up to
// maxProbeVariants, so that a condition on where a record comes from or
// what it is called does not hide what the rule does to the records it
// selects; conditions on the size or the content of a value are met or not
// as the probes' own values meet them.
func tryProbes(p *vm.Program, src string, clusters []string) error {
	compared := comparedValues(src)
	cluster := "A"
	if len(clusters) > 0 {
		cluster = clusters[0]
	}
	for _, pr := range probes() {
		fields := compared
		if pr.env.Key != "" && pr.env.Key != probeKey {
			fields = slices.DeleteFunc(slices.Clone(fields), func(f comparedField) bool { return f.name == "key" })
		}
		pos := make([]int, len(fields)) // an odometer over fields' values, 0: the probe's own
		for variant := 0; variant < maxProbeVariants; variant++ {
			e := pr.env
			e.Topic, e.PhysicalTopic, e.Cluster, e.Origin = "probe", "probe", cluster, cluster
			var set []string
			for i, f := range fields {
				if pos[i] > 0 {
					f.set(&e, f.values[pos[i]-1])
					set = append(set, fmt.Sprintf("%s %q", f.name, f.values[pos[i]-1]))
				}
			}
			if _, err := run(p, &e); errors.Is(err, ErrBudget) {
				what := pr.what
				if len(set) > 0 {
					what += " with " + strings.Join(set, ", ")
				}
				return fmt.Errorf("refused: on %s, %w; every record like it would be dead-lettered", what, err)
			}
			i := 0
			for ; i < len(pos); i++ {
				if pos[i]++; pos[i] <= len(fields[i].values) {
					break
				}
				pos[i] = 0
			}
			if i == len(pos) {
				break
			}
		}
	}
	return nil
}

const probeKey = "probe-key"

// comparedField is a part of the record an expression compares with
// string constants, and those constants.
type comparedField struct {
	name   string // topic, physical_topic, cluster, origin, key or headers["name"]
	header string
	values []string
}

func (f comparedField) set(e *Env, v string) {
	switch f.name {
	case "topic":
		e.Topic, e.PhysicalTopic = v, v
	case "physical_topic":
		e.PhysicalTopic = v
	case "cluster":
		e.Cluster, e.Origin = v, v
	case "origin":
		e.Origin = v
	case "key":
		e.Key = v
	default:
		e.Headers = maps.Clone(e.Headers)
		if e.Headers == nil {
			e.Headers = map[string]string{}
		}
		e.Headers[f.header] = v
	}
}

// comparedValues returns what src compares with string constants (by ==,
// !=, in, startsWith, endsWith, contains), in a stable order.
func comparedValues(src string) []comparedField {
	tree, err := parser.Parse(src)
	if err != nil {
		return nil
	}
	var c comparisons
	ast.Walk(&tree.Node, &c)
	return c.fields
}

type comparisons struct{ fields []comparedField }

// Visit implements ast.Visitor.
func (c *comparisons) Visit(n *ast.Node) {
	b, ok := (*n).(*ast.BinaryNode)
	if !ok {
		return
	}
	switch b.Operator {
	case "==", "!=", "in", "startsWith", "endsWith", "contains":
	default:
		return
	}
	for _, sides := range [][2]ast.Node{{b.Left, b.Right}, {b.Right, b.Left}} {
		name, header := comparedName(sides[0])
		if name == "" {
			continue
		}
		var values []string
		switch x := sides[1].(type) {
		case *ast.StringNode:
			values = []string{x.Value}
		case *ast.ArrayNode:
			for _, el := range x.Nodes {
				if s, ok := el.(*ast.StringNode); ok {
					values = append(values, s.Value)
				}
			}
		}
		c.add(name, header, values)
	}
}

func (c *comparisons) add(name, header string, values []string) {
	i := slices.IndexFunc(c.fields, func(f comparedField) bool { return f.name == name })
	if i < 0 {
		c.fields = append(c.fields, comparedField{name: name, header: header})
		i = len(c.fields) - 1
	}
	for _, v := range values {
		if !slices.Contains(c.fields[i].values, v) {
			c.fields[i].values = append(c.fields[i].values, v)
		}
	}
}

// comparedName names n if it is a part of the record probes can vary.
func comparedName(n ast.Node) (name, header string) {
	switch x := n.(type) {
	case *ast.IdentifierNode:
		switch x.Value {
		case "topic", "physical_topic", "cluster", "origin", "key":
			return x.Value, ""
		}
	case *ast.MemberNode:
		id, ok1 := x.Node.(*ast.IdentifierNode)
		h, ok2 := x.Property.(*ast.StringNode)
		if ok1 && ok2 && id.Value == "headers" {
			return fmt.Sprintf("headers[%q]", h.Value), h.Value
		}
	}
	return "", ""
}

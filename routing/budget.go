package routing

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/expr-lang/expr"
	"github.com/expr-lang/expr/ast"
	"github.com/expr-lang/expr/vm"
)

// The evaluation budget of one expression on one record. An expression
// without a closure (no all, filter, map, reduce, ...) costs at most its
// size times the record's size, and ranges and builtins such as repeat
// are bounded by expr's own memory budget. Only closures can run for
// long: each run of a closure body counts one iteration and the length of
// the string or collection it built, and the clock is read every
// budgetClockEvery iterations.
const (
	// MaxRuleNodes bounds the size of one expression (expr.MaxNodes).
	MaxRuleNodes = 2000
	// MaxIterations bounds the closure iterations of one evaluation.
	MaxIterations = 100_000
	// MaxBuiltBytes bounds the bytes of the strings and the elements of
	// the collections that closures build in one evaluation
	// (reduce(1..n, #acc + value, "") builds n²/2 × len(value)).
	MaxBuiltBytes = 16 << 20
	// MaxEvalTime bounds one evaluation's time on the clock, for what the
	// counts above do not see.
	MaxEvalTime = 100 * time.Millisecond

	budgetClockEvery = 1024
	// stepFunc and budgetVar are the names the closure bodies are wrapped
	// with: stepFunc(budgetVar, body).
	stepFunc  = "kswitch_step"
	budgetVar = "kswitch_budget"
)

// ErrBudget is the error of an evaluation that exceeded its budget: the
// record goes to the dead-letter channel with the reason.
var ErrBudget = errors.New("the expression exceeded its evaluation budget")

// evalBudget is what one evaluation has spent.
type evalBudget struct {
	iterations int
	built      int
	start      time.Time
}

// step counts one run of a closure body whose value is x.
func (b *evalBudget) step(x any) error {
	if b.iterations == 0 {
		b.start = time.Now()
	}
	b.iterations++
	switch v := x.(type) {
	case string:
		b.built += len(v)
	case []any:
		b.built += 8 * len(v)
	case map[string]any:
		b.built += 16 * len(v)
	}
	switch {
	case b.iterations > MaxIterations:
		return fmt.Errorf("%w: more than %d closure iterations on one record (simplify the rule, or bound its ranges)", ErrBudget, MaxIterations)
	case b.built > MaxBuiltBytes:
		return fmt.Errorf("%w: closures built more than %d MiB on one record (an accumulator that grows with every step?)", ErrBudget, MaxBuiltBytes>>20)
	case b.iterations%budgetClockEvery == 0 && time.Since(b.start) > MaxEvalTime:
		return fmt.Errorf("%w: ran for more than %v on one record", ErrBudget, MaxEvalTime)
	}
	return nil
}

// compileOptions are the options of every routing expression: the
// environment, the size bound and the closure accounting.
func compileOptions(extra ...expr.Option) []expr.Option {
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
	}, extra...)
}

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

// probes are the records every expression is tried on before a version is
// accepted: one that exceeds its budget on them would exceed it on nearly
// every record, so the version is refused instead of dead-lettering all.
var probes = []*Env{
	{Topic: "probe", Cluster: "A", Origin: "A", PhysicalTopic: "probe"},
	{Topic: "probe", Cluster: "A", Origin: "A", PhysicalTopic: "probe", Key: "probe-key",
		Value: `{"probe":"` + strings.Repeat("x", 1000) + `"}`, Headers: map[string]string{"probe": "x"}},
}

// probe runs p on the probe records and returns the budget's error, if
// any (other errors depend on the record and are left to the run).
func probe(p *vm.Program) error {
	for _, e := range probes {
		pe := *e
		if pe.Value != "" {
			pe.JSON = map[string]any{"probe": strings.Repeat("x", 1000)}
		}
		if _, err := run(p, &pe); errors.Is(err, ErrBudget) {
			return fmt.Errorf("refused, it is too costly already on a test record of %d bytes: %w", len(pe.Value), err)
		}
	}
	return nil
}

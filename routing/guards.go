package routing

import (
	"encoding/base64"
	"fmt"
	"math"
	"reflect"
	"regexp"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/expr-lang/expr"
	"github.com/expr-lang/expr/ast"
	"github.com/expr-lang/expr/builtin"
	"github.com/expr-lang/expr/vm/runtime"
)

// The guards of the builtins and operators whose result can be much larger
// than their arguments. allocGuard rewrites each call f(args) into
// guardPrefix+f(budgetVar, args): the guard computes, without allocating,
// an upper bound of the bytes the result holds, charges it to the
// evaluation's budget, and only then calls expr's own implementation.
// Builtins whose result is at most a copy of an argument (trim, sort,
// reverse, keys, …) are not guarded: their argument was counted when it was
// built, or is the record's. Ranges and array literals are bounded by
// expr's own memory budget (a million elements per evaluation), which it
// checks before it allocates.
const guardPrefix = "kswitch_"

// guard is one guarded builtin: cost bounds the bytes of its result from
// its arguments (the budget's room is given so that a walk of a large
// structure stops early: a result over room is refused whatever its exact
// size); expr's own implementation does the work.
type guard struct {
	cost func(args []any, room int) int
	// types are the prototypes without the budget, when they are not
	// expr's own (whose builtin validates its arguments in code).
	types []any
}

// Bytes per element of the slices the guards charge for: an interface or
// a string header.
const sliceElemBytes = 16

var guards = map[string]guard{
	"repeat":     {cost: costRepeat},
	"join":       {cost: costJoin},
	"replace":    {cost: costReplace},
	"split":      {cost: costSplit},
	"splitAfter": {cost: costSplit},
	"upper":      {cost: costCase},
	"lower":      {cost: costCase},
	"toBase64":   {cost: func(args []any, _ int) int { return base64.StdEncoding.EncodedLen(len(str(args[0]))) }},
	"toJSON":     {cost: func(args []any, room int) int { return textBound(args[0], room) }},
	"fromJSON":   {cost: costFromJSON},
	"string":     {cost: costString},
	"concat":     {cost: costConcat, types: []any{new(func(*evalBudget, ...any) []any)}},
	"flatten":    {cost: costFlatten, types: []any{new(func(*evalBudget, any) []any)}},
}

// Names of the guards of the operators + (on strings) and matches (with a
// pattern that is not a constant).
const (
	addGuard     = guardPrefix + "add"
	matchesGuard = guardPrefix + "matches"
)

// guardOptions declares every guard as an expr function, with prototypes
// that keep the builtin's type checks.
func guardOptions() []expr.Option {
	var opts []expr.Option
	for name, g := range guards {
		f := builtin.Builtins[builtin.Index[name]]
		types := g.types
		if types == nil {
			for _, t := range f.Types {
				types = append(types, withBudget(t))
			}
		}
		opts = append(opts, expr.Function(guardPrefix+name, guarded(name, g.cost, builtinCall(f)), types...))
	}
	opts = append(opts,
		expr.Function(addGuard, guarded("+", costAdd, add),
			new(func(*evalBudget, string, string) string), new(func(*evalBudget, any, any) any)),
		expr.Function(matchesGuard, guarded("matches", costMatches, matches),
			new(func(*evalBudget, string, string) bool), new(func(*evalBudget, any, any) bool)))
	return opts
}

var budgetType = reflect.TypeFor[*evalBudget]()

// withBudget returns a pointer to a nil function of prototype t with the
// budget as first argument (expr.Function takes prototypes as values).
func withBudget(t reflect.Type) any {
	in := []reflect.Type{budgetType}
	for i := range t.NumIn() {
		in = append(in, t.In(i))
	}
	out := make([]reflect.Type, t.NumOut())
	for i := range out {
		out[i] = t.Out(i)
	}
	return reflect.New(reflect.FuncOf(in, out, t.IsVariadic())).Interface()
}

// builtinCall is expr's implementation of builtin f as a plain function.
func builtinCall(f *builtin.Function) func(args ...any) (any, error) {
	switch {
	case f.Fast != nil:
		return func(args ...any) (any, error) { return f.Fast(args[0]), nil }
	case f.Safe != nil:
		return func(args ...any) (any, error) {
			out, _, err := f.Safe(args...)
			return out, err
		}
	default:
		return f.Func
	}
}

// guarded is the expr function of a guard: charge, then call.
func guarded(name string, cost func([]any, int) int, call func(...any) (any, error)) func(...any) (any, error) {
	return func(params ...any) (any, error) {
		b, ok := params[0].(*evalBudget)
		if !ok || b == nil {
			return nil, fmt.Errorf("%s%s: the evaluation budget is not set", guardPrefix, name)
		}
		args := params[1:]
		if err := b.charge(name, cost(args, b.room())); err != nil {
			return nil, err
		}
		return call(args...)
	}
}

// allocGuard rewrites the calls of guarded builtins, + whose type is a
// string or unknown (numbers are left to the VM's own opcode), and matches
// with a pattern computed at run time (a constant one is compiled once
// with the program) into calls of their guards.
type allocGuard struct{}

// Visit implements ast.Visitor.
func (allocGuard) Visit(n *ast.Node) {
	switch x := (*n).(type) {
	case *ast.BuiltinNode:
		if _, ok := guards[x.Name]; ok {
			patchCall(n, guardPrefix+x.Name, x.Arguments...)
		}
	case *ast.BinaryNode:
		switch x.Operator {
		case "+":
			if k := x.Type().Kind(); (k == reflect.String || k == reflect.Interface) && !(isConstString(x.Left) && isConstString(x.Right)) {
				patchCall(n, addGuard, x.Left, x.Right)
			}
		case "matches":
			if !isConstString(x.Right) {
				patchCall(n, matchesGuard, x.Left, x.Right)
			}
		}
	}
}

func patchCall(n *ast.Node, name string, args ...ast.Node) {
	ast.Patch(n, &ast.CallNode{
		Callee:    &ast.IdentifierNode{Value: name},
		Arguments: append([]ast.Node{&ast.IdentifierNode{Value: budgetVar}}, args...),
	})
}

// isConstString says whether n is a string literal or a sum of them, which
// expr folds at compile time.
func isConstString(n ast.Node) bool {
	switch x := n.(type) {
	case *ast.StringNode:
		return true
	case *ast.BinaryNode:
		return x.Operator == "+" && isConstString(x.Left) && isConstString(x.Right)
	}
	return false
}

// str is a string argument, or "" (the builtin then reports the type).
func str(a any) string {
	s, _ := a.(string)
	return s
}

// mulSat and addSat are a×b and a+b for non-negative operands, or
// math.MaxInt when that overflows.
func mulSat(a, b int) int {
	if a < 0 || b < 0 {
		return 0
	}
	if a != 0 && b > math.MaxInt/a {
		return math.MaxInt
	}
	return a * b
}

func addSat(a, b int) int {
	if a > math.MaxInt-b {
		return math.MaxInt
	}
	return a + b
}

func costAdd(args []any, _ int) int {
	x, ok1 := args[0].(string)
	y, ok2 := args[1].(string)
	if !ok1 || !ok2 {
		return 0 // numbers, times and durations
	}
	return addSat(len(x), len(y))
}

func add(args ...any) (any, error) {
	if x, ok := args[0].(string); ok {
		if y, ok := args[1].(string); ok {
			return x + y, nil
		}
	}
	return runtime.Add(args[0], args[1]), nil
}

func costRepeat(args []any, _ int) int {
	return mulSat(len(str(args[0])), runtime.ToInt(args[1]))
}

func costJoin(args []any, room int) int {
	n, total := 0, 0
	switch xs := args[0].(type) {
	case []string:
		n = len(xs)
		for _, s := range xs {
			if total = addSat(total, len(s)); total > room {
				return total
			}
		}
	case []any:
		n = len(xs)
		total = mulSat(n, sliceElemBytes) // the []string expr builds first
		for _, x := range xs {
			if total = addSat(total, len(str(x))); total > room {
				return total
			}
		}
	}
	if len(args) == 2 && n > 1 {
		total = addSat(total, mulSat(n-1, len(str(args[1]))))
	}
	return total
}

func costReplace(args []any, _ int) int {
	s, old, repl := str(args[0]), str(args[1]), str(args[2])
	k := strings.Count(s, old)
	if len(args) == 4 {
		if m := runtime.ToInt(args[3]); m >= 0 && m < k {
			k = m
		}
	}
	if k == 0 {
		return 0 // s itself
	}
	return addSat(len(s), mulSat(k, max(len(repl)-len(old), 0)))
}

func costSplit(args []any, _ int) int {
	k := strings.Count(str(args[0]), str(args[1])) + 1
	if len(args) == 3 {
		if m := runtime.ToInt(args[2]); m >= 0 && m < k {
			k = m
		}
	}
	return mulSat(k, sliceElemBytes)
}

// costCase bounds upper and lower: an ASCII byte stays one byte; any other
// byte can become three (a byte of invalid UTF-8 becomes U+FFFD, and a few
// two-byte letters have three-byte cases).
func costCase(args []any, _ int) int {
	s := str(args[0])
	n := len(s) + utf8.UTFMax
	for i := 0; i < len(s); i++ {
		if s[i] >= utf8.RuneSelf {
			n += 2
		}
	}
	return n
}

// costFromJSON bounds what json.Unmarshal builds into an any from s: a
// copy of s, and for each object, array and element the Go values that
// hold them (a small map is about 300 bytes).
func costFromJSON(args []any, _ int) int {
	s := str(args[0])
	n := 2 * len(s)
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '{':
			n += 320
		case '[':
			n += 48
		case ',', ':':
			n += 48
		}
	}
	return n
}

func costString(args []any, room int) int {
	if s, ok := args[0].(string); ok {
		return len(s) // fmt copies it
	}
	return textBound(args[0], room)
}

func costConcat(args []any, _ int) int {
	n := 0
	for _, a := range args {
		if v := reflect.ValueOf(a); v.Kind() == reflect.Slice || v.Kind() == reflect.Array {
			n = addSat(n, v.Len())
		}
	}
	return mulSat(n, sliceElemBytes)
}

// costFlatten counts the leaves flatten collects: a structure that shares
// its parts (let a = [x, x]; let b = [a, a]; …) has exponentially many, so
// the count stops past room.
func costFlatten(args []any, room int) int {
	limit := room/sliceElemBytes + 1
	return mulSat(leaves(reflect.ValueOf(args[0]), 0, limit), sliceElemBytes)
}

func leaves(v reflect.Value, n, limit int) int {
	for v.Kind() == reflect.Pointer || v.Kind() == reflect.Interface {
		if v.IsNil() {
			return n + 1
		}
		v = v.Elem()
	}
	if v.Kind() != reflect.Slice && v.Kind() != reflect.Array {
		return n + 1
	}
	for i := 0; i < v.Len() && n <= limit; i++ {
		n = leaves(v.Index(i), n, limit)
	}
	return n
}

// Bytes per regexp pattern byte: Go's compiled program and its matchers
// take about 240 (measured: a 1 MiB literal allocates 231 MiB to compile,
// an alternation 240 per byte); a counted repetition {n,m} multiplies the
// program by up to 1000, its largest count.
const (
	regexpBytesPerByte = 256
	regexpMaxRepeat    = 1000
)

func costMatches(args []any, _ int) int {
	p := str(args[1])
	n := mulSat(len(p), regexpBytesPerByte)
	for range strings.Count(p, "{") {
		n = mulSat(n, regexpMaxRepeat)
	}
	return n
}

// matches is expr's matches operator on a pattern that is not a constant.
func matches(args ...any) (any, error) {
	if runtime.IsNil(args[0]) || runtime.IsNil(args[1]) {
		return false, nil
	}
	s, ok1 := args[0].(string)
	p, ok2 := args[1].(string)
	if !ok1 || !ok2 {
		return nil, fmt.Errorf("invalid operation: %T matches %T", args[0], args[1])
	}
	return regexp.MatchString(p, s)
}

var timeType = reflect.TypeFor[time.Time]()

// textBound bounds the length of x written by json.MarshalIndent(x, "",
// "  ") (toJSON) and by fmt's %v (string): each value's own text (a
// string's escaped length) plus the punctuation, line and indentation
// around each element. It stops once the length passes room, so that a
// structure sharing its parts costs no more to measure than room.
func textBound(x any, room int) int {
	t := textWalk{room: room}
	t.walk(reflect.ValueOf(x), 0)
	return t.n
}

type textWalk struct{ n, room int }

// maxTextDepth is where textWalk stops counting and declares the text
// too large: json refuses nesting that deep (a cycle) and expr's values
// are never nested that deep.
const maxTextDepth = 10_000

func (t *textWalk) walk(v reflect.Value, depth int) {
	if t.n > t.room {
		return
	}
	if depth > maxTextDepth {
		t.n = math.MaxInt
		return
	}
	// Around every value: a separator, a new line and its indentation,
	// and room for a short word (null, <nil>, true, false, {}, map[]).
	t.n = addSat(t.n, 2*depth+8)
	switch v.Kind() {
	case reflect.Invalid:
	case reflect.String:
		t.n = addSat(t.n, escapedLen(v.String()))
	case reflect.Bool, reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr,
		reflect.Float32, reflect.Float64, reflect.Complex64, reflect.Complex128,
		reflect.Func, reflect.Chan, reflect.UnsafePointer:
		t.n = addSat(t.n, 64) // a number, a duration's text, or an address
	case reflect.Pointer, reflect.Interface:
		if !v.IsNil() {
			t.walk(v.Elem(), depth)
		}
	case reflect.Slice, reflect.Array:
		if v.Kind() == reflect.Slice && v.Type().Elem().Kind() == reflect.Uint8 {
			t.n = addSat(t.n, base64.StdEncoding.EncodedLen(v.Len())) // json's []byte
			return
		}
		for i := 0; i < v.Len() && t.n <= t.room; i++ {
			t.walk(v.Index(i), depth+1)
		}
	case reflect.Map:
		for it := v.MapRange(); it.Next() && t.n <= t.room; {
			t.walk(it.Key(), depth+1)
			t.walk(it.Value(), depth+1)
		}
	case reflect.Struct:
		if v.Type() == timeType {
			t.n = addSat(t.n, 96) // time.Time's String, with its monotonic reading
			return
		}
		for i := 0; i < v.NumField() && t.n <= t.room; i++ {
			t.n = addSat(t.n, len(v.Type().Field(i).Name)+4)
			t.walk(v.Field(i), depth+1)
		}
	}
}

// escapedLen bounds the length of s as a JSON string: quotes, two bytes
// for an escaped quote, backslash or control character, six for the
// others json escapes (<, >, &, U+2028, U+2029, invalid UTF-8 as \ufffd).
func escapedLen(s string) int {
	n := 2
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\' || c == '\n' || c == '\r' || c == '\t':
				n += 2
			case c < 0x20 || c == '<' || c == '>' || c == '&':
				n += 6
			default:
				n++
			}
			i++
			continue
		}
		r, w := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError || r == '\u2028' || r == '\u2029' {
			n += 6
		} else {
			n += w
		}
		i += w
	}
	return n
}

package routing

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/expr-lang/expr/conf"
	"github.com/expr-lang/expr/vm"

	"github.com/kswitch/kswitch/record"
)

// Env is what routing expressions see of a record, by the names in the
// expr tags.
type Env struct {
	// Topic is the source topic's logical name (record.Record.SourceTopic,
	// else Topic): the same on the primary and on a standby replica.
	Topic     string `expr:"topic"`
	Partition int    `expr:"partition"`
	Offset    int    `expr:"offset"`
	// Key and Value are the record's bytes as strings; a missing key is "".
	Key   string `expr:"key"`
	Value string `expr:"value"`
	// JSON is the value parsed as JSON, or nil when it is not JSON.
	JSON any `expr:"json"`
	// Headers maps each header name to its value (the last one when a name
	// repeats).
	Headers   map[string]string `expr:"headers"`
	Timestamp time.Time         `expr:"timestamp"`
	// Cluster is the cluster the record was consumed from.
	Cluster string `expr:"cluster"`
	// PhysicalTopic is the topic's name on Cluster (A.orders for a copy
	// of A's orders on B), and Origin the cluster whose producers wrote
	// the record (A for both A's orders and B's A.orders).
	PhysicalTopic string `expr:"physical_topic"`
	Origin        string `expr:"origin"`

	// Budget is what the running evaluation has spent: the argument of
	// the calls every closure body is wrapped in (budget.go).
	Budget *evalBudget `expr:"kswitch_budget"`
	budget evalBudget
	// recordBytes is the size of the record's key and value, read or not:
	// the budget grows with it.
	recordBytes int
}

// env builds the environment of r, with only the parts the version's
// expressions read: a rule that looks at the topic alone parses no JSON.
func (v *Version) env(r *record.Record) *Env {
	e := &Env{
		Topic: cmp.Or(r.SourceTopic, r.Topic), Partition: int(r.Partition), Offset: int(r.Offset),
		Timestamp: r.Timestamp, Cluster: r.Cluster, PhysicalTopic: r.Topic, Origin: cmp.Or(r.Origin, r.Cluster),
		recordBytes: len(r.Key) + len(r.Value),
	}
	if v.needs.key {
		e.Key = string(r.Key)
	}
	if v.needs.value {
		e.Value = string(r.Value)
	}
	if v.needs.json {
		var j any
		if json.Unmarshal(r.Value, &j) == nil {
			e.JSON = j
		}
	}
	if v.needs.headers {
		e.Headers = make(map[string]string, len(r.Headers))
		for _, h := range r.Headers {
			e.Headers[string(h.Key)] = string(h.Value)
		}
	}
	return e
}

// EvalError is a rule's match or a channel's key expression that failed
// on a record.
type EvalError struct {
	// Rule is the rule being evaluated, or that routed the record to
	// Channel.
	Rule string
	// Channel is set when the channel's key expression failed.
	Channel string
	Err     error
}

func (e *EvalError) Error() string {
	if e.Channel != "" {
		return fmt.Sprintf("routing: channel %s key (record routed by rule %s): %v", e.Channel, e.Rule, e.Err)
	}
	return fmt.Sprintf("routing: rule %s: %v", e.Rule, e.Err)
}

func (e *EvalError) Unwrap() error { return e.Err }

// target is one channel a record goes to, and the rule that sent it there
// ("" for the default route).
type target struct {
	ch   *channel
	rule string
}

// Drop reasons, the values of the reason label of the dropped metric.
const (
	DropRule    = "rule"     // a drop rule matched
	DropNoMatch = "no_match" // no rule matched and there is no default route
)

// decision is where the rules send one record.
type decision struct {
	targets  []target
	matched  []*rule // the rules that matched, in order
	drop     string  // DropRule, DropNoMatch or ""
	dropRule string
}

// partitionKey identifies a consumed partition by its physical topic (a
// logical topic's copies are told apart by origin and physical_topic):
// the key of Version.decisions.
type partitionKey struct {
	cluster, topic string
	partition      int32
}

// decide returns where v's rules send r, and r's environment when it was
// built (nil otherwise: the decision was known for r's partition). The
// decision must not be changed.
func (v *Version) decide(r *record.Record) (*decision, *Env, error) {
	if v.decisions == nil {
		e := v.env(r)
		d, err := v.route(e)
		return &d, e, err
	}
	k := partitionKey{r.Cluster, r.Topic, r.Partition}
	slot := &v.recent[uint32(k.partition)%uint32(len(v.recent))]
	if kd := slot.Load(); kd != nil && kd.key == k {
		return kd.d, nil, nil
	}
	if d, ok := v.decisions.Load(k); ok {
		slot.Store(&keptDecision{k, d.(*decision)})
		return d.(*decision), nil, nil
	}
	e := v.env(r)
	d, err := v.route(e)
	if err != nil {
		return nil, e, err // not kept: the next record is evaluated again
	}
	v.decisions.Store(k, &d)
	slot.Store(&keptDecision{k, &d})
	return &d, e, nil
}

// keptDecision is a partition's decision in Version.recent.
type keptDecision struct {
	key partitionKey
	d   *decision
}

// route evaluates the rules against e.
func (v *Version) route(e *Env) (decision, error) {
	var d decision
	add := func(ch *channel, rule string) {
		for _, t := range d.targets {
			if t.ch == ch {
				return
			}
		}
		d.targets = append(d.targets, target{ch, rule})
	}
	for _, r := range v.rules {
		if r.match != nil {
			out, err := run(r.match, e)
			if err != nil {
				return decision{}, &EvalError{Rule: r.name, Err: err}
			}
			if ok, _ := out.(bool); !ok {
				continue
			}
		}
		d.matched = append(d.matched, r)
		if r.drop {
			if len(d.targets) == 0 {
				d.drop, d.dropRule = DropRule, r.name
			}
			return d, nil
		}
		for _, ch := range r.channels {
			add(ch, r.name)
		}
		if v.spec.Mode == ModeFirst {
			return d, nil
		}
	}
	if len(d.matched) == 0 {
		for _, ch := range v.defaults {
			add(ch, "")
		}
		if len(d.targets) == 0 {
			d.drop = DropNoMatch
		}
	}
	return d, nil
}

// keyOf returns the key of r on channel c of version v. *e is r's
// environment, built here when nil.
func (c *channel) keyOf(e **Env, v *Version, r *record.Record) ([]byte, error) {
	if c.key == nil {
		return r.Key, nil
	}
	if *e == nil {
		*e = v.env(r)
	}
	out, err := run(c.key, *e)
	if err != nil {
		return nil, err
	}
	return toBytes(out, budgetBytes((*e).recordBytes))
}

// vms are reusable expression machines: a VM allocates its stack once.
var vms = sync.Pool{New: func() any { return new(vm.VM) }}

// run evaluates p over e; its error is on one line.
func run(p *vm.Program, e *Env) (any, error) {
	e.budget = evalBudget{limit: budgetBytes(e.recordBytes)}
	e.Budget = &e.budget
	m := vms.Get().(*vm.VM)
	out, err := m.Run(p, e)
	vms.Put(m)
	if err != nil {
		switch msg := exprError(err); {
		case errors.Is(err, ErrBudget):
			return nil, budgetError{msg}
		case strings.Contains(msg, "memory budget exceeded"):
			return nil, budgetError{fmt.Sprintf("%v: %s (ranges, arrays and expr's own builtins hold at most %d elements per evaluation)", ErrBudget, msg, conf.DefaultMemoryBudget)}
		}
		return nil, errors.New(clip(exprError(err)))
	}
	return out, nil
}

// maxErrorBytes bounds an evaluation error's text: errors such as
// strconv's quote the record's bytes, and the text becomes a dead
// letter's header.
const maxErrorBytes = 1024

// clip cuts msg to maxErrorBytes, on a rune boundary, saying how long it was.
func clip(msg string) string {
	if len(msg) <= maxErrorBytes {
		return msg
	}
	cut := maxErrorBytes
	for cut > 0 && !utf8.RuneStart(msg[cut]) {
		cut--
	}
	return fmt.Sprintf("%s… (%d bytes cut)", msg[:cut], len(msg)-cut)
}

// budgetError is an evaluation that exceeded its budget, on one line.
type budgetError struct{ msg string }

func (e budgetError) Error() string { return e.msg }

// Is makes a budgetError an ErrBudget.
func (e budgetError) Is(target error) bool { return target == ErrBudget }

// toBytes converts an expression's value to a record key: strings and
// bytes as they are, nil as no key, numbers and booleans in their usual
// text, anything else as JSON if that takes at most budget bytes.
func toBytes(v any, budget int) ([]byte, error) {
	switch x := v.(type) {
	case nil:
		return nil, nil
	case string:
		return []byte(x), nil
	case []byte:
		return x, nil
	case bool:
		return strconv.AppendBool(nil, x), nil
	case int:
		return strconv.AppendInt(nil, int64(x), 10), nil
	case int64:
		return strconv.AppendInt(nil, x, 10), nil
	case float64:
		return strconv.AppendFloat(nil, x, 'g', -1, 64), nil
	default:
		if n := textBound(x, budget); n > budget {
			return nil, budgetError{fmt.Sprintf("%v: the key expression's value %T would be %s of JSON, over the %s this record allows", ErrBudget, v, sizeText(n), sizeText(budget))}
		}
		b, err := json.Marshal(x)
		if err != nil {
			return nil, fmt.Errorf("the key expression's value %T cannot be a key: %w", v, err)
		}
		return b, nil
	}
}

// Decision says where Route sends a record.
type Decision struct {
	// Channels receive the record, in the order the rules chose them.
	Channels []string `json:"channels"`
	// Keys are the keys the record gets on each of Channels (nil: no key).
	Keys [][]byte `json:"-"`
	// Rules are the rules that matched, in order of evaluation.
	Rules []string `json:"rules"`
	// Dropped is DropRule, DropNoMatch, or "" when the record goes
	// somewhere.
	Dropped string `json:"dropped,omitempty"`
	// DropRule is the drop rule that matched.
	DropRule string `json:"drop_rule,omitempty"`
}

// Route evaluates the rules and the channels' key expressions for r
// without producing anything (for 'kswitch routes check'). The error is an
// *EvalError: the record would go to the dead-letter channel.
func (v *Version) Route(r *record.Record) (Decision, error) {
	d, e, err := v.decide(r)
	if err != nil {
		return Decision{}, err
	}
	out := Decision{Dropped: d.drop, DropRule: d.dropRule}
	for _, r := range d.matched {
		out.Rules = append(out.Rules, r.name)
	}
	for _, t := range d.targets {
		k, err := t.ch.keyOf(&e, v, r)
		if err != nil {
			return Decision{}, &EvalError{Rule: cmp.Or(t.rule, "default"), Channel: t.ch.Name, Err: err}
		}
		out.Channels = append(out.Channels, t.ch.Name)
		out.Keys = append(out.Keys, k)
	}
	return out, nil
}

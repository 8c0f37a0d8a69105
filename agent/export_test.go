package agent

// Hooks are the knobs of the agent's tests and benchmarks (see hooks).
type Hooks = hooks

// WithHooks returns o with the test knobs h.
func WithHooks(o Options, h Hooks) Options {
	o.hooks = h
	return o
}

package agent

// Hooks are the knobs of the agent's tests and benchmarks (see hooks).
type Hooks = hooks

// WithHooks returns o with the test knobs h.
func WithHooks(o Options, h Hooks) Options {
	o.hooks = h
	return o
}

// PushPullInterval is how often gossip exchanges every member's state over
// TCP: the longest a view whose broadcasts were lost takes to arrive.
const PushPullInterval = pushPullInterval

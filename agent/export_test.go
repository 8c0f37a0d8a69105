package agent

import "os"

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

// Timeline is the status page's switch timeline of evs.
var Timeline = timeline

// KSWITCH_RELAY_PATH (sarama or direct) is the path of the agents the
// tests start without Options.Fetch: the whole suite runs on either.
func init() {
	if p := os.Getenv("KSWITCH_RELAY_PATH"); p != "" {
		defaultFetch = p
	}
}

// RelayPath is the path of the agents started without Options.Fetch.
func RelayPath() string { return defaultFetch }

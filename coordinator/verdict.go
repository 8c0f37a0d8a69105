package coordinator

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/state"
)

// health follows, on the leader's clock, how long each live agent has seen
// each cluster down, and how long a quorum has seen it up. Using the
// leader's clock (when it first saw an agent's view flip) keeps agents'
// clock skew out of the verdict.
type health struct {
	downSince map[string]map[string]time.Time // cluster → agent → since
	refused   map[string]map[string]bool      // cluster → agent → its last failed probe was refused (ClusterView.Refused)
	upSince   map[string]time.Time            // cluster → quorum up since
}

func newHealth() *health {
	return &health{downSince: map[string]map[string]time.Time{}, refused: map[string]map[string]bool{}, upSince: map[string]time.Time{}}
}

// observe records the views of the live agents at now.
func (h *health) observe(now time.Time, live []string, views AgentViews, clusters []string) {
	for _, c := range clusters {
		ds := h.downSince[c]
		if ds == nil {
			ds = map[string]time.Time{}
			h.downSince[c] = ds
		}
		rf := map[string]bool{}
		h.refused[c] = rf
		seen := map[string]bool{}
		for _, a := range live {
			seen[a] = true
			v, ok := views[a][c]
			if ok && !v.Reachable {
				rf[a] = v.Refused
				if _, was := ds[a]; !was {
					// Since the agent's last contact, as far as it
					// says: a duration, so no clock skew; the gossip
					// delay only makes it later.
					ds[a] = now.Add(-time.Duration(max(0, min(v.FailingMs, maxFailingMs))) * time.Millisecond)
				}
			} else {
				delete(ds, a)
			}
		}
		for a := range ds {
			if !seen[a] {
				delete(ds, a)
			}
		}
		if h.quorumUp(c, live, views) {
			if _, was := h.upSince[c]; !was {
				h.upSince[c] = now
			}
		} else {
			delete(h.upSince, c)
		}
	}
}

// maxFailingMs bounds how far back an agent's report moves the start of
// its failure: a day, far beyond any failure window.
const maxFailingMs = int64(24 * time.Hour / time.Millisecond)

func quorum(n int) int { return n/2 + 1 }

// nextDown returns how long after now the failure window of one more agent
// that sees cluster down ends (when the verdict must be looked at again),
// or false when none is pending.
func (h *health) nextDown(now time.Time, cluster string, window time.Duration) (time.Duration, bool) {
	var next time.Duration
	found := false
	for _, since := range h.downSince[cluster] {
		if d := since.Add(window).Sub(now); d > 0 && (!found || d < next) {
			next, found = d, true
		}
	}
	return next, found
}

// down reports whether a quorum of live agents has seen cluster down for
// at least window, with the count for messages.
func (h *health) down(now time.Time, cluster string, live []string, window time.Duration) (bool, int) {
	n := 0
	for _, since := range h.downSince[cluster] {
		if now.Sub(since) >= window {
			n++
		}
	}
	return len(live) > 0 && n >= quorum(len(live)), n
}

// seenDown returns, sorted, the live agents whose last view of cluster is
// unreachable (for however long).
func (h *health) seenDown(cluster string) []string {
	out := make([]string, 0, len(h.downSince[cluster]))
	for a := range h.downSince[cluster] {
		out = append(out, a)
	}
	slices.Sort(out)
	return out
}

// hardDown reports whether every live agent has seen cluster down for at
// least window with every broker refusing connections: nothing listens, so
// the short window is enough. False when window is 0.
func (h *health) hardDown(now time.Time, cluster string, live []string, window time.Duration) bool {
	if window <= 0 || len(live) == 0 {
		return false
	}
	for _, a := range live {
		since, ok := h.downSince[cluster][a]
		if !ok || !h.refused[cluster][a] || now.Sub(since) < window {
			return false
		}
	}
	return true
}

// quorumUp reports whether a quorum of live agents reaches cluster now.
func (h *health) quorumUp(cluster string, live []string, views AgentViews) bool {
	n := 0
	for _, a := range live {
		if v, ok := views[a][cluster]; ok && v.Reachable {
			n++
		}
	}
	return len(live) > 0 && n >= quorum(len(live))
}

// upFor returns how long a quorum has continuously reached cluster.
func (h *health) upFor(now time.Time, cluster string) time.Duration {
	since, ok := h.upSince[cluster]
	if !ok {
		return 0
	}
	return now.Sub(since)
}

// cutOff returns the live agents that have not reached cluster for the
// failure window while a quorum reaches it: they alone are cut off, so
// they get no partitions (the others consume them). While the cluster is
// not reachable by a quorum nobody is cut off: that is the verdict's
// business, and moving partitions between agents that all fail to reach
// the cluster would only churn.
func (h *health) cutOff(now time.Time, cluster string, window time.Duration) map[string]bool {
	if !h.quorumUpNow(cluster) {
		return map[string]bool{}
	}
	return h.downFor(now, cluster, window)
}

// downFor returns the agents that have reported cluster unreachable for at
// least window at now, whether or not the others reach it: the owners that
// cannot consume their partitions there.
func (h *health) downFor(now time.Time, cluster string, window time.Duration) map[string]bool {
	out := map[string]bool{}
	for a, since := range h.downSince[cluster] {
		if now.Sub(since) >= window {
			out[a] = true
		}
	}
	return out
}

// breaker stops automatic switching after too many switches that failed or
// flapped within a window.
type breaker struct {
	cfg       config.Failover
	events    []time.Time // automatic switches and failed attempts
	failures  []time.Time
	openUntil time.Time
}

// record notes an automatic switch (failed or not) at now and reports
// whether the breaker tripped.
func (b *breaker) record(now time.Time, failed bool) bool {
	keep := func(ts []time.Time) []time.Time {
		out := ts[:0]
		for _, t := range ts {
			if now.Sub(t) < b.cfg.BreakerWindow {
				out = append(out, t)
			}
		}
		return out
	}
	b.events = append(keep(b.events), now)
	if failed {
		b.failures = append(keep(b.failures), now)
	} else {
		b.failures = keep(b.failures)
	}
	// The first switch in a window is a failover; each further one in the
	// same window reverses or repeats it: a flap.
	flaps := len(b.events) - len(b.failures) - 1
	if len(b.failures)+max(0, flaps) >= b.cfg.MaxFailedSwitches {
		b.openUntil = now.Add(b.cfg.BreakerCooldown)
		b.events, b.failures = nil, nil
		return true
	}
	return false
}

func (b *breaker) open(now time.Time) bool { return now.Before(b.openUntil) }

// decision is what the verdict asks the leader to do.
type decision struct {
	to     string
	reason string
	auto   bool // counts for the breaker
}

// verdict decides whether the fleet should switch clusters now. It is pure:
// everything it needs is passed in.
type verdictInput struct {
	now    time.Time
	active state.Active
	// sources are the source clusters in order of preference, the
	// primary first.
	sources []string
	pin     string
	live    []string
	h       *health
	b       *breaker
	cfg     config.Failover
	// caughtUp reports whether cluster `to` holds everything the fleet
	// consumed where it is; called only when a failback there is
	// otherwise due.
	caughtUp func(to string) (bool, string)
}

func verdict(in verdictInput) (decision, string) {
	if in.active.Phase != state.PhaseActive {
		return decision{}, "a switch is in progress"
	}
	cur := in.active.Cluster
	if in.pin != "" {
		if in.pin == cur {
			return decision{}, "pinned to " + cur
		}
		if !in.h.quorumUpNow(in.pin) {
			return decision{}, fmt.Sprintf("pinned to %s, which a quorum of agents cannot reach yet", in.pin)
		}
		return decision{to: in.pin, reason: "manual: pinned to " + in.pin}, ""
	}
	if in.b.open(in.now) {
		return decision{}, fmt.Sprintf("circuit breaker open until %s", in.b.openUntil.Format(time.RFC3339))
	}
	others := slices.DeleteFunc(slices.Clone(in.sources), func(c string) bool { return c == cur })
	if len(others) == 0 {
		return decision{}, "no standby configured"
	}
	down, n := in.h.down(in.now, cur, in.live, in.cfg.FailureWindow)
	hard := !down && in.h.hardDown(in.now, cur, in.live, in.cfg.HardFailureWindow)
	if down || hard {
		// The most preferred other cluster a quorum reaches.
		i := slices.IndexFunc(others, in.h.quorumUpNow)
		switch {
		case i < 0 && len(others) == 1:
			return decision{}, fmt.Sprintf("%s is down but %s is not reachable by a quorum either", cur, others[0])
		case i < 0:
			return decision{}, fmt.Sprintf("%s is down and none of %s is reachable by a quorum", cur, strings.Join(others, ", "))
		}
		other := others[i]
		reason := fmt.Sprintf("failover: %s unreachable from %d of %d agents for %s", cur, n, len(in.live), in.cfg.FailureWindow)
		if hard {
			reason = fmt.Sprintf("failover: every broker of %s refused the connections of all %d agents for %s", cur, len(in.live), in.cfg.HardFailureWindow)
		}
		return decision{to: other, auto: true, reason: reason}, ""
	}
	if ahead := in.sources[:rankIn(in.sources, cur)]; len(ahead) > 0 && in.cfg.Failback == "auto" {
		return failback(in, ahead)
	}
	if seen := in.h.seenDown(cur); len(seen) > 0 {
		// Not (yet) a verdict: say who sees it, so that an operator (and a
		// failing test) can tell a failure that is being timed from a
		// view that never reached the leader.
		return decision{}, fmt.Sprintf("%s unreachable from %s: %d of %d agents for %s, a failover needs %d",
			cur, strings.Join(seen, ", "), n, len(in.live), in.cfg.FailureWindow, quorum(len(in.live)))
	}
	return decision{}, ""
}

// failback decides a failback to the most preferred of the clusters ahead
// of the active one (in order) that has been healthy for failback_stable,
// once it holds what the fleet consumed: directly, not through the
// clusters between (D → A, not D → B → A: each switch costs a release, a
// translation and, at least once, its rewinds). While that cluster
// catches up, the fleet waits where it is rather than move to one between.
func failback(in verdictInput, ahead []string) (decision, string) {
	for _, c := range ahead {
		up := in.h.upFor(in.now, c)
		if up < in.cfg.FailbackStable {
			continue
		}
		if ok, why := in.caughtUp(c); !ok {
			return decision{}, fmt.Sprintf("%s is healthy but not caught up: %s", c, why)
		}
		return decision{to: c, auto: true, reason: fmt.Sprintf("failback: %s healthy for %s and caught up", c, up.Round(time.Second))}, ""
	}
	up := in.h.upFor(in.now, ahead[0])
	return decision{}, fmt.Sprintf("waiting for %s to be healthy for %s (%s so far)", ahead[0], in.cfg.FailbackStable, up.Round(time.Second))
}

// rankIn is cluster's place in sources, len(sources) when it is not one.
func rankIn(sources []string, cluster string) int {
	if i := slices.Index(sources, cluster); i >= 0 {
		return i
	}
	return len(sources)
}

// quorumUpNow reports whether a quorum reached cluster at the last observe.
func (h *health) quorumUpNow(cluster string) bool {
	_, ok := h.upSince[cluster]
	return ok
}

//go:build chaos

package chaos

import (
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strings"
	"time"
)

// Kind is a kind of fault the nemesis injects.
type Kind string

// The kinds of fault, each healed after a drawn time.
const (
	AgentKill   Kind = "agent-kill"   // SIGKILL an agent; heal: start it again
	AgentStop   Kind = "agent-stop"   // SIGSTOP an agent; heal: SIGCONT
	LeaderKill  Kind = "leader-kill"  // SIGKILL whichever agent leads when it fires; heal: start it again
	KafkaStop   Kind = "kafka-stop"   // a cluster's listeners close (connection refused); heal: restart on its data
	KafkaFail   Kind = "kafka-fail"   // every request closes its connection; heal: recover
	KafkaHang   Kind = "kafka-hang"   // requests are never answered; heal: recover
	MirrorHold  Kind = "mirror-hold"  // a mirror stops copying; heal: release
	EtcdStop    Kind = "etcd-stop"    // etcd stops; heal: restart on its data
	KafkaSlow   Kind = "kafka-slow"   // every request of a cluster waits 0-400 ms first; heal: recover
	KafkaStarve Kind = "kafka-starve" // fetches answered at once with no records, all else served; heal: recover
)

// kindSpec says what a kind targets, how long its faults last and how
// the run injects and heals one.
type kindSpec struct {
	kind     Kind
	targets  []string
	min, max time.Duration
	// apply injects the fault on target, or heals it. target is the
	// drawn one, except for leader-kill: the agent resolved when it
	// fired.
	apply func(r *run, target string, heal bool) error
}

// processKinds are the faults of processes: agents, clusters, mirrors,
// etcd.
var processKinds = []kindSpec{
	{AgentKill, agentIDs, 2 * time.Second, 15 * time.Second, (*run).applyAgentKill},
	{AgentStop, agentIDs, 2 * time.Second, 12 * time.Second, (*run).applyAgentStop},
	{LeaderKill, []string{"leader"}, 2 * time.Second, 15 * time.Second, (*run).applyAgentKill},
	{KafkaStop, []string{"A", "B", "C"}, 3 * time.Second, 20 * time.Second, stackFault("restart", "stop")},
	{KafkaFail, []string{"A", "B", "C"}, 3 * time.Second, 20 * time.Second, stackFault("recover", "fail")},
	{KafkaHang, []string{"A", "B", "C"}, 3 * time.Second, 20 * time.Second, stackFault("recover", "hang")},
	{MirrorHold, []string{"mirror-AB", "mirror-BA"}, 5 * time.Second, 30 * time.Second, stackFault("release", "hold")},
	{EtcdStop, []string{"etcd"}, 2 * time.Second, 10 * time.Second, stackFault("restart", "stop")},
	{KafkaSlow, []string{"A", "B", "C"}, 5 * time.Second, 30 * time.Second, stackFault("recover", "slow")},
	{KafkaStarve, []string{"A", "B", "C"}, 3 * time.Second, 20 * time.Second, stackFault("recover", "starve")},
}

// kinds are every kind the nemesis draws from, in a fixed order (a
// timeline is a function of it: adding a kind changes what a seed draws).
var kinds = slices.Concat(processKinds, opKinds, switchKinds, netKinds)

// kindSpecOf returns k's spec.
func kindSpecOf(k Kind) (kindSpec, bool) {
	for _, s := range kinds {
		if s.kind == k {
			return s, true
		}
	}
	return kindSpec{}, false
}

// agentIDs are the fleet's agents.
var agentIDs = []string{"agent-1", "agent-2", "agent-3"}

// Fault is one fault of a timeline: injected At and healed at Heal, both
// from the start of the run.
type Fault struct {
	N      int // its number in the timeline, from 1
	At     time.Duration
	Heal   time.Duration
	Kind   Kind
	Target string
}

func (f Fault) String() string {
	return fmt.Sprintf("#%-2d %7.1fs-%7.1fs  %-11s %s", f.N, f.At.Seconds(), f.Heal.Seconds(), f.Kind, f.Target)
}

// Plan is what a timeline is drawn from.
type Plan struct {
	Seed     uint64
	Duration time.Duration
	// Kinds narrows the faults (CHAOS_FAULTS); empty: every kind.
	Kinds []Kind
	// Warmup is the calm at the start (the fleet forms and consumes);
	// Quiet is the calm at the end: every fault is healed Quiet before
	// Duration.
	Warmup, Quiet time.Duration
	// MeanGap is the mean time between two faults' injections.
	MeanGap time.Duration
}

// ParseKinds reads CHAOS_FAULTS: kinds or prefixes of kinds ("agent",
// "kafka"), comma-separated.
func ParseKinds(s string) ([]Kind, error) {
	var out []Kind
	for _, w := range strings.Split(s, ",") {
		w = strings.TrimSpace(w)
		if w == "" {
			continue
		}
		n := 0
		for _, k := range kinds {
			if string(k.kind) == w || strings.HasPrefix(string(k.kind), w+"-") {
				if !slices.Contains(out, k.kind) {
					out = append(out, k.kind)
				}
				n++
			}
		}
		if n == 0 {
			var all []string
			for _, k := range kinds {
				all = append(all, string(k.kind))
			}
			return nil, fmt.Errorf("chaos: CHAOS_FAULTS: %q names no fault (kinds: %s)", w, strings.Join(all, ", "))
		}
	}
	return out, nil
}

// Timeline draws the faults of p. It is a function of p alone: the same
// seed, duration and kinds give the same timeline. Faults overlap, but a
// target has one fault at a time (a draw on a busy target is dropped, its
// numbers drawn all the same).
func (p Plan) Timeline() []Fault {
	rng := rand.New(rand.NewPCG(p.Seed, p.Seed^0x9e3779b97f4a7c15))
	var specs []kindSpec
	for _, k := range kinds {
		if len(p.Kinds) == 0 || slices.Contains(p.Kinds, k.kind) {
			specs = append(specs, k)
		}
	}
	end := p.Duration - p.Quiet
	busy := map[string]time.Duration{} // target → when its fault heals
	var out []Fault
	for t := p.Warmup; ; {
		t += time.Duration(rng.ExpFloat64() * float64(p.MeanGap))
		t = t.Round(100 * time.Millisecond)
		spec := specs[rng.IntN(len(specs))]
		target := spec.targets[rng.IntN(len(spec.targets))]
		dur := spec.min + time.Duration(rng.Int64N(int64(spec.max-spec.min)))
		dur = dur.Round(100 * time.Millisecond)
		if t+spec.min > end {
			break
		}
		heal := min(t+dur, end)
		occupies := append([]string{target}, alsoBusy[spec.kind]...)
		if anyBusy(busy, occupies, t) || (target == "leader" && anyBusy(busy, agentIDs, t)) ||
			(slices.Contains(agentIDs, target) && busy["leader"] > t) {
			continue
		}
		for _, x := range occupies {
			busy[x] = heal
		}
		out = append(out, Fault{N: len(out) + 1, At: t, Heal: heal, Kind: spec.kind, Target: target})
	}
	return out
}

func anyBusy(busy map[string]time.Duration, targets []string, t time.Duration) bool {
	for _, x := range targets {
		if busy[x] > t {
			return true
		}
	}
	return false
}

// PrintTimeline writes the timeline, one fault a line.
func PrintTimeline(w io.Writer, p Plan, faults []Fault, upTo time.Duration) {
	fmt.Fprintf(w, "chaos timeline: seed %d, duration %v, faults %s, %d faults%s\n", p.Seed, p.Duration, kindsString(p.Kinds), len(faults), upToString(upTo))
	for _, f := range faults {
		if upTo > 0 && f.At > upTo {
			break
		}
		fmt.Fprintf(w, "  %s\n", f)
	}
}

func upToString(upTo time.Duration) string {
	if upTo <= 0 {
		return ""
	}
	return fmt.Sprintf(" (those injected up to %.1fs)", upTo.Seconds())
}

func kindsString(ks []Kind) string {
	if len(ks) == 0 {
		return "all"
	}
	s := make([]string, len(ks))
	for i, k := range ks {
		s[i] = string(k)
	}
	return strings.Join(s, ",")
}

//go:build integration

package integration

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"
)

// The nemesis of TestChaosOnRealKafka: a timeline of faults drawn from a
// seed, limited to what real processes allow (signals). It is drawn the
// way make chaos draws its own (integration/chaos/nemesis.go: exponential
// gaps, a drawn length per fault, one fault at a time per target), but
// from its own table: that package's kinds are bound to its embedded
// stack's driver, and the faults here are signals to processes.

// chaosKind is a kind of fault on real processes, healed after a drawn
// time.
type chaosKind struct {
	name     string
	targets  []string
	min, max time.Duration
}

// The kinds, in a fixed order: a timeline is a function of this table,
// so adding or reordering a kind changes what every seed draws.
var chaosKinds = []chaosKind{
	{"agent-kill", chaosAgents, 2 * time.Second, 15 * time.Second},              // SIGKILL; heal: started again (same id, ports)
	{"agent-stop", chaosAgents, 2 * time.Second, 12 * time.Second},              // SIGSTOP; heal: SIGCONT
	{"leader-kill", []string{"leader"}, 2 * time.Second, 15 * time.Second},      // SIGKILL of whoever leads when it fires
	{"broker-kill", []string{"A", "B", "C"}, 3 * time.Second, 20 * time.Second}, // SIGKILL; heal: started again on its data
	{"broker-stop", []string{"A", "B", "C"}, 3 * time.Second, 20 * time.Second}, // SIGSTOP (a hung broker); heal: SIGCONT
	{"mirror-stop", []string{"mirrormaker"}, 5 * time.Second, 30 * time.Second}, // SIGSTOP of MirrorMaker 2, both flows; heal: SIGCONT
	{"etcd-kill", chaosEtcd, 2 * time.Second, 10 * time.Second},                 // SIGKILL of a member; heal: started again on its data
	{"etcd-stop", chaosEtcd, 2 * time.Second, 10 * time.Second},                 // SIGSTOP of a member; heal: SIGCONT
	// The network between an agent and a cluster: the link of that
	// cluster in the agent's SOCKS5 proxy (integration/netfault).
	{"net-cut", chaosLinks, 2 * time.Second, 12 * time.Second},       // connections closed, new ones refused; heal: healthy
	{"net-blackhole", chaosLinks, 2 * time.Second, 12 * time.Second}, // bytes dropped both ways, nothing closed; heal: healthy
	{"net-slow", chaosLinks, 5 * time.Second, 20 * time.Second},      // 250 ms ± 100 ms each way, 100 kB/s; heal: healthy
}

var (
	chaosAgents = []string{"agent-1", "agent-2", "agent-3"}
	chaosEtcd   = []string{"etcd0", "etcd1", "etcd2"}
	// chaosLinks name the links agent>cluster.
	chaosLinks = []string{"agent-1>A", "agent-1>B", "agent-1>C", "agent-2>A", "agent-2>B", "agent-2>C", "agent-3>A", "agent-3>B", "agent-3>C"}
)

// chaosFault is one fault of a timeline, injected At and healed at Heal,
// from the nemesis's start.
type chaosFault struct {
	N        int // from 1
	At, Heal time.Duration
	Kind     string
	Target   string
}

func (f chaosFault) String() string {
	return fmt.Sprintf("#%-2d %6.1fs-%6.1fs  %-11s %s", f.N, f.At.Seconds(), f.Heal.Seconds(), f.Kind, f.Target)
}

// chaosPlan is what a timeline is drawn from.
type chaosPlan struct {
	Seed     uint64
	Duration time.Duration
	// Warmup is the calm at the start; every fault is healed Quiet before
	// Duration.
	Warmup, Quiet time.Duration
	MeanGap       time.Duration // mean time between two injections
}

// exclusion is what a fault on target keeps busy: the target itself, or
// for an etcd member the cluster's quorum (one member down at a time:
// etcd with no quorum is make chaos's etcd-stop), and for the leader
// every agent.
func exclusion(target string) string {
	if strings.HasPrefix(target, "etcd") {
		return "etcd"
	}
	return target
}

// timeline draws p's faults. It is a function of p alone. Faults overlap,
// except on one target (an agent and leader-kill, two etcd members): a
// draw on a busy target is dropped, its numbers drawn all the same.
func (p chaosPlan) timeline() []chaosFault {
	rng := rand.New(rand.NewPCG(p.Seed, p.Seed^0x9e3779b97f4a7c15))
	end := p.Duration - p.Quiet
	busy := map[string]time.Duration{} // exclusion → when its fault heals
	var out []chaosFault
	for t := p.Warmup; ; {
		t += time.Duration(rng.ExpFloat64() * float64(p.MeanGap)).Round(100 * time.Millisecond)
		k := chaosKinds[rng.IntN(len(chaosKinds))]
		target := k.targets[rng.IntN(len(k.targets))]
		d := (k.min + time.Duration(rng.Int64N(int64(k.max-k.min)))).Round(100 * time.Millisecond)
		if t+k.min > end {
			return out
		}
		ex := exclusion(target)
		agentBusy := slices.ContainsFunc(chaosAgents, func(a string) bool { return busy[a] > t })
		if busy[ex] > t || (ex == "leader" && agentBusy) || (slices.Contains(chaosAgents, ex) && busy["leader"] > t) {
			continue
		}
		heal := min(t+d, end)
		busy[ex] = heal
		out = append(out, chaosFault{N: len(out) + 1, At: t, Heal: heal, Kind: k.name, Target: target})
	}
}

// TestChaosTimeline: a plan draws the same timeline again, inside its
// calm edges, never two faults on one target (or two etcd members, or an
// agent beside leader-kill) at once.
func TestChaosTimeline(t *testing.T) {
	p := chaosPlan{Seed: 7, Duration: 10 * time.Minute, Warmup: 15 * time.Second, Quiet: 25 * time.Second, MeanGap: 10 * time.Second}
	a, b := p.timeline(), p.timeline()
	if len(a) < 20 || !slices.Equal(a, b) {
		fatalf(t, "seed 7 drew %d faults, then %d (equal: %v)", len(a), len(b), slices.Equal(a, b))
	}
	for i, f := range a {
		if f.At < p.Warmup || f.Heal > p.Duration-p.Quiet || f.Heal <= f.At {
			errorf(t, "%v outside [%v, %v]", f, p.Warmup, p.Duration-p.Quiet)
		}
		for _, g := range a[:i] {
			same := exclusion(f.Target) == exclusion(g.Target) ||
				(f.Target == "leader" && slices.Contains(chaosAgents, g.Target)) || (g.Target == "leader" && slices.Contains(chaosAgents, f.Target))
			if same && g.Heal > f.At {
				errorf(t, "%v overlaps %v", f, g)
			}
		}
	}
	if c := (chaosPlan{Seed: 8, Duration: p.Duration, Warmup: p.Warmup, Quiet: p.Quiet, MeanGap: p.MeanGap}).timeline(); slices.Equal(a, c) {
		fail(t, "seeds 7 and 8 drew the same timeline")
	}
}

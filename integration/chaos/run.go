//go:build chaos

package chaos

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"syscall"
	"time"
)

// Config is one chaos run.
type Config struct {
	Seed     uint64
	Duration time.Duration // how long the producer writes and faults are drawn
	Kinds    []Kind        // empty: every kind
	Mode     Mode
	Rate     int    // records per second
	Bin      string // bin/kswitch
	StackBin string // the stack program
	Dir      string // logs and data of the run
	Out      io.Writer
}

// Timing of a run around the faults.
const (
	warmup  = 15 * time.Second // calm at the start: the fleet forms and consumes
	quiet   = 15 * time.Second // calm at the end: every fault healed this long before the producer stops
	meanGap = 10 * time.Second // mean time between two faults' injections
	// settleBound is the checker's bound on recovery: after the producer
	// stops (at least quiet after the last fault healed), every
	// acknowledged record must be on C and every partition of the active
	// cluster committed to its end within it. It covers a failover or
	// failback still to come (failure window 1.5 s, failback_stable 5 s,
	// session TTL 3 s) several times over.
	settleBound = 60 * time.Second
)

// Plan returns the plan of c's timeline.
func (c Config) Plan() Plan {
	return Plan{Seed: c.Seed, Duration: c.Duration, Kinds: c.Kinds, Warmup: warmup, Quiet: quiet, MeanGap: meanGap}
}

// run is one run's state. Faults are applied by Run's goroutine alone.
type run struct {
	cfg    Config
	plan   Plan
	faults []Fault
	start  time.Time
	stack  *stackProc
	agents []*agentProc
	obs    *observer

	mu       sync.Mutex
	resolved map[int]string // a leader-kill's number → the agent it killed
	applied  []appliedStep  // what was done, when, for the report
	harness  []error        // faults the stack or a process refused

	op operator // makes the operator actions off the nemesis's goroutine (faults_ops.go)
}

// Run runs the stack, the fleet and the nemesis, then checks. It returns
// the checker's result; an error means the run itself could not be made
// (a process that did not start), not a violation.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	r := &run{cfg: cfg, plan: cfg.Plan(), resolved: map[int]string{}}
	r.faults = r.plan.Timeline()
	PrintTimeline(cfg.Out, r.plan, r.faults, 0)
	fmt.Fprintf(cfg.Out, "replay: the same seed, duration and faults draw this timeline again; the processes' interleavings differ from run to run\n")
	defer r.close()
	var err error
	if r.stack, err = startStack(cfg.StackBin, cfg.Dir, cfg.Rate); err != nil {
		return nil, err
	}
	for _, id := range agentIDs {
		a, err := newAgent(cfg.Bin, cfg.Dir, id, r.stack.info, cfg.Mode)
		if err != nil {
			return nil, err
		}
		r.agents = append(r.agents, a)
	}
	r.start = time.Now()
	if r.obs, err = startObserver(r.stack.info.Clusters["C"], r.stack.info.OutTopic, r.stack.info.OutPartitions, r.agents, r.start); err != nil {
		return nil, err
	}
	if r.obs.fleet, err = startFleetWatch(r.stack.info, r.agents, r.start); err != nil {
		return nil, err
	}
	r.say("stack %s (etcd %s; A %s, B %s, C %s), agents %s, %s, %d records/s; logs in %s",
		r.stack.control, r.stack.info.Etcd[0], r.stack.info.Clusters["A"][0], r.stack.info.Clusters["B"][0], r.stack.info.Clusters["C"][0],
		agentIDs, cfg.Mode, cfg.Rate, cfg.Dir)
	if err := r.nemesis(ctx); err != nil {
		return nil, err
	}
	r.op.wait() // an operator's heal retried while etcd was away may come late
	if err := r.stack.post("/producer", map[string][]string{"action": {"stop"}}); err != nil {
		return nil, err
	}
	stopped := time.Now()
	r.say("producer stopped; checking")
	return r.check(ctx, stopped)
}

func (r *run) say(format string, args ...any) {
	fmt.Fprintf(r.cfg.Out, "%7.1fs  %s\n", time.Since(r.start).Seconds(), fmt.Sprintf(format, args...))
}

// step is an injection or a healing of a fault.
type step struct {
	at   time.Duration
	f    Fault
	heal bool
}

// nemesis applies the timeline, then waits for the end of the duration.
// Each step runs on its own at its time, a fault's heal after its
// injection has returned: a step that takes long (an operator command
// retried while etcd is stopped, a restart) delays nothing else — run one
// after another, the command would have held back etcd's own restart.
func (r *run) nemesis(ctx context.Context) error {
	var steps []step
	injected := map[int]chan struct{}{}
	for _, f := range r.faults {
		steps = append(steps, step{f.At, f, false}, step{f.Heal, f, true})
		injected[f.N] = make(chan struct{})
	}
	slices.SortStableFunc(steps, func(a, b step) int { return int(a.at - b.at) })
	var wg sync.WaitGroup
	defer wg.Wait()
	for _, s := range append(steps, step{at: r.cfg.Duration}) {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Until(r.start.Add(s.at))):
		}
		if s.f.N == 0 {
			break
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if s.heal {
				<-injected[s.f.N]
			} else {
				defer close(injected[s.f.N])
			}
			if err := r.apply(s); err != nil {
				r.mu.Lock()
				r.harness = append(r.harness, fmt.Errorf("%.1fs %s: %w", time.Since(r.start).Seconds(), s.f, err))
				r.mu.Unlock()
				r.say("  %v", err)
			}
		}()
	}
	return nil
}

func (r *run) agent(id string) *agentProc {
	for _, a := range r.agents {
		if a.id == id {
			return a
		}
	}
	return nil
}

// apply injects or heals one fault.
func (r *run) apply(s step) error {
	f := s.f
	verb := "inject"
	if s.heal {
		verb = "heal  "
	}
	target := f.Target
	if f.Kind == LeaderKill {
		if !s.heal {
			id, err := r.leader()
			if err != nil {
				r.say("%s #%d %s: no leader to kill (%v): skipped", verb, f.N, f.Kind, err)
				return nil
			}
			r.mu.Lock()
			r.resolved[f.N] = id
			r.mu.Unlock()
		}
		r.mu.Lock()
		target = r.resolved[f.N]
		r.mu.Unlock()
		if target == "" {
			return nil // its injection was skipped
		}
	}
	r.say("%s #%d %s %s", verb, f.N, f.Kind, target)
	r.mu.Lock()
	r.applied = append(r.applied, appliedStep{time.Since(r.start), fmt.Sprintf("%s #%d %s %s", verb, f.N, f.Kind, target)})
	r.mu.Unlock()
	spec, ok := kindSpecOf(f.Kind)
	if !ok {
		return fmt.Errorf("unknown fault kind %s", f.Kind)
	}
	return spec.apply(r, target, s.heal)
}

func (r *run) applyAgentKill(target string, heal bool) error {
	a := r.agent(target)
	if heal {
		return a.start()
	}
	a.kill()
	return nil
}

func (r *run) applyAgentStop(target string, heal bool) error {
	r.agent(target).sigstop(!heal)
	return nil
}

// stackFault is a fault the stack applies: action inject, then heal.
func stackFault(heal, inject string) func(r *run, target string, healing bool) error {
	return func(r *run, target string, healing bool) error {
		return r.stack.fault(target, pick(healing, heal, inject))
	}
}

func pick(heal bool, ifHeal, ifInject string) string {
	if heal {
		return ifHeal
	}
	return ifInject
}

// leader returns the agent that a live agent's /leader names as leading.
func (r *run) leader() (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	var errs []error
	for _, a := range r.agents {
		if !a.alive() {
			continue
		}
		var v struct {
			Leader string `json:"leader"`
		}
		if err := getJSON(ctx, "http://"+a.http+"/leader", &v); err != nil {
			errs = append(errs, err)
			continue
		}
		if l := r.agent(v.Leader); l != nil && l.alive() {
			return v.Leader, nil
		}
	}
	return "", fmt.Errorf("no live agent names a live leader: %w", errors.Join(errs...))
}

// close ends everything the run started: the observer, the agents
// (SIGCONT first for a stopped one, then SIGKILL) and their links, the
// stack (SIGTERM, then SIGKILL after 20 s).
func (r *run) close() {
	r.op.stop()
	if r.obs != nil {
		r.obs.stop()
	}
	for _, a := range r.agents {
		p, _, _ := a.current()
		p.kill()
		a.closeNet()
	}
	if r.stack != nil {
		r.stack.signal(syscall.SIGTERM)
		select {
		case <-r.stack.done:
		case <-time.After(20 * time.Second):
			r.stack.kill()
		}
	}
}

// appliedStep is a step as the run applied it.
type appliedStep struct {
	at   time.Duration
	text string
}

// timelineWithMarker prints the drawn timeline, then the steps as applied
// with a marker at at, for a violation.
func (r *run) timelineWithMarker(w io.Writer, at time.Duration, what string) {
	PrintTimeline(w, r.plan, r.faults, 0)
	fmt.Fprintf(w, "as applied (seed %d):\n", r.cfg.Seed)
	r.mu.Lock()
	defer r.mu.Unlock()
	marked := false
	for _, s := range r.applied {
		if !marked && s.at > at {
			fmt.Fprintf(w, "  %7.1fs <-- %s\n", at.Seconds(), what)
			marked = true
		}
		fmt.Fprintf(w, "  %7.1fs %s\n", s.at.Seconds(), s.text)
	}
	if !marked {
		fmt.Fprintf(w, "  %7.1fs <-- %s\n", at.Seconds(), what)
	}
}

// Package demo runs kswitch's live demonstration in one process: an
// embedded etcd and a fleet of agents on free local ports, with a scripted
// story narrated as a timeline.
//
// What it shows grows with the product. Today: leader election, a leader
// crash (no resign: the successor waits for the session lease to expire)
// and a clean hand-over (resign: the successor leads at once).
package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/internal/config"
	"github.com/kswitch/kswitch/internal/testenv"
)

// Options configure a demo run.
type Options struct {
	// Agents is the fleet size, at least 2. Default 3.
	Agents int
	// SessionTTL is the agents' etcd session TTL. Default 2s.
	SessionTTL time.Duration
	// KeepRunning leaves everything up after the story until ctx ends.
	KeepRunning bool
	// Out receives the timeline. Default os.Stdout.
	Out io.Writer
	// Logger receives the agents' logs. Default: none.
	Logger *zap.Logger
}

// Run plays the demo. It returns an error when the fleet did not behave as
// promised (no leader, two leaders, a hand-over past its bound).
func Run(ctx context.Context, o Options) (err error) {
	if o.Agents == 0 {
		o.Agents = 3
	}
	if o.Agents < 2 {
		return fmt.Errorf("demo: --agents %d: need at least 2 to show a hand-over", o.Agents)
	}
	if o.SessionTTL == 0 {
		o.SessionTTL = 2 * time.Second
	}
	if o.Out == nil {
		o.Out = os.Stdout
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	t := &timeline{out: o.Out, start: time.Now()}

	dir, err := os.MkdirTemp("", "kswitch-demo-")
	if err != nil {
		return fmt.Errorf("demo: temp dir: %w", err)
	}
	defer os.RemoveAll(dir)
	etcd, err := testenv.StartEtcd(dir, o.Logger.Named("etcd"))
	if err != nil {
		return fmt.Errorf("demo: start embedded etcd: %w", err)
	}
	defer etcd.Stop()
	t.say("embedded etcd up at %v", etcd.Endpoints())

	var fleet []*agent.Agent
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		for _, a := range fleet {
			err = errors.Join(err, a.Stop(sctx))
		}
	}()
	for i := range o.Agents {
		cfg := config.Default()
		cfg.Fleet = "demo"
		cfg.Agent.ID = fmt.Sprintf("agent-%d", i+1)
		cfg.Agent.HTTP = "127.0.0.1:0"
		cfg.Agent.Gossip = "127.0.0.1:0"
		cfg.Etcd.Endpoints = etcd.Endpoints()
		cfg.Etcd.SessionTTL = o.SessionTTL
		cfg.Etcd.RequestTimeout = time.Second
		cfg.Clusters = map[string]config.Cluster{"A": {Brokers: []string{"127.0.0.1:9092"}, Role: config.RolePrimary}}
		cfg.Source.Topics = []string{"orders"}
		cfg.Source.Group = "demo"
		a, err := agent.New(cfg, agent.Options{Logger: o.Logger})
		if err != nil {
			return err
		}
		if err := a.Start(ctx); err != nil {
			return err
		}
		fleet = append(fleet, a)
		t.say("%s started: http://%s/status  gossip %s", a.ID(), a.HTTPAddr(), a.GossipAddr())
	}

	first, took, err := t.awaitLeader(ctx, fleet, 10*time.Second)
	if err != nil {
		return err
	}
	t.say("%s leads (fencing token %d), elected %v after start", first.ID(), first.LeaderView().FencingToken, took.Round(time.Millisecond))
	if err := t.awaitGossip(ctx, fleet, 15*time.Second); err != nil {
		return err
	}

	t.say("crash: %s is killed without resigning; its lease must expire (TTL %v)", first.ID(), o.SessionTTL)
	first.Abort()
	fleet = remove(fleet, first)
	second, crashTook, err := t.awaitLeader(ctx, fleet, o.SessionTTL+5*time.Second)
	if err != nil {
		return err
	}
	t.say("%s leads (fencing token %d) %v after the crash", second.ID(), second.LeaderView().FencingToken, crashTook.Round(time.Millisecond))

	var handTook time.Duration
	if len(fleet) > 1 {
		t.say("clean stop: %s resigns and releases its lease", second.ID())
		began := time.Now()
		if err := second.Stop(ctx); err != nil {
			return err
		}
		fleet = remove(fleet, second)
		var third *agent.Agent
		third, _, err = t.awaitLeader(ctx, fleet, 5*time.Second)
		if err != nil {
			return err
		}
		handTook = time.Since(began)
		t.say("%s leads (fencing token %d) %v after the stop began", third.ID(), third.LeaderView().FencingToken, handTook.Round(time.Millisecond))
	}

	fmt.Fprintln(o.Out)
	tw := tabwriter.NewWriter(o.Out, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "agents\t%d\n", o.Agents)
	fmt.Fprintf(tw, "first election\t%v\n", took.Round(time.Millisecond))
	fmt.Fprintf(tw, "new leader after a crash\t%v\t(bound: session TTL %v + 1s)\n", crashTook.Round(time.Millisecond), o.SessionTTL)
	if handTook > 0 {
		fmt.Fprintf(tw, "new leader after a clean stop\t%v\t(bound: 1s)\n", handTook.Round(time.Millisecond))
	}
	tw.Flush()

	if o.KeepRunning {
		fmt.Fprintf(o.Out, "\nstill running; try:\n  kswitch status --etcd %s --fleet demo\n", etcd.Endpoints()[0])
		for _, a := range fleet {
			fmt.Fprintf(o.Out, "  curl http://%s/leader\n", a.HTTPAddr())
		}
		fmt.Fprintln(o.Out, "press Ctrl-C to stop")
		<-ctx.Done()
	}
	return nil
}

func remove(fleet []*agent.Agent, a *agent.Agent) []*agent.Agent {
	var out []*agent.Agent
	for _, x := range fleet {
		if x != a {
			out = append(out, x)
		}
	}
	return out
}

type timeline struct {
	out   io.Writer
	start time.Time
}

func (t *timeline) say(format string, args ...any) {
	fmt.Fprintf(t.out, "%7.3fs  %s\n", time.Since(t.start).Seconds(), fmt.Sprintf(format, args...))
}

// awaitLeader waits until exactly one agent of fleet leads and every agent
// names it, and returns it with the time waited.
func (t *timeline) awaitLeader(ctx context.Context, fleet []*agent.Agent, timeout time.Duration) (*agent.Agent, time.Duration, error) {
	began := time.Now()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		var leaders []*agent.Agent
		for _, a := range fleet {
			if a.Leading() {
				leaders = append(leaders, a)
			}
		}
		if len(leaders) > 1 {
			return nil, 0, fmt.Errorf("demo: two agents lead at once: %s and %s", leaders[0].ID(), leaders[1].ID())
		}
		if len(leaders) == 1 && agreeOn(fleet, leaders[0].ID()) {
			return leaders[0], time.Since(began), nil
		}
		select {
		case <-ctx.Done():
			return nil, 0, ctx.Err()
		case <-deadline.C:
			return nil, 0, fmt.Errorf("demo: no agreed leader after %v", timeout)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

func agreeOn(fleet []*agent.Agent, id string) bool {
	for _, a := range fleet {
		if a.LeaderView().Leader != id {
			return false
		}
	}
	return true
}

// awaitGossip waits until every agent sees the whole fleet in gossip.
func (t *timeline) awaitGossip(ctx context.Context, fleet []*agent.Agent, timeout time.Duration) error {
	began := time.Now()
	for {
		all := true
		for _, a := range fleet {
			if len(a.GossipMembers()) != len(fleet) {
				all = false
			}
		}
		if all {
			t.say("gossip: every agent sees all %d members (joined through the registrations in etcd, no seed list)", len(fleet))
			return nil
		}
		if time.Since(began) > timeout {
			return fmt.Errorf("demo: gossip did not converge within %v", timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

package agent_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/freeport"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/state"
)

func TestMain(m *testing.M) {
	wait.VerifyTestMain(m, testenv.LeakOptions()...)
}

const ttl = 2 * time.Second

func testConfig(e *devstack.Etcd, id string) config.Config {
	cfg := config.Default()
	cfg.Fleet = "orders"
	cfg.Agent.ID = id
	cfg.Agent.HTTP = "127.0.0.1:0"
	cfg.Agent.Gossip = "127.0.0.1:0"
	cfg.Etcd.Endpoints = e.Endpoints()
	cfg.Etcd.SessionTTL = ttl
	cfg.Etcd.RequestTimeout = time.Second
	cfg.Clusters = map[string]config.Cluster{
		"A": {Brokers: []string{"127.0.0.1:9092"}, Role: config.RolePrimary},
		"B": {Brokers: []string{"127.0.0.1:9093"}, Role: config.RoleStandby},
	}
	cfg.Source.Topics = []string{"orders"}
	cfg.Source.Group = "orders"
	return cfg
}

func startAgent(t *testing.T, e *devstack.Etcd, id string) *agent.Agent {
	t.Helper()
	return startFleetAgent(t, testConfig(e, id), agent.Options{})
}

func getJSON(url string, v any) (int, error) {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	return resp.StatusCode, json.NewDecoder(resp.Body).Decode(v)
}

// leaderViews reads /leader of every agent over HTTP.
func leaderViews(agents []*agent.Agent) ([]agent.LeaderView, error) {
	var out []agent.LeaderView
	for _, a := range agents {
		var v agent.LeaderView
		if _, err := getJSON("http://"+a.HTTPAddr()+"/leader", &v); err != nil {
			return nil, fmt.Errorf("%s: %w", a.ID(), err)
		}
		out = append(out, v)
	}
	return out, nil
}

// agreedLeader returns the leader all agents agree on, when exactly one of
// them reports self and all name it with the same fencing token.
func agreedLeader(agents []*agent.Agent) (string, error) {
	views, err := leaderViews(agents)
	if err != nil {
		return "", err
	}
	var selves []string
	for _, v := range views {
		if v.Self {
			selves = append(selves, v.Agent)
		}
	}
	if len(selves) != 1 {
		return "", fmt.Errorf("agents reporting self: %v", selves)
	}
	for _, v := range views {
		if v.Leader != selves[0] || v.FencingToken != views[0].FencingToken || v.FencingToken == 0 {
			return "", fmt.Errorf("views disagree: %+v", views)
		}
	}
	return selves[0], nil
}

// watchSingleLeader samples Leading() of every agent until stop is closed
// and records every moment at which two agents lead at once. Every agent
// here can reach etcd, so this must never happen.
func watchSingleLeader(agents []*agent.Agent, stop <-chan struct{}) func() []string {
	var mu sync.Mutex
	var violations []string
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			var leading []string
			for _, a := range agents {
				if a.Leading() {
					leading = append(leading, a.ID())
				}
			}
			if len(leading) > 1 {
				mu.Lock()
				violations = append(violations, fmt.Sprintf("%s: %v", time.Now().Format(time.StampMicro), leading))
				mu.Unlock()
			}
			time.Sleep(time.Millisecond)
		}
	}()
	return func() []string {
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		return violations
	}
}

func without(agents []*agent.Agent, id string) []*agent.Agent {
	return slices.DeleteFunc(slices.Clone(agents), func(a *agent.Agent) bool { return a.ID() == id })
}

func byID(agents []*agent.Agent, id string) *agent.Agent {
	for _, a := range agents {
		if a.ID() == id {
			return a
		}
	}
	return nil
}

func TestFleetElectsOneLeaderAndReplacesIt(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	agents := []*agent.Agent{startAgent(t, e, "agent-1"), startAgent(t, e, "agent-2"), startAgent(t, e, "agent-3")}

	stop := make(chan struct{})
	violations := watchSingleLeader(agents, stop)
	defer func() {
		close(stop)
		if v := violations(); len(v) > 0 {
			t.Errorf("two agents led at once: %v", v)
		}
	}()

	var first string
	wait.For(t, 10*time.Second, "three agents agree on one leader via /leader", func() (err error) {
		first, err = agreedLeader(agents)
		return err
	})

	// A clean stop resigns: a successor leads within 1 s.
	began := time.Now()
	stopped := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		stopped <- byID(agents, first).Stop(ctx)
	}()
	rest := without(agents, first)
	var second string
	wait.For(t, time.Second, "a new leader after a clean stop", func() (err error) {
		second, err = agreedLeader(rest)
		return err
	})
	t.Logf("clean stop of %s: %s leads after %v", first, second, time.Since(began))
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}

	// A crash does not resign: the lease must expire first, so a successor
	// leads within the session TTL + 1 s.
	began = time.Now()
	byID(agents, second).Abort()
	last := without(rest, second)
	var third string
	wait.For(t, ttl+time.Second, "a new leader after the leader crashed", func() (err error) {
		third, err = agreedLeader(last)
		return err
	})
	t.Logf("crash of %s: %s leads after %v", second, third, time.Since(began))
}

func TestReadinessFollowsEtcd(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	a := startAgent(t, e, "agent-1")
	url := "http://" + a.HTTPAddr() + "/readyz"
	var body map[string]string
	wait.For(t, 10*time.Second, "ready", func() error {
		if code, err := getJSON(url, &body); err != nil || code != http.StatusOK {
			return fmt.Errorf("readyz %d %v %v", code, body, err)
		}
		return nil
	})

	e.Stop()
	wait.For(t, 10*time.Second, "unready while etcd is down", func() error {
		code, err := getJSON(url, &body)
		if err != nil {
			return err
		}
		if code != http.StatusServiceUnavailable || !strings.Contains(body["reason"], "etcd") {
			return fmt.Errorf("readyz %d %v", code, body)
		}
		return nil
	})
	t.Logf("while etcd is down: %v", body)
	// Liveness does not depend on etcd.
	if code, err := getJSON("http://"+a.HTTPAddr()+"/healthz", &body); err != nil || code != http.StatusOK {
		t.Fatalf("healthz while etcd is down: %d %v", code, err)
	}

	if err := e.Restart(); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 15*time.Second, "ready again after etcd returned", func() error {
		if code, err := getJSON(url, &body); err != nil || code != http.StatusOK {
			return fmt.Errorf("readyz %d %v %v", code, body, err)
		}
		return nil
	})
	wait.For(t, 10*time.Second, "leads again", func() error {
		if _, err := agreedLeader([]*agent.Agent{a}); err != nil {
			return err
		}
		return nil
	})
}

func TestGossipMembershipFollowsAgents(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	agents := []*agent.Agent{startAgent(t, e, "agent-1"), startAgent(t, e, "agent-2"), startAgent(t, e, "agent-3")}
	names := func(ms []agent.GossipMember) []string {
		var out []string
		for _, m := range ms {
			out = append(out, m.Name)
		}
		return out
	}
	regIDs := func(rs []state.Registration) []string {
		var out []string
		for _, r := range rs {
			out = append(out, r.ID)
		}
		return out
	}
	want := []string{"agent-1", "agent-2", "agent-3"}
	wait.For(t, 15*time.Second, "every agent sees all three in gossip and in agents/", func() error {
		for _, a := range agents {
			var st agent.Status
			if _, err := getJSON("http://"+a.HTTPAddr()+"/status", &st); err != nil {
				return err
			}
			if got := names(st.Gossip); !slices.Equal(got, want) {
				return fmt.Errorf("%s gossip members %v", a.ID(), got)
			}
			if got := regIDs(st.Agents); !slices.Equal(got, want) {
				return fmt.Errorf("%s registered agents %v", a.ID(), got)
			}
		}
		return nil
	})

	agents[2].Abort()
	rest := agents[:2]
	want = want[:2]
	wait.For(t, 30*time.Second, "the killed agent leaves gossip and agents/", func() error {
		for _, a := range rest {
			if got := names(a.GossipMembers()); !slices.Equal(got, want) {
				return fmt.Errorf("%s gossip members %v", a.ID(), got)
			}
			if got := regIDs(a.Registered()); !slices.Equal(got, want) {
				return fmt.Errorf("%s registered agents %v", a.ID(), got)
			}
		}
		return nil
	})
}

func TestMetricsAndDuplicateID(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	a := startAgent(t, e, "agent-1")
	wait.For(t, 10*time.Second, "leads", func() error {
		_, err := agreedLeader([]*agent.Agent{a})
		return err
	})
	wait.For(t, 5*time.Second, "metrics", func() error {
		resp, err := http.Get("http://" + a.HTTPAddr() + "/metrics")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			return err
		}
		for _, want := range []string{"kswitch_is_leader 1", "kswitch_leader_changes_total 1", "kswitch_ready 1"} {
			if !strings.Contains(string(body), want+"\n") {
				return fmt.Errorf("no %q in /metrics", want)
			}
		}
		return nil
	})

	// A second process with the same id must not register over the first.
	dup := startAgent(t, e, "agent-1")
	wait.For(t, 5*time.Second, "duplicate id refused", func() error {
		ok, reason := dup.Ready()
		if ok || !strings.Contains(reason, "already registered") {
			return fmt.Errorf("duplicate: ready=%v reason=%q", ok, reason)
		}
		return nil
	})
	if ok, _ := a.Ready(); !ok {
		t.Fatal("the first agent lost its registration to a duplicate")
	}
}

// TestAProbeReadBeforeRegistrationEvictsNothing: the etcd probe evicts the
// agent (ends its session and registers again) when its registration is
// gone; a read served before the registration was written, judged after
// it, must not count as gone. Before the fix the agent dropped its first
// session within milliseconds of registering (a CI failure: agent-2's
// partitions were given, taken back and given again).
func TestAProbeReadBeforeRegistrationEvictsNothing(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	c, err := e.Client()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	key := "/kswitch/orders/agents/agent-1"
	lease := make(chan int64, 1)
	var calls, registrations atomic.Int32
	probed := make(chan struct{})
	read := make(chan struct{}) // closed once the probe's first read returned
	// The first registration waits for the probe's first read, so that
	// read is served before the registration is written.
	registering := func() {
		if registrations.Add(1) == 1 {
			select {
			case <-read:
			case <-time.After(10 * time.Second):
				t.Error("the probe made no read in 10 s")
			}
		}
	}
	hook := func(found bool) {
		n := calls.Add(1)
		if n == 1 {
			close(read)
			if found {
				t.Error("the probe's first read saw a registration written after it")
			}
			// Judge this read only once the registration is written.
			deadline := time.Now().Add(10 * time.Second)
			for time.Now().Before(deadline) {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				resp, err := c.Get(ctx, key)
				cancel()
				if err == nil && len(resp.Kvs) == 1 {
					lease <- resp.Kvs[0].Lease
					return
				}
				time.Sleep(5 * time.Millisecond)
			}
			close(lease)
		}
		if n == 3 {
			close(probed)
		}
	}
	startFleetAgent(t, testConfig(e, "agent-1"), agent.WithHooks(agent.Options{}, agent.Hooks{EtcdProbed: hook, Registering: registering}))
	first, ok := <-lease
	if !ok {
		t.Fatal("agent-1 never registered")
	}
	select {
	case <-probed: // the stale read was judged, and two more after it
	case <-time.After(15 * time.Second):
		t.Fatal("the probe did not run three times in 15 s")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	resp, err := c.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) != 1 || resp.Kvs[0].Lease != first {
		t.Fatalf("registration after the stale probe read: %v, want the first one on lease %x kept", resp.Kvs, first)
	}
}

// TestRegistrationNamesAnAddressOthersReach: an agent whose HTTP listener
// is bound to every interface (0.0.0.0, as in a container) registers the
// host gossip advertises with its port, not the wildcard (asked there, the
// leader would reach itself), and its /healthz names it on the lease of
// its registration: what the leader's proof of membership reads.
func TestRegistrationNamesAnAddressOthersReach(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	cfg := testConfig(e, "agent-1")
	cfg.Agent.HTTP = "0.0.0.0:0"
	a := startFleetAgent(t, cfg, agent.Options{})
	cli := testenv.EtcdClientT(t, e)
	var reg state.Registration
	var lease int64
	wait.For(t, 10*time.Second, "agent-1 registered", func() error {
		resp, err := cli.Get(t.Context(), fleetKeys.Agent("agent-1"))
		if err != nil || len(resp.Kvs) != 1 {
			return fmt.Errorf("registration: %v %v", resp, err)
		}
		lease = resp.Kvs[0].Lease
		return json.Unmarshal(resp.Kvs[0].Value, &reg)
	})
	_, port, err := net.SplitHostPort(a.HTTPAddr())
	if err != nil {
		t.Fatal(err)
	}
	if want := "127.0.0.1:" + port; reg.HTTP != want {
		t.Fatalf("registered http %q, want %q (bound %s, gossip %s)", reg.HTTP, want, a.HTTPAddr(), a.GossipAddr())
	}
	var body struct{ Agent, Lease string }
	if code, err := getJSON("http://"+reg.HTTP+"/healthz", &body); err != nil || code != 200 {
		t.Fatalf("/healthz at the registered address: %d %v", code, err)
	}
	if body.Agent != "agent-1" || body.Lease != fmt.Sprintf("%x", lease) {
		t.Errorf("/healthz says agent %q lease %q; the registration is agent-1 on lease %x", body.Agent, body.Lease, lease)
	}
}

// A Start that fails part way closes what it had opened: the HTTP port is
// free again and none of its goroutines (its etcd client's) is left.
func TestStartFailureClosesWhatItOpened(t *testing.T) {
	e := testenv.StartEtcdT(t)
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	port, err := freeport.Port()
	if err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(e, "a1")
	cfg.Agent.HTTP = fmt.Sprintf("127.0.0.1:%d", port)
	cfg.Agent.Gossip = taken.Addr().String() // memberlist cannot bind it
	before := etcdClientGoroutines()
	a, err := agent.New(cfg, agent.Options{Logger: zaptest.NewLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(context.Background()); err == nil {
		a.Abort()
		t.Fatal("Start succeeded with the gossip port taken")
	} else if !strings.Contains(err.Error(), taken.Addr().String()) && !strings.Contains(err.Error(), "gossip") {
		t.Errorf("Start's error does not say what failed: %v", err)
	}
	ln, err := net.Listen("tcp", cfg.Agent.HTTP)
	if err != nil {
		t.Fatalf("the HTTP port is still held after a failed Start: %v", err)
	}
	ln.Close()
	wait.For(t, 10*time.Second, "the failed Start's etcd client to close", func() error {
		if n := etcdClientGoroutines(); n > before {
			return fmt.Errorf("%d goroutines of an etcd client, %d before Start", n, before)
		}
		return nil
	})
}

// etcdClientGoroutines counts the goroutines running an etcd client's
// code or its gRPC connection's (the embedded server's own are not
// counted).
func etcdClientGoroutines() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	count := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "go.etcd.io/etcd/client/v3") || strings.Contains(g, "grpc.(*addrConn)") || strings.Contains(g, "grpc.(*ClientConn)") ||
			strings.Contains(g, "grpcsync.(*CallbackSerializer)") {
			count++
		}
	}
	return count
}

//go:build chaos

package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// Operator actions, done as an operator does them: the kswitch CLI
// (cfg.Bin) as a child process against the stack's etcd, with agent-1's
// configuration file for the endpoints, the fleet and the clusters; and
// etcd writes, as etcdctl makes them, for what has no command and for the
// bad values an operator types by hand. Nothing reaches into an agent.
//
// Each action is healed: unpaused, unpinned, its routes and configuration
// keys deleted (back to the agents' file). A bad value must be refused
// (by the CLI: exit status 1 and "nothing written"; or by the agents:
// kswitch_refused_values_total of its kind rising on an agent, or the
// leader's refusal at state/config-refused) and must never be put in
// force; an action whose outcome breaks that is an "operator" violation.
const (
	OpPause       Kind = "op-pause"       // kswitch pause (fleet, topic orders or channel out), then a bad signal value on the same key; heal: kswitch resume
	OpPin         Kind = "op-pin"         // kswitch failover --to A|B; heal: kswitch failover --auto (if the pin is still this one's)
	OpTopicPin    Kind = "op-topic-pin"   // kswitch failover --to A|B --topic orders; heal: --auto --topic orders (likewise)
	OpStage       Kind = "op-stage"       // kswitch failover --to B --stages orders --check 5s; heal: --auto --stages
	OpRoutes      Kind = "op-routes"      // kswitch routes apply of a version routing everything to out, a bad file refused by the CLI, a bad channel value refused by the agents; heal: the keys deleted
	OpConfig      Kind = "op-config"      // kswitch config apply of C redefined (client_id), a bad file refused by the CLI, B's brokers unreachable refused by the leader; heal: the keys deleted
	PartitionsAdd Kind = "partitions-add" // a partition added to orders on the cluster the producer writes to (at most up to out's count); heal: none (partitions stay)
)

// opKinds are the operator actions and the partitions added to a source
// topic. The targets of one kind that write the same key (a pin to A and
// one to B) may overlap: the later write wins, and a heal removes only a
// value its own action wrote.
var opKinds = []kindSpec{
	{OpPause, []string{"fleet", "topic:orders", "channel:out"}, 3 * time.Second, 20 * time.Second, byOperator(OpPause, (*run).applyPause)},
	{OpPin, []string{"fleet@A", "fleet@B"}, 5 * time.Second, 30 * time.Second, byOperator(OpPin, (*run).applyPin)},
	{OpTopicPin, []string{"orders@A", "orders@B"}, 5 * time.Second, 30 * time.Second, byOperator(OpTopicPin, (*run).applyPin)},
	{OpStage, []string{"stages@B"}, 10 * time.Second, 30 * time.Second, byOperator(OpStage, (*run).applyStage)},
	{OpRoutes, []string{"routes"}, 5 * time.Second, 30 * time.Second, byOperator(OpRoutes, (*run).applyRoutes)},
	{OpConfig, []string{"config"}, 5 * time.Second, 30 * time.Second, byOperator(OpConfig, (*run).applyConfig)},
	{PartitionsAdd, []string{"orders"}, 1 * time.Second, 2 * time.Second, byOperator(PartitionsAdd, (*run).applyPartitionsAdd)},
}

// byOperator hands an action to the run's operator (r.op), who makes
// the actions one after another, in the timeline's order, off the
// nemesis's goroutine: an operator's command retried while etcd is
// stopped must not hold up the step that restarts it.
func byOperator(k Kind, apply func(r *run, target string, heal bool) error) func(r *run, target string, heal bool) error {
	return func(r *run, target string, heal bool) error {
		r.op.do(func() {
			if err := apply(r, target, heal); err != nil {
				verb := pick(heal, "heal", "inject")
				r.mu.Lock()
				r.harness = append(r.harness, fmt.Errorf("%.1fs %s %s %s: %w", time.Since(r.start).Seconds(), verb, k, target, err))
				r.mu.Unlock()
				r.say("  %s %s %s: %v", verb, k, target, err)
			}
		})
		return nil
	}
}

// operator makes operator actions in the order they are handed over, on
// one goroutine of its own, started by the first action; wait returns
// once every action handed over is made, stop ends it. The zero value is
// ready for use.
type operator struct {
	once    sync.Once
	mu      sync.Mutex
	queue   []func()
	wake    chan struct{}
	quit    chan struct{}
	done    chan struct{}
	pending sync.WaitGroup // actions handed over and not yet made
}

func (o *operator) do(f func()) {
	o.once.Do(func() {
		o.wake, o.quit, o.done = make(chan struct{}, 1), make(chan struct{}), make(chan struct{})
		go o.loop()
	})
	o.pending.Add(1)
	o.mu.Lock()
	o.queue = append(o.queue, f)
	o.mu.Unlock()
	select {
	case o.wake <- struct{}{}:
	default:
	}
}

func (o *operator) loop() {
	defer close(o.done)
	for {
		o.mu.Lock()
		var f func()
		if len(o.queue) > 0 {
			f, o.queue = o.queue[0], o.queue[1:]
		}
		o.mu.Unlock()
		if f != nil {
			f()
			o.pending.Done()
			continue
		}
		select {
		case <-o.quit:
			return
		case <-o.wake:
		}
	}
}

// wait returns once every action handed over is made (each retries for a
// bounded time).
func (o *operator) wait() { o.pending.Wait() }

// stop ends the operator's goroutine once the action under way is made;
// actions not yet made are dropped.
func (o *operator) stop() {
	o.once.Do(func() {}) // never started: nothing to stop
	if o.quit == nil {
		return
	}
	o.mu.Lock()
	for range o.queue {
		o.pending.Done()
	}
	o.queue = nil
	o.mu.Unlock()
	close(o.quit)
	<-o.done
}

// Operator timing.
const (
	// opRetryFor is how long an operator retries a command that fails
	// because etcd or the leader is away (etcd-stop lasts at most 10 s).
	opRetryFor = 30 * time.Second
	// refusalWait bounds the wait for an agent to count a bad value's
	// refusal (they watch the keys: it takes milliseconds).
	refusalWait = 10 * time.Second
	// configVerdictWait is kswitch config apply --wait: the leader's
	// verdict normally comes within a second.
	configVerdictWait = 5 * time.Second
)

// opError is an operator action whose outcome the product does not
// promise: a bad value written by the CLI or put in force. The checker
// reports it as the "operator" invariant.
type opError struct{ msg string }

func (e *opError) Error() string { return e.msg }

func opViolation(format string, args ...any) error {
	return &opError{fmt.Sprintf(format, args...)}
}

// kswitchCLI runs the kswitch CLI with args, as an operator types it, and
// returns its exit status (-1: it did not run to its end) and its output,
// which also goes to ops.log in the run's directory.
func (r *run) kswitchCLI(args ...string) (int, string) {
	ctx, cancel := context.WithTimeout(context.Background(), configVerdictWait+20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, r.cfg.Bin, args...)
	out, err := cmd.CombinedOutput()
	code := 0
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		code = ee.ExitCode()
	case err != nil:
		code = -1
		out = append(out, []byte("\n(chaos: "+err.Error()+")")...)
	}
	r.opLog("$ kswitch %s\n%s(exit %d)\n", strings.Join(args, " "), out, code)
	return code, strings.TrimSpace(string(out))
}

func (r *run) opLog(format string, args ...any) {
	f, err := os.OpenFile(filepath.Join(r.cfg.Dir, "ops.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return
	}
	defer f.Close()
	fmt.Fprintf(f, "%7.1fs ", time.Since(r.start).Seconds())
	fmt.Fprintf(f, format, args...)
}

// operate runs a command that must succeed, again every second while it
// fails (etcd stopped, a transaction that lost a race), for up to
// opRetryFor, as an operator retries.
func (r *run) operate(args ...string) (string, error) {
	deadline := time.Now().Add(opRetryFor)
	for {
		code, out := r.kswitchCLI(args...)
		if code == 0 {
			return out, nil
		}
		if strings.Contains(out, "nothing written") {
			// Refused as invalid: the input is wrong, a retry changes nothing.
			return out, fmt.Errorf("kswitch %s: refused (exit %d): %s", strings.Join(args, " "), code, out)
		}
		if time.Now().After(deadline) {
			return out, fmt.Errorf("kswitch %s: exit %d for %v: %s", strings.Join(args, " "), code, opRetryFor, lastLine(out))
		}
		time.Sleep(time.Second) // an operator's retry; nothing to wait on
	}
}

// refuse runs a command with a bad input that the CLI must refuse: exit
// status 1 with want in its output and nothing written. A failure that
// is not the refusal (etcd away) is retried for up to opRetryFor.
func (r *run) refuse(want []string, args ...string) error {
	deadline := time.Now().Add(opRetryFor)
	for {
		code, out := r.kswitchCLI(args...)
		if code == 0 {
			return opViolation("kswitch %s: accepted a bad value (exit 0): %s", strings.Join(args, " "), lastLine(out))
		}
		for _, w := range want {
			if code == 1 && strings.Contains(out, w) {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kswitch %s: neither accepted nor refused (%q) for %v: exit %d: %s", strings.Join(args, " "), want, opRetryFor, code, lastLine(out))
		}
		time.Sleep(time.Second)
	}
}

func lastLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		return s[i+1:]
	}
	return s
}

// confFile is the configuration file the CLI is given: agent-1's, without
// its links (the operator is not behind agent-1's network faults).
func (r *run) confFile() string { return r.agents[0].directConf }

// etcdDo runs f with an etcd client of the stack's etcd, again every
// second while it fails, for up to opRetryFor (etcdctl retried by hand).
func (r *run) etcdDo(what string, f func(ctx context.Context, c *clientv3.Client) error) error {
	c, err := clientv3.New(clientv3.Config{Endpoints: r.stack.info.Etcd, DialTimeout: 2 * time.Second})
	if err != nil {
		return fmt.Errorf("etcd client: %w", err)
	}
	defer c.Close()
	deadline := time.Now().Add(opRetryFor)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		err := f(ctx, c)
		cancel()
		r.opLog("$ etcdctl %s: %v\n", what, errString(err))
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("etcdctl %s: %w (for %v)", what, err, opRetryFor)
		}
		time.Sleep(time.Second)
	}
}

func errString(err error) string {
	if err == nil {
		return "ok"
	}
	return err.Error()
}

// putBad writes a bad value to key as etcdctl would; an agent must count
// its refusal (kind) within refusalWait: none counting it while one runs
// is a violation (etcd was up for the put; an etcd stopped right after
// is back within 10 s, and the agents read the value then).
func (r *run) putBad(kind, key, value string) error {
	before := r.refusals(kind)
	if err := r.etcdDo(fmt.Sprintf("put %s %q", key, value), func(ctx context.Context, c *clientv3.Client) error {
		_, err := c.Put(ctx, key, value)
		return err
	}); err != nil {
		return err
	}
	if r.refusedSince(kind, before, refusalWait) {
		r.say("  bad %s value at %s: refused by the agents", kind, key)
		return nil
	}
	if !slices.ContainsFunc(r.agents, (*agentProc).alive) {
		r.say("  bad %s value at %s: no agent runs to refuse it", kind, key)
		return nil
	}
	return opViolation("bad %s value at %s: no agent counted its refusal (kswitch_refused_values_total{kind=%q}) within %v", kind, key, kind, refusalWait)
}

// refusals returns each live agent process's kswitch_refused_values_total
// of kind, by "<agent>#<incarnation>".
func (r *run) refusals(kind string) map[string]float64 {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	out := map[string]float64{}
	for _, a := range r.agents {
		_, inc, _ := a.current()
		if !a.alive() {
			continue
		}
		if v, err := metricSeries(ctx, "http://"+a.http+"/metrics", fmt.Sprintf("kswitch_refused_values_total{kind=%q}", kind)); err == nil {
			out[fmt.Sprintf("%s#%d", a.id, inc)] = v
		}
	}
	return out
}

// refusedSince waits up to d for an agent process whose count of kind
// rose since before (a process started since counts from 0).
func (r *run) refusedSince(kind string, before map[string]float64, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for {
		for k, v := range r.refusals(kind) {
			if v > before[k] {
				return true
			}
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(200 * time.Millisecond) // polling the agents' /metrics
	}
}

// metricSeries returns the value of one series (name and labels exactly
// as exposed) on a Prometheus text page; 0 when it is not there.
func metricSeries(ctx context.Context, url, series string) (float64, error) {
	var v float64
	var perr error
	err := scrape(ctx, url, func(line string) bool {
		rest, ok := strings.CutPrefix(line, series+" ")
		if ok {
			v, perr = strconv.ParseFloat(strings.TrimSpace(rest), 64)
		}
		return !ok
	})
	return v, errors.Join(err, perr)
}

// applyPause: kswitch pause of the fleet, the topic orders or the channel
// out, then a bad value on the same key (the pause stays in force); heal:
// kswitch resume.
func (r *run) applyPause(target string, heal bool) error {
	scope, name, _ := strings.Cut(target, ":")
	args := []string{"--config", r.confFile()}
	key := keys.New(fleetName).FleetSignal()
	switch scope {
	case "topic":
		args = append(args, "--topic", name)
		key = keys.New(fleetName).TopicSignal(name)
	case "channel":
		args = append(args, "--channel", name)
		key = keys.New(fleetName).ChannelSignal(name)
	}
	if heal {
		_, err := r.operate(append([]string{"resume"}, append(args, "--reason", "chaos heal")...)...)
		return err
	}
	if _, err := r.operate(append([]string{"pause"}, append(args, "--reason", "chaos")...)...); err != nil {
		return err
	}
	return r.putBad("signal", key, "paws # chaos: a typo; the pause stays")
}

// applyPin: kswitch failover --to CLUSTER, of the fleet or (orders@X) of
// the topic orders; heal: kswitch failover --auto (--topic orders), when
// the pin is still the one this action wrote.
func (r *run) applyPin(target string, heal bool) error {
	scope, cluster, _ := strings.Cut(target, "@")
	args := []string{"failover", "--config", r.confFile()}
	key := keys.New(fleetName).Pin()
	if scope != "fleet" {
		args = append(args, "--topic", scope)
		key = keys.New(fleetName).TopicPin(scope)
	}
	if !heal {
		_, err := r.operate(append(args, "--to", cluster)...)
		return err
	}
	var now string
	if err := r.etcdDo("get "+key, func(ctx context.Context, c *clientv3.Client) error {
		resp, err := c.Get(ctx, key)
		if err == nil && len(resp.Kvs) > 0 {
			now = string(resp.Kvs[0].Value)
		}
		return err
	}); err != nil {
		return err
	}
	if now != cluster {
		r.say("  %s is %q, not this action's %s: left to the action that wrote it", key, now, cluster)
		return nil
	}
	_, err := r.operate(append(args, "--auto")...)
	return err
}

// applyStage: a staged move of orders to B, checked for 5 s; heal: the
// move ended (orders back to the fleet's cluster).
func (r *run) applyStage(target string, heal bool) error {
	_, cluster, _ := strings.Cut(target, "@")
	args := []string{"failover", "--config", r.confFile()}
	if heal {
		_, err := r.operate(append(args, "--auto", "--stages=")...)
		return err
	}
	_, err := r.operate(append(args, "--to", cluster, "--stages", "orders", "--check", "5s")...)
	return err
}

// opFile writes an input file of an action into the run's directory.
func (r *run) opFile(name, content string) (string, error) {
	dir := filepath.Join(r.cfg.Dir, "ops")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	p := filepath.Join(dir, name)
	return p, os.WriteFile(p, []byte(content), 0o644)
}

// applyRoutes: kswitch routes apply of a version that routes every record
// to out, written differently from the file (two rules by partition, mode
// all, out redefined: lz4 at_least_once, acks spelled out exactly_once,
// whose transactions take no compression); then a rules file naming a channel that
// does not exist, which the CLI must refuse; then a bad value of
// channels/out put by hand, which every agent must refuse, keeping the
// version in force. Heal: routes and channels/out deleted (the file's
// routing again).
func (r *run) applyRoutes(target string, heal bool) error {
	k := keys.New(fleetName)
	redefined := "compression: lz4"
	if r.cfg.Mode == ExactlyOnce {
		redefined = "acks: all"
	}
	if heal {
		return r.etcdDo("del "+k.Routes()+" "+k.Channel("out"), func(ctx context.Context, c *clientv3.Client) error {
			_, err := c.Txn(ctx).Then(clientv3.OpDelete(k.Routes()), clientv3.OpDelete(k.Channel("out"))).Commit()
			return err
		})
	}
	good, err := r.opFile("routes-good.yaml", fmt.Sprintf(`mode: all
rules:
  - name: even
    match: 'partition %% 2 == 0'
    channels: [out]
  - name: odd
    match: 'partition %% 2 == 1'
    channels: [out]
default: [out]
channels:
  out: {cluster: C, topic: %s, partitioner: manual-same-partition, %s}
`, r.stack.info.OutTopic, redefined))
	if err != nil {
		return err
	}
	bad, err := r.opFile("routes-bad.yaml", "mode: first\nrules:\n  - name: lost\n    match: 'true'\n    channels: [nowhere]\ndefault: [out]\n")
	if err != nil {
		return err
	}
	if _, err := r.operate("routes", "apply", "-f", good, "--config", r.confFile()); err != nil {
		return err
	}
	if err := r.refuse([]string{"is invalid"}, "routes", "apply", "-f", bad, "--config", r.confFile()); err != nil {
		return err
	}
	return r.putBad("channel", k.Channel("out"), "cluster: C\ntopic: out\npartitioner: bogus\n")
}

// applyConfig: kswitch config apply of C redefined (same brokers, a new
// client_id: the agents replace C's producers), which the leader accepts
// unless C is down at the time; then a file with an unknown
// initial_offset, which the CLI must refuse; then B's brokers moved to an
// address where nothing listens, written past the CLI's own check
// (--no-reach), which the leader must refuse, the version in force
// staying. Heal: the keys deleted (the file's configuration again); no
// version in force may ever have held the bad brokers.
func (r *run) applyConfig(target string, heal bool) error {
	k := keys.New(fleetName)
	const nowhere = "127.0.0.1:1"
	if heal {
		var s state.ConfigState
		err := r.etcdDo("del "+k.ConfigClusters()+"{B,C}; get "+k.StateConfig(), func(ctx context.Context, c *clientv3.Client) error {
			var err error
			if s, err = state.ReadConfigState(ctx, c, k); err != nil {
				return err
			}
			_, err = c.Txn(ctx).Then(clientv3.OpDelete(k.ConfigCluster("B")), clientv3.OpDelete(k.ConfigCluster("C"))).Commit()
			return err
		})
		if err != nil {
			return err
		}
		if b, ok := s.Version.Overrides.Clusters["B"]; ok && slices.Contains(b.Brokers, nowhere) {
			return opViolation("state/config version %d holds B's brokers %v, the bad value: it was put in force", s.Version.Number, b.Brokers)
		}
		return nil
	}
	good, err := r.opFile("config-good.yaml", fmt.Sprintf("clusters:\n  C:\n    brokers: [%s]\n    role: sink\n    delivery: %s\n    client_id: kswitch-chaos-v2\n",
		strings.Join(r.stack.info.Clusters["C"], ", "), r.cfg.Mode))
	if err != nil {
		return err
	}
	badFile, err := r.opFile("config-bad-file.yaml", "source:\n  topics: [orders]\n  initial_offset: sometimes\n")
	if err != nil {
		return err
	}
	badLeader, err := r.opFile("config-bad-brokers.yaml", fmt.Sprintf("clusters:\n  B:\n    brokers: [%s]\n    role: standby\n", nowhere))
	if err != nil {
		return err
	}
	wait := "--wait=" + configVerdictWait.String()
	code, out := r.kswitchCLI("config", "apply", "-f", good, "--config", r.confFile(), wait)
	r.say("  config apply (C's client_id): exit %d: %s", code, lastLine(out))
	if err := r.refuse([]string{"is invalid; nothing written"}, "config", "apply", "-f", badFile, "--config", r.confFile(), wait); err != nil {
		return err
	}
	// The leader refuses, or gives no verdict within the wait (no leader
	// now): either way exit 1; the heal checks the version in force.
	return r.refuse([]string{"the leader refused it", "no verdict from a leader"}, "config", "apply", "-f", badLeader, "--config", r.confFile(), "--no-reach", wait)
}

// applyPartitionsAdd asks the stack to add partitions to orders on the
// cluster its producer writes to (the producer writes to them from then
// on; the mirror creates and copies them on the other cluster, as
// MirrorMaker 2 does). Partitions are not removed: the heal does nothing.
func (r *run) applyPartitionsAdd(target string, heal bool) error {
	if heal {
		return nil
	}
	var res struct {
		Cluster string `json:"cluster"`
		Before  int32  `json:"before"`
		After   int32  `json:"after"`
	}
	err := r.stack.postJSON("/partitions", map[string][]string{"topic": {target}, "add": {"1"}}, &res)
	if err != nil && strings.Contains(err.Error(), http.StatusText(http.StatusServiceUnavailable)) {
		// The cluster did not take the request (stopped, failed, hung):
		// an operator's kafka-topics --alter fails the same way.
		r.say("  %s: not added: %v", target, err)
		return nil
	}
	if err != nil {
		return err
	}
	if res.After == res.Before {
		r.say("  %s on %s has %d partitions, as many as out: none added", target, res.Cluster, res.Before)
	} else {
		r.say("  %s on %s: %d → %d partitions", target, res.Cluster, res.Before, res.After)
	}
	return nil
}

// postJSON posts to the stack's control API and decodes its JSON answer.
func (s *stackProc) postJSON(path string, q url.Values, v any) error {
	resp, err := httpClient.Post("http://"+s.control+path+"?"+q.Encode(), "text/plain", nil)
	if err != nil {
		return fmt.Errorf("chaos: stack %s %v: %w", path, q, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("chaos: stack %s %v: %s: %s", path, q, resp.Status, strings.TrimSpace(string(b)))
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

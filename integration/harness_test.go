//go:build integration

package integration

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kswitch/kswitch/internal/freeport"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// binaries returns the kswitch binary and the directory holding etcd and
// etcdctl, as `make integration` passes them.
func binaries(t *testing.T) (kswitch, etcdDir string) {
	t.Helper()
	kswitch, etcdDir = os.Getenv("KSWITCH_TEST_BIN"), os.Getenv("KSWITCH_TEST_ETCD_DIR")
	if kswitch == "" || etcdDir == "" {
		fatal(t, "KSWITCH_TEST_BIN and KSWITCH_TEST_ETCD_DIR are not set: run the suite with `make integration`")
	}
	for _, p := range []string{kswitch, filepath.Join(etcdDir, "etcd"), filepath.Join(etcdDir, "etcdctl")} {
		if _, err := os.Stat(p); err != nil {
			fatalf(t, "%v: run the suite with `make integration`, which builds it", err)
		}
	}
	return kswitch, etcdDir
}

// freePort returns a loopback port that was free a moment ago, outside the
// kernel's ephemeral range when possible (an ephemeral port can become
// the local port of an outgoing connection before a broker binds it).
func freePort(t *testing.T) int {
	t.Helper()
	port, err := freeport.Port()
	if err != nil {
		fatal(t, err)
	}
	return port
}

// logDir returns the directory that holds the log files of t's processes,
// one per test (subtests get their own): $KSWITCH_TEST_LOG_DIR/<test name>,
// or under the system temp directory. It is emptied when first used, kept
// when the test fails or KSWITCH_TEST_KEEP_LOGS is set (its path is
// logged), and removed when it passes.
func logDir(t *testing.T) string {
	t.Helper()
	logDirsMu.Lock()
	defer logDirsMu.Unlock()
	if d, ok := logDirs[t]; ok {
		return d
	}
	root := os.Getenv("KSWITCH_TEST_LOG_DIR")
	if root == "" {
		root = filepath.Join(os.TempDir(), "kswitch-integration")
	}
	dir := filepath.Join(root, filepath.FromSlash(t.Name()))
	if err := os.RemoveAll(dir); err != nil {
		fatal(t, err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		fatal(t, err)
	}
	logDirs[t] = dir
	// Registered before any process's cleanup, so it runs after all of them.
	t.Cleanup(func() {
		logDirsMu.Lock()
		delete(logDirs, t)
		logDirsMu.Unlock()
		if t.Failed() || os.Getenv("KSWITCH_TEST_KEEP_LOGS") != "" {
			t.Logf("logs of every process kept in %s", dir)
			// Last, so that a CI summary showing only the tail of the
			// output shows it: what failed, beside the processes' logs.
			for _, line := range recaps.take(t) {
				t.Logf("recap: %s", line)
			}
			return
		}
		_ = os.RemoveAll(dir)
		_ = os.Remove(filepath.Dir(dir)) // a parent test's directory, once empty
	})
	return dir
}

var (
	logDirsMu sync.Mutex
	logDirs   = map[*testing.T]string{}
)

// recaps are the failures of a test that its log directory's cleanup
// repeats at the very end of its output (processes that exited by
// themselves, the waits that timed out).
var recaps = &recapList{lines: map[testing.TB][]string{}}

type recapList struct {
	mu    sync.Mutex
	lines map[testing.TB][]string
}

func (r *recapList) add(t testing.TB, format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.lines[t] = append(r.lines[t], fmt.Sprintf(format, args...))
}

func (r *recapList) take(t testing.TB) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.lines[t]
	delete(r.lines, t)
	return out
}

// errorf, fatalf, fatal and fail fail the test as t's methods of the same
// names do, and repeat what failed in the recap at the end of the test's
// output: a failed test prints its processes' logs after its errors, and
// a CI summary keeping only the output's tail shows the recap and logs,
// not the errors (a CI run's TestRoutesOnRealKafka failed without them).
func errorf(t testing.TB, format string, args ...any) {
	t.Helper()
	recaps.add(t, "error: "+format, args...)
	t.Errorf(format, args...)
}

func fatalf(t testing.TB, format string, args ...any) {
	t.Helper()
	recaps.add(t, "fatal: "+format, args...)
	t.Fatalf(format, args...)
}

func fatal(t testing.TB, args ...any) {
	t.Helper()
	recaps.add(t, "fatal: %s", strings.TrimSuffix(fmt.Sprintln(args...), "\n"))
	t.Fatal(args...)
}

func fail(t testing.TB, args ...any) {
	t.Helper()
	recaps.add(t, "error: %s", strings.TrimSuffix(fmt.Sprintln(args...), "\n"))
	t.Error(args...)
}

// waitFor is wait.For with its timeout in the recap.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() error) {
	t.Helper()
	if err := wait.Until(timeout, cond); err != nil {
		fatalf(t, "%s: not true after %v: %v", what, timeout, err)
	}
}

// proc is one OS process of the suite. Its output goes to a log file in
// logDir, appended to when a process of the same name is started again;
// its tail is printed when the test fails.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
	err  error // set before done is closed
	// expected is set once the suite makes the process end (a signal,
	// closing its input); any other exit fails the test at once.
	expected atomic.Bool
}

// procOptions adjust how startProcWith runs a process.
type procOptions struct {
	// Env is added to the test's environment.
	Env []string
	// Stdin, when set, is the process's standard input.
	Stdin io.Reader
}

func startProc(t *testing.T, name string, bin string, args ...string) *proc {
	t.Helper()
	return startProcWith(t, procOptions{}, name, bin, args...)
}

func startProcWith(t *testing.T, o procOptions, name string, bin string, args ...string) *proc {
	t.Helper()
	logPath := filepath.Join(logDir(t), name+".log")
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		fatal(t, err)
	}
	fmt.Fprintf(f, "=== %s: %s %s\n", time.Now().Format(time.RFC3339Nano), bin, strings.Join(args, " "))
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Stdin = o.Stdin
	if len(o.Env) > 0 {
		cmd.Env = append(os.Environ(), o.Env...)
	}
	// Pdeathsig: when the test binary dies (a -timeout panic, a kill), its
	// processes die with it instead of holding ports and CPU.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		fatalf(t, "start %s: %v", name, err)
	}
	p := &proc{name: name, cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		if !p.expected.Load() {
			recaps.add(t, "%s (pid %d) exited by itself: %v", name, cmd.Process.Pid, p.err)
			errorf(t, "%s (pid %d) exited by itself: %v; last output:\n%s", name, cmd.Process.Pid, p.err, tail(logPath, 30))
		}
		f.Close()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.signal(syscall.SIGKILL)
		<-p.done
		if t.Failed() {
			t.Logf("--- last output of %s (%s):\n%s", name, logPath, tail(logPath, 25))
		}
	})
	return p
}

// tail returns the last n lines of the file at path.
func tail(path string, n int) string {
	out, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	keep := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
	if len(keep) > n {
		keep = keep[len(keep)-n:]
	}
	for i, l := range keep {
		if len(l) > 600 {
			keep[i] = l[:600] + "…"
		}
	}
	return strings.Join(keep, "\n")
}

func (p *proc) signal(sig syscall.Signal) {
	if sig != syscall.SIGSTOP && sig != syscall.SIGCONT {
		p.expected.Store(true)
	}
	select {
	case <-p.done:
	default:
		_ = p.cmd.Process.Signal(sig)
	}
}

// wait waits for the process to exit and returns its error.
func (p *proc) wait(timeout time.Duration) error {
	select {
	case <-p.done:
		return p.err
	case <-time.After(timeout):
		return fmt.Errorf("%s still running after %v", p.name, timeout)
	}
}

func (p *proc) running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// etcdCluster is a cluster of real etcd server processes.
type etcdCluster struct {
	dir     string
	members []*etcdMember
}

type etcdMember struct {
	name       string
	client     string // host:port
	peer       string
	dataDir    string
	proc       *proc
	clusterArg string
}

func startEtcdCluster(t *testing.T, n int) *etcdCluster {
	t.Helper()
	_, dir := binaries(t)
	c := &etcdCluster{dir: dir}
	var initial []string
	for i := range n {
		m := &etcdMember{
			name:    fmt.Sprintf("etcd%d", i),
			client:  fmt.Sprintf("127.0.0.1:%d", freePort(t)),
			peer:    fmt.Sprintf("127.0.0.1:%d", freePort(t)),
			dataDir: filepath.Join(t.TempDir(), fmt.Sprintf("etcd%d", i)),
		}
		c.members = append(c.members, m)
		initial = append(initial, m.name+"=http://"+m.peer)
	}
	for _, m := range c.members {
		m.clusterArg = strings.Join(initial, ",")
		c.start(t, m, "new")
	}
	waitFor(t, 60*time.Second, "etcd cluster healthy", func() error {
		_, err := c.etcdctl("endpoint", "health", "--cluster")
		return err
	})
	return c
}

func (c *etcdCluster) start(t *testing.T, m *etcdMember, state string) {
	t.Helper()
	m.proc = startProc(t, m.name, filepath.Join(c.dir, "etcd"),
		"--name", m.name,
		"--data-dir", m.dataDir,
		"--listen-client-urls", "http://"+m.client,
		"--advertise-client-urls", "http://"+m.client,
		"--listen-peer-urls", "http://"+m.peer,
		"--initial-advertise-peer-urls", "http://"+m.peer,
		"--initial-cluster", m.clusterArg,
		"--initial-cluster-state", state,
		"--initial-cluster-token", "kswitch-integration",
		"--log-level", "warn",
	)
}

func (c *etcdCluster) endpoints() []string {
	var out []string
	for _, m := range c.members {
		out = append(out, m.client)
	}
	return out
}

// etcdctl runs the real etcdctl against every member and returns stdout.
func (c *etcdCluster) etcdctl(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	all := append([]string{"--endpoints", strings.Join(c.endpoints(), ","), "--dial-timeout", "2s", "--command-timeout", "5s"}, args...)
	cmd := exec.CommandContext(ctx, filepath.Join(c.dir, "etcdctl"), all...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("etcdctl %v: %w: %s", args, err, errOut.String())
	}
	return out.String(), nil
}

// agentProc is a `kswitch agent` process.
type agentProc struct {
	id   string
	http string
	conf string
	*proc
}

// agentConfig is what differs between the agents' configuration files.
type agentConfig struct {
	Endpoints []string
	// Clusters is the YAML body of clusters: (indented two spaces); the
	// default names two brokers that do not exist, for tests that need no
	// Kafka.
	Clusters string
	// Source and Failover are the YAML bodies of those sections; empty
	// leaves the defaults (Source: topic and group orders).
	Source   string
	Failover string
	// LogLevel is log.level; default info. The log format is JSON.
	LogLevel string
	// Extra is more top-level YAML (a routing section, say).
	Extra string
}

func writeAgentConfig(t *testing.T, id string, endpoints []string) (path, httpAddr string) {
	t.Helper()
	return writeAgentConfigWith(t, id, agentConfig{Endpoints: endpoints})
}

func writeAgentConfigWith(t *testing.T, id string, c agentConfig) (path, httpAddr string) {
	t.Helper()
	if c.Clusters == "" {
		c.Clusters = "  A: {brokers: [127.0.0.1:9092], role: primary}\n  B: {brokers: [127.0.0.1:9093], role: standby}\n"
	}
	if c.Source == "" {
		c.Source = "  topics: [orders]\n  group: orders\n"
	}
	if c.LogLevel == "" {
		c.LogLevel = "info"
	}
	httpAddr = fmt.Sprintf("127.0.0.1:%d", freePort(t))
	conf := fmt.Sprintf(`fleet: orders
log: {format: json, level: %s}
agent:
  id: %s
  http: %s
  gossip: 127.0.0.1:%d
etcd:
  endpoints: [%s]
  session_ttl: %s
  request_timeout: 1s
clusters:
%ssource:
%s`, c.LogLevel, id, httpAddr, freePort(t), strings.Join(c.Endpoints, ", "), sessionTTL, c.Clusters, c.Source)
	if c.Failover != "" {
		conf += "failover:\n" + c.Failover
	}
	conf += c.Extra
	path = filepath.Join(t.TempDir(), id+".yaml")
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		fatal(t, err)
	}
	return path, httpAddr
}

func startAgent(t *testing.T, id string, endpoints []string) *agentProc {
	t.Helper()
	return startAgentWith(t, id, agentConfig{Endpoints: endpoints})
}

func startAgentWith(t *testing.T, id string, c agentConfig) *agentProc {
	t.Helper()
	bin, _ := binaries(t)
	conf, httpAddr := writeAgentConfigWith(t, id, c)
	return &agentProc{id: id, http: httpAddr, conf: conf,
		proc: startProc(t, id, bin, "agent", "--config", conf)}
}

// restart starts the agent again with its configuration.
func (a *agentProc) restart(t *testing.T) {
	t.Helper()
	bin, _ := binaries(t)
	a.proc = startProc(t, a.id, bin, "agent", "--config", a.conf)
}

type leaderView struct {
	Leader       string `json:"leader"`
	Self         bool   `json:"self"`
	FencingToken int64  `json:"fencing_token"`
}

func getJSON(url string, v any) (int, error) {
	c := http.Client{Timeout: time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	return resp.StatusCode, json.NewDecoder(resp.Body).Decode(v)
}

// agreedLeader returns the leader every running agent names over HTTP, when
// exactly one of them reports self.
func agreedLeader(agents []*agentProc) (string, int64, error) {
	var self []string
	views := map[string]leaderView{}
	for _, a := range agents {
		var v leaderView
		if _, err := getJSON("http://"+a.http+"/leader", &v); err != nil {
			return "", 0, fmt.Errorf("%s: %w", a.id, err)
		}
		views[a.id] = v
		if v.Self {
			self = append(self, a.id)
		}
	}
	if len(self) != 1 {
		return "", 0, fmt.Errorf("agents reporting self: %v (%v)", self, views)
	}
	for id, v := range views {
		if v.Leader != self[0] || v.FencingToken != views[self[0]].FencingToken {
			return "", 0, fmt.Errorf("%s names %q/%d, but %s leads: %v", id, v.Leader, v.FencingToken, self[0], views)
		}
	}
	return self[0], views[self[0]].FencingToken, nil
}

// metric returns the value of the unlabelled metric name on the agent's
// /metrics (Prometheus text format).
func (a *agentProc) metric(name string) (float64, error) {
	c := http.Client{Timeout: time.Second}
	resp, err := c.Get("http://" + a.http + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) == 2 && f[0] == name {
			return strconv.ParseFloat(f[1], 64)
		}
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("%s /metrics: %w", a.id, err)
	}
	return 0, fmt.Errorf("%s /metrics has no %s", a.id, name)
}

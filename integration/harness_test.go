//go:build integration

package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kswitch/kswitch/internal/wait"
)

// binaries returns the kswitch binary and the directory holding etcd and
// etcdctl, as `make integration` passes them.
func binaries(t *testing.T) (kswitch, etcdDir string) {
	t.Helper()
	kswitch, etcdDir = os.Getenv("KSWITCH_TEST_BIN"), os.Getenv("KSWITCH_TEST_ETCD_DIR")
	if kswitch == "" || etcdDir == "" {
		t.Fatal("KSWITCH_TEST_BIN and KSWITCH_TEST_ETCD_DIR are not set: run the suite with `make integration`")
	}
	for _, p := range []string{kswitch, filepath.Join(etcdDir, "etcd"), filepath.Join(etcdDir, "etcdctl")} {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("%v: run the suite with `make integration`, which builds it", err)
		}
	}
	return kswitch, etcdDir
}

// freePort returns a loopback port that was free a moment ago.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// proc is one OS process of the suite. Its output goes to a log file that
// is printed when the test fails.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
	err  error // set before done is closed
}

func startProc(t *testing.T, name string, bin string, args ...string) *proc {
	t.Helper()
	logPath := filepath.Join(t.TempDir(), name+".log")
	f, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		f.Close()
		t.Fatalf("start %s: %v", name, err)
	}
	p := &proc{name: name, cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		f.Close()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.signal(syscall.SIGKILL)
		<-p.done
		if t.Failed() {
			out, _ := os.ReadFile(logPath)
			if len(out) > 8000 {
				out = out[len(out)-8000:]
			}
			t.Logf("--- last output of %s:\n%s", name, out)
		}
	})
	return p
}

func (p *proc) signal(sig syscall.Signal) {
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
	wait.For(t, 60*time.Second, "etcd cluster healthy", func() error {
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

func writeAgentConfig(t *testing.T, id string, endpoints []string) (path, httpAddr string) {
	t.Helper()
	httpAddr = fmt.Sprintf("127.0.0.1:%d", freePort(t))
	conf := fmt.Sprintf(`fleet: orders
log: {format: console, level: info}
agent:
  id: %s
  http: %s
  gossip: 127.0.0.1:%d
etcd:
  endpoints: [%s]
  session_ttl: 2s
  request_timeout: 1s
clusters:
  A: {brokers: [127.0.0.1:9092], role: primary}
  B: {brokers: [127.0.0.1:9093], role: standby}
source:
  topics: [orders]
  group: orders
`, id, httpAddr, freePort(t), strings.Join(endpoints, ", "))
	path = filepath.Join(t.TempDir(), id+".yaml")
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	return path, httpAddr
}

func startAgent(t *testing.T, id string, endpoints []string) *agentProc {
	t.Helper()
	bin, _ := binaries(t)
	conf, httpAddr := writeAgentConfig(t, id, endpoints)
	return &agentProc{id: id, http: httpAddr, conf: conf, proc: startProc(t, id, bin, "agent", "--config", conf)}
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

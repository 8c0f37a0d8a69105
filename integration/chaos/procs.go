//go:build chaos

package chaos

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kswitch/kswitch/internal/freeport"
)

// proc is one OS process of the run, its output appended to a log file.
// Its waiter goroutine ends when the process does; Kill waits for it.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  *os.File
	done chan struct{}
	err  error // set before done closes

	mu       sync.Mutex
	expected bool // an exit now is the run's doing
}

func startProc(logPath, name, bin string, args ...string) (*proc, error) {
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(f, "=== %s: %s %s\n", time.Now().Format(time.RFC3339Nano), bin, strings.Join(args, " "))
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	// Pdeathsig: when the driver dies, its processes die with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("chaos: start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, log: f, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		f.Close()
		close(p.done)
	}()
	return p, nil
}

// signal sends sig unless the process has exited; SIGKILL and SIGTERM mark
// its exit as expected.
func (p *proc) signal(sig syscall.Signal) {
	if sig == syscall.SIGKILL || sig == syscall.SIGTERM {
		p.mu.Lock()
		p.expected = true
		p.mu.Unlock()
	}
	select {
	case <-p.done:
	default:
		_ = p.cmd.Process.Signal(sig)
	}
}

// kill SIGKILLs the process and waits for it to exit.
func (p *proc) kill() {
	p.signal(syscall.SIGKILL)
	<-p.done
}

// exitedByItself reports whether the process ended without the run
// killing it, and how.
func (p *proc) exitedByItself() (bool, error) {
	select {
	case <-p.done:
	default:
		return false, nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return !p.expected, p.err
}

// stackProc is the stack program (integration/chaos/stack) and its control
// API.
type stackProc struct {
	*proc
	control string // host:port
	info    stackInfo
}

// stackInfo is the stack's GET /info.
type stackInfo struct {
	Etcd          []string            `json:"etcd"`
	Clusters      map[string][]string `json:"clusters"`
	Topic         string              `json:"topic"`
	OutTopic      string              `json:"out_topic"`
	Partitions    int32               `json:"partitions"`     // of orders at the start
	OutPartitions int32               `json:"out_partitions"` // of out on C; orders grows to that many at most
}

// producedSource is one source partition of the stack's GET /produced.
type producedSource struct {
	Origin    string  `json:"origin"`
	Partition int32   `json:"partition"`
	Next      int64   `json:"next"`
	Unknown   []int64 `json:"unknown"`
}

func startStack(bin, dir string, rate int) (*stackProc, error) {
	ready := filepath.Join(dir, "stack.addr")
	p, err := startProc(filepath.Join(dir, "stack.log"), "stack", bin,
		"-dir", filepath.Join(dir, "data"), "-ready", ready, "-rate", fmt.Sprint(rate))
	if err != nil {
		return nil, err
	}
	s := &stackProc{proc: p}
	deadline := time.Now().Add(60 * time.Second)
	for {
		if b, err := os.ReadFile(ready); err == nil && len(b) > 0 {
			s.control = string(b)
			break
		}
		if by, err := p.exitedByItself(); by {
			return nil, fmt.Errorf("chaos: the stack exited: %v (see %s)", err, p.log.Name())
		}
		if time.Now().After(deadline) {
			p.kill()
			return nil, fmt.Errorf("chaos: the stack did not serve within 60 s (see %s)", p.log.Name())
		}
		time.Sleep(100 * time.Millisecond) // polling a file the stack writes
	}
	if err := s.get("/info", &s.info); err != nil {
		p.kill()
		return nil, err
	}
	return s, nil
}

var httpClient = &http.Client{Timeout: 30 * time.Second}

func (s *stackProc) get(path string, v any) error {
	resp, err := httpClient.Get("http://" + s.control + path)
	if err != nil {
		return fmt.Errorf("chaos: stack %s: %w", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("chaos: stack %s: %s: %s", path, resp.Status, b)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

func (s *stackProc) post(path string, q url.Values) error {
	resp, err := httpClient.Post("http://"+s.control+path+"?"+q.Encode(), "text/plain", nil)
	if err != nil {
		return fmt.Errorf("chaos: stack %s %v: %w", path, q, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("chaos: stack %s %v: %s: %s", path, q, resp.Status, strings.TrimSpace(string(b)))
	}
	return nil
}

// fault asks the stack to apply action to target.
func (s *stackProc) fault(target, action string) error {
	return s.post("/fault", url.Values{"target": {target}, "action": {action}})
}

// agentProc is one `kswitch agent` process, started again on the same
// configuration (ports, id) after a kill.
type agentProc struct {
	id, http string
	bin      string
	conf     string // what the agent runs with: etcd and the clusters through its links (net)
	// directConf is the same configuration without the links, for a
	// client that acts beside the fleet (an operator).
	directConf string
	logPath    string
	net        *agentNet // the agent's links to etcd and the clusters; closed by closeNet

	mu          sync.Mutex
	p           *proc
	incarnation int
	stopped     bool // SIGSTOPped
}

// Mode is the delivery of the channel's cluster C.
type Mode string

// The delivery modes a run can check.
const (
	AtLeastOnce Mode = "at_least_once"
	ExactlyOnce Mode = "exactly_once"
)

// Agent timing of a chaos run: short, so that faults heal within seconds.
const (
	commitInterval = 200 * time.Millisecond
	sessionTTL     = 3 * time.Second
	failbackStable = 5 * time.Second
)

func newAgent(bin, dir, id string, in stackInfo, mode Mode) (*agentProc, error) {
	ports, err := freeport.Ports(2)
	if err != nil {
		return nil, err
	}
	n, err := startAgentNet(id, in)
	if err != nil {
		return nil, err
	}
	a := &agentProc{id: id, http: fmt.Sprintf("127.0.0.1:%d", ports[0]), bin: bin,
		conf: filepath.Join(dir, id+".yaml"), directConf: filepath.Join(dir, id+"-direct.yaml"),
		logPath: filepath.Join(dir, id+".log"), net: n}
	conf := func(etcd []string, proxy string) string {
		if proxy != "" {
			proxy = ", proxy: " + proxy
		}
		return fmt.Sprintf(`fleet: chaos
log: {format: json, level: info}
agent:
  id: %s
  http: %s
  gossip: 127.0.0.1:%d
etcd:
  endpoints: [%s]
  session_ttl: %s
  request_timeout: 1s
clusters:
  A: {brokers: [%s], role: primary, offset_syncs_on: target%s}
  B: {brokers: [%s], role: standby, offset_syncs_on: target%s}
  C: {brokers: [%s], role: sink, delivery: %s%s}
source:
  topics: [%s]
  group: chaos
  initial_offset: oldest
  commit_interval: %s
failover:
  probe_interval: 250ms
  probe_timeout: 500ms
  failure_window: 1500ms
  failback: auto
  failback_stable: %s
routing:
  default: [out]
  channels:
    out: {cluster: C, topic: %s, partitioner: manual-same-partition}
`, id, a.http, ports[1], strings.Join(etcd, ", "), sessionTTL,
			strings.Join(in.Clusters["A"], ", "), proxy, strings.Join(in.Clusters["B"], ", "), proxy,
			strings.Join(in.Clusters["C"], ", "), mode, proxy,
			in.Topic, commitInterval, failbackStable, in.OutTopic)
	}
	err = os.WriteFile(a.conf, []byte(conf(n.etcdEndpoints(), n.proxyURL())), 0o600)
	if err == nil {
		err = os.WriteFile(a.directConf, []byte(conf(in.Etcd, "")), 0o600)
	}
	if err == nil {
		err = a.start()
	}
	if err != nil {
		n.close()
		return nil, err
	}
	return a, nil
}

// closeNet stops the agent's links (after its process ended).
func (a *agentProc) closeNet() { a.net.close() }

// start starts the agent's process (again).
func (a *agentProc) start() error {
	p, err := startProc(a.logPath, a.id, a.bin, "agent", "--config", a.conf)
	if err != nil {
		return err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.p, a.stopped = p, false
	a.incarnation++
	return nil
}

// current returns the running process and its incarnation, and whether it
// is SIGSTOPped.
func (a *agentProc) current() (*proc, int, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.p, a.incarnation, a.stopped
}

func (a *agentProc) kill() {
	p, _, _ := a.current()
	p.kill()
}

func (a *agentProc) sigstop(stop bool) {
	a.mu.Lock()
	p := a.p
	a.stopped = stop
	a.mu.Unlock()
	if stop {
		p.signal(syscall.SIGSTOP)
	} else {
		p.signal(syscall.SIGCONT)
	}
}

// alive reports whether the agent's process runs and is not stopped.
func (a *agentProc) alive() bool {
	p, _, stopped := a.current()
	select {
	case <-p.done:
		return false
	default:
		return !stopped
	}
}

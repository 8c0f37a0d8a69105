package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

func TestMain(m *testing.M) {
	wait.VerifyTestMain(m, testenv.LeakOptions()...)
}

// output is an io.Writer the demo writes its timeline to while the test
// reads it.
type output struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (o *output) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.buf.Write(p)
}

func (o *output) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.buf.String()
}

// TestDemo plays the whole story with short calm phases and --keep-running:
// the summary, read back from C, has every record A acknowledged and the
// measured times; the timeline shows each step; the URLs and the etcdctl
// line printed for the user work; and once ctx ends Run returns and
// everything it started has stopped (TestMain checks for goroutines left).
func TestDemo(t *testing.T) {
	out := &output{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	type result struct {
		s   Summary
		err error
	}
	done := make(chan result, 1)
	go func() {
		s, err := Run(ctx, Options{Agents: 3, Rate: 100, Duration: 4 * time.Second, KeepRunning: true, Out: out})
		done <- result{s, err}
	}()
	var res *result
	wait.For(t, 2*time.Minute, "the story told", func() error {
		select {
		case r := <-done:
			res = &r
			return nil
		default:
		}
		if !strings.Contains(out.String(), "Press Ctrl-C") {
			return fmt.Errorf("still playing; last lines:\n%s", tail(out.String(), 5))
		}
		return nil
	})
	if res != nil {
		t.Fatalf("Run returned before ctx ended: %v\n%s", res.err, out.String())
	}
	text := out.String()
	t.Logf("timeline:\n%s", text)
	for _, step := range []string{
		" leads (fencing token ",
		"put /kswitch/demo/signals/fleet pause",
		"paused: ",
		"put /kswitch/demo/signals/fleet start",
		"the mirror A → B falls behind",
		"cluster A's data centre fails",
		"the producer moves to B",
		"detected: the probes of ",
		"switch A → B (epoch ",
		"written on B: ",
		"the first record consumed from B reached C",
		"is killed (no clean stop)",
		"agent-4 joined and owns ",
		"switch B → A (epoch ",
		"A's unmirrored tail: ",
		"the first record consumed from A again reached C",
		"read C back: every partition of orders-out to its end",
	} {
		if !strings.Contains(text, step) {
			t.Errorf("the timeline has no line with %q", step)
		}
	}
	if !regexp.MustCompile(`lost +0\n`).MatchString(text) {
		t.Errorf("the printed summary does not say 0 lost")
	}

	checkURLs(t, text)
	checkRoutesLine(t, text)

	cancel()
	r := <-done
	if r.err != nil {
		t.Fatalf("Run: %v", r.err)
	}
	s := r.s
	t.Logf("summary: %+v", s)
	if s.Produced == 0 {
		t.Error("A acknowledged no record: the producer did not run")
	}
	if s.Lost != 0 || s.Delivered != s.Produced {
		t.Errorf("%d of %d records A acknowledged were read back from C (%d lost)", s.Delivered, s.Produced, s.Lost)
	}
	// The outage's story: the producer wrote to B while A was down, and
	// A returned with records B never had.
	if s.ProducedB == 0 || s.DeliveredB != s.ProducedB {
		t.Errorf("%d of the %d records written to B during the outage were read back from C", s.DeliveredB, s.ProducedB)
	}
	if s.Late == 0 {
		t.Error("the failback counted no unmirrored tail, though A took records while the mirror A → B was held")
	}
	if s.OnC != s.Delivered+s.Duplicated {
		t.Errorf("C holds %d records, %d distinct and %d duplicates", s.OnC, s.Delivered, s.Duplicated)
	}
	// Failover: the failure window (1.5s) then the switch; failback: the
	// stable window (3s) then the switch. Each is bounded by the story's
	// own waits (20s and 60s); here only that they were measured, and
	// are no shorter than the windows that decide them. The failure
	// window counts from each agent's last successful probe of A, which
	// came before A failed by at most a probe interval (250ms) and a
	// probe (at most its 500ms timeout): so the failover is at least
	// 1.5s - 0.75s after the failure (1.45s in a CI run, where the
	// records from B reached C within 20ms of the switch).
	if s.Failover < 750*time.Millisecond {
		t.Errorf("failover measured as %v, shorter than the failure window 1.5s less a probe interval and a probe timeout", s.Failover)
	}
	if s.Failback < 3*time.Second {
		t.Errorf("failback measured as %v, shorter than the stable window 3s", s.Failback)
	}
}

// checkURLs gets every /status URL printed for the user.
func checkURLs(t *testing.T, text string) {
	t.Helper()
	urls := regexp.MustCompile(`curl (http://\S+/status)`).FindAllStringSubmatch(text, -1)
	if len(urls) != 3 { // 3 agents, one killed, one joined
		t.Fatalf("%d agent URLs printed, want 3", len(urls))
	}
	for _, u := range urls {
		var st struct {
			Active string `json:"active_cluster"`
		}
		if err := getJSON(u[1], &st); err != nil {
			t.Fatalf("GET %s: %v", u[1], err)
		}
		if st.Active != "A" {
			t.Errorf("%s: active cluster %q, want A", u[1], st.Active)
		}
	}
	// The status page's address, and the page: both switches of the
	// story in its timeline, and the routing sink's status.
	page := regexp.MustCompile(`the status page.*\n +(http://\S+/)\n`).FindStringSubmatch(text)
	if page == nil {
		t.Fatal("no status page address printed")
	}
	resp, err := http.Get(page[1])
	if err != nil {
		t.Fatalf("GET %s: %v", page[1], err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`<td id="active">A</td>`, "A → B", "B → A", `<pre id="routing">`} {
		if !strings.Contains(string(body), want) {
			t.Errorf("the status page %s has no %q", page[1], want)
		}
	}
}

// checkRoutesLine runs the printed etcdctl line that changes the routes
// (with an etcd client, as etcdctl would) and waits until every agent's
// router has that version in force.
func checkRoutesLine(t *testing.T, text string) {
	t.Helper()
	m := regexp.MustCompile(`etcdctl --endpoints (\S+) put (\S+/routes) '([^']*)'`).FindStringSubmatch(text)
	if m == nil {
		t.Fatal("no etcdctl line that changes the routes")
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{m[1]}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	if _, err := cli.Put(t.Context(), m[2], m[3]); err != nil {
		t.Fatalf("etcdctl put %s: %v", m[2], err)
	}
	for _, u := range regexp.MustCompile(`curl (http://\S+/status)`).FindAllStringSubmatch(text, -1) {
		wait.For(t, 10*time.Second, "the printed routes in force at "+u[1], func() error {
			var st struct {
				Handler struct {
					Rules       []string `json:"rules"`
					LastRefusal *struct {
						Reason string `json:"reason"`
					} `json:"last_refusal"`
				} `json:"handler"`
			}
			if err := getJSON(u[1], &st); err != nil {
				return err
			}
			if r := st.Handler.LastRefusal; r != nil {
				t.Fatalf("the printed routes were refused: %s", r.Reason)
			}
			if !slices.Equal(st.Handler.Rules, []string{"odd"}) {
				return fmt.Errorf("rules %v", st.Handler.Rules)
			}
			return nil
		})
	}
}

func getJSON(url string, v any) error {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("status %d", resp.StatusCode)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// TestDemoRefusesAFleetOfOne: one agent cannot show partitions moving.
func TestDemoRefusesAFleetOfOne(t *testing.T) {
	_, err := Run(t.Context(), Options{Agents: 1, Out: &output{}})
	if err == nil || !strings.Contains(err.Error(), "--agents 1") {
		t.Fatalf("Run with one agent: %v, want a refusal naming --agents", err)
	}
}

// TestDemoExactlyOnce plays the story with C exactly_once: an agent is
// killed while it delivers (its last transaction is aborted when the next
// owner fences it, and what it committed is skipped), another joins, the
// fleet fails over and back, and C, read read_committed, holds every
// record once.
func TestDemoExactlyOnce(t *testing.T) {
	out := &output{}
	s, err := Run(t.Context(), Options{Agents: 3, Rate: 200, Duration: 4 * time.Second, ExactlyOnce: true, Out: out})
	if err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if s.Produced == 0 || s.Lost != 0 || s.Duplicated != 0 || s.OnC != s.Produced {
		t.Errorf("produced %d, delivered %d, on C %d: %d lost, %d duplicated; want every record once\n%s",
			s.Produced, s.Delivered, s.OnC, s.Lost, s.Duplicated, out.String())
	}
	if !strings.Contains(out.String(), "is killed") || !strings.Contains(out.String(), "agent-4 joined") {
		t.Errorf("the story did not kill an agent and start another:\n%s", out.String())
	}
}

// TestDemoThreeClusters plays the chain story (--clusters 3) with C
// exactly_once: the fleet goes A → B → D and back to A directly, every
// record A acknowledged is read back from C once, and each switch was
// measured.
func TestDemoThreeClusters(t *testing.T) {
	out := &output{}
	s, err := Run(t.Context(), Options{Agents: 3, Rate: 100, Duration: 4 * time.Second, Clusters: 3, ExactlyOnce: true, Out: out})
	if err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	text := out.String()
	for _, step := range []string{
		"switch A → B (epoch 2)",
		"switch B → D (epoch 3)",
		"B's A.orders offset",
		"switch D → A (epoch 4): failback",
		"failback D → A (A back → first record from A on C)",
	} {
		if !strings.Contains(text, step) {
			t.Errorf("the timeline has no line with %q:\n%s", step, text)
		}
	}
	if s.Produced == 0 || s.Lost != 0 || s.Duplicated != 0 || s.OnC != s.Produced {
		t.Errorf("produced %d, delivered %d, on C %d: %d lost, %d duplicated; want every record once", s.Produced, s.Delivered, s.OnC, s.Lost, s.Duplicated)
	}
	if s.Failover == 0 || s.FailoverD == 0 || s.Failback == 0 {
		t.Errorf("switch times not all measured: A → B %v, B → D %v, D → A %v", s.Failover, s.FailoverD, s.Failback)
	}
}

func TestDemoRefusesFourClusters(t *testing.T) {
	_, err := Run(t.Context(), Options{Clusters: 4, Out: &output{}})
	if err == nil || !strings.Contains(err.Error(), "--clusters 4") {
		t.Fatalf("Run with four clusters: %v, want a refusal naming --clusters", err)
	}
}

package agent_test

import (
	"context"
	"encoding/json"
	"fmt"
	"html"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/state"
)

// chromium returns the headless browser's path, or skips t saying how to
// install it; under CI (.ci/run installs it) a missing browser fails t, so
// that a skipped browser test never passes there unseen.
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	const why = "no chromium on PATH (apt-get install chromium): the status page was not loaded in a browser"
	if os.Getenv("CI") != "" {
		t.Fatal(why)
	}
	t.Skip(why)
	return ""
}

// browse loads url in headless Chromium and returns the DOM after the
// page loaded; with screenshot set, it also saves the page there.
func browse(t *testing.T, browser, url, screenshot string) string {
	t.Helper()
	run := func(args ...string) []byte {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		args = append([]string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
			"--user-data-dir=" + t.TempDir()}, args...)
		out, err := exec.CommandContext(ctx, browser, args...).Output()
		if err != nil {
			var stderr string
			if ee, ok := err.(*exec.ExitError); ok {
				stderr = string(ee.Stderr)
			}
			t.Fatalf("%s %s: %v\n%s", browser, strings.Join(args, " "), err, stderr)
		}
		return out
	}
	dom := string(run("--dump-dom", url))
	if screenshot != "" {
		run("--hide-scrollbars", "--window-size=1280,1100", "--screenshot="+screenshot, url)
		if st, err := os.Stat(screenshot); err != nil || st.Size() == 0 {
			t.Fatalf("no screenshot at %s: %v", screenshot, err)
		}
		t.Logf("screenshot of %s: %s", url, screenshot)
	}
	return dom
}

// cellText returns the text of the element with id in dom, tags removed.
func cellText(dom, id string) string {
	m := regexp.MustCompile(`(?s)id="` + regexp.QuoteMeta(id) + `"[^>]*>(.*?)</[a-z0-9]+>`).FindStringSubmatch(dom)
	if m == nil {
		return ""
	}
	return strings.TrimSpace(regexp.MustCompile(`<[^>]+>`).ReplaceAllString(m[1], ""))
}

// TestStatusPageInABrowser: every agent serves the status page at /. Loaded
// in headless Chromium after a failover, the page of a follower shows the
// leader, the active cluster B with its epoch, the breaker, every agent
// ready, the assigned partitions with their owners, and the failover in
// the switch timeline with its reason and a square per partition. The
// page is read-only (a POST is refused) and its screenshot is saved
// (under $KSWITCH_TEST_SCREENSHOTS when set).
func TestStatusPageInABrowser(t *testing.T) {
	t.Parallel()
	browser := chromium(t)
	d := startDC(t)
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2"} {
		agents = append(agents, startConsumer(t, d.config(id), newLedger().handler(id)))
	}
	waitConsuming(t, 20*time.Second, "A", agents...)
	p := startProducer(t, d.a.Brokers(), "orders", 0)
	defer p.halt()
	d.a.Fail()
	waitConsuming(t, 30*time.Second, "B", agents...)
	leader := leaderOf(t, agents...)
	var follower *agent.Agent
	for _, a := range agents {
		if a != leader {
			follower = a
		}
	}
	url := "http://" + follower.HTTPAddr() + "/"
	// The rate is measured over seconds: wait until the page has one.
	var dom string
	wait.For(t, 30*time.Second, "the page showing the failover", func() error {
		resp, err := http.Get(url)
		if err != nil {
			return err
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if !strings.Contains(string(body), "failover:") {
			return fmt.Errorf("no failover on the page yet")
		}
		return nil
	})
	dir := os.Getenv("KSWITCH_TEST_SCREENSHOTS")
	if dir == "" {
		dir = t.TempDir()
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	dom = browse(t, browser, url, filepath.Join(dir, "status-page.png"))
	if !strings.Contains(dom, `<svg id="timeline"`) {
		t.Fatalf("the page has no switch timeline:\n%s", dom)
	}

	for id, want := range map[string]string{"fleet": "orders", "leader": leader.ID(), "active": "B", "phase": "active", "breaker": "closed"} {
		if got := cellText(dom, id); got != want {
			t.Errorf("the page's #%s says %q, want %q", id, got, want)
		}
	}
	for _, want := range []string{
		"epoch 2 A → B", "failover: ", // the failover and its reason
		"agent-1", "agent-2", "ready", // every agent and its answer
		"A.orders/0", // a partition on B, with its owner
	} {
		if !strings.Contains(dom, want) {
			t.Errorf("the page has no %q", want)
		}
	}
	svg, _, _ := strings.Cut(dom[strings.Index(dom, `<svg id="timeline"`)+1:], "</svg>")
	if n := strings.Count(svg, `<rect class="m-`); n != failoverPartitions {
		t.Errorf("the timeline shows %d partitions of the failover, want %d", n, failoverPartitions)
	}
	resp, err := http.Post(url, "text/plain", strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST / answered %d, want 405", resp.StatusCode)
	}
}

// TestLagMetricFollowsASlowHandler: kswitch_consumer_lag_records, which
// the lag alert and dashboard read, grows while the handler is slower
// than the producer (10 records/s a partition, against a producer of
// hundreds a second even on a loaded machine), and falls back once it
// keeps up.
func TestLagMetricFollowsASlowHandler(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	var slow atomic.Bool
	l := newLedger()
	h := l.handler("agent-1")
	a := startConsumer(t, d.config("agent-1"), record.HandlerFunc(func(ctx context.Context, r *record.Record) error {
		if slow.Load() {
			select {
			case <-time.After(100 * time.Millisecond):
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return h.Handle(ctx, r)
	}))
	waitConsuming(t, 20*time.Second, "A", a)
	lag := func() float64 {
		n, _ := metricValue(a, "kswitch_consumer_lag_records", map[string]string{"cluster": "A", "topic": "orders"})
		return n
	}
	slow.Store(true)
	p := startProducer(t, d.a.Brokers(), "orders", 0)
	defer p.halt()
	wait.For(t, 30*time.Second, "the lag growing behind a slow handler", func() error {
		if n := lag(); n < 200 {
			return fmt.Errorf("lag %v", n)
		}
		return nil
	})
	peak := lag()
	slow.Store(false)
	wait.For(t, 30*time.Second, "the lag falling once the handler keeps up", func() error {
		if n := lag(); n > 100 {
			return fmt.Errorf("lag %v (peak %v)", n, peak)
		}
		return nil
	})
	t.Logf("lag %v records behind the slow handler, %v once it kept up", peak, lag())
}

// TestStatusPageListsTopicEvents: the page lists history/topics/ (source
// topics re-created or resized): when, cluster, topic and the change, and
// a value it refuses.
func TestStatusPageListsTopicEvents(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	a := startAgent(t, e, "agent-1")
	cli := testenv.EtcdClientT(t, e)
	k := keys.New("orders")
	at := time.Date(2026, 12, 5, 10, 0, 0, 0, time.UTC)
	for _, ev := range []state.TopicEvent{
		{At: at, Kind: state.TopicPartitionsAdded, Cluster: "A", Topic: "orders", OldPartitions: 12, NewPartitions: 16},
		{At: at.Add(time.Minute), Kind: state.TopicRecreated, Cluster: "A", Topic: "orders", OldID: "id-old", NewID: "id-new",
			OldPartitions: 16, NewPartitions: 10},
	} {
		b, err := json.Marshal(ev)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Put(t.Context(), k.TopicEvent(ev.At.UnixNano()), string(b)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := cli.Put(t.Context(), k.TopicEvent(at.Add(2*time.Minute).UnixNano()), "{"); err != nil {
		t.Fatal(err)
	}
	_, b := httpGet(t, a.HTTPAddr(), "/")
	page := html.UnescapeString(string(b))
	for _, want := range []string{
		`<table id="topic-events">`,
		"<td>2026-12-05 10:00:00.000Z</td><td>A</td><td>orders</td><td>partitions added: 12 -> 16</td>",
		`<td>2026-12-05 10:01:00.000Z</td><td>A</td><td>orders</td><td class="warn">deleted and created again (id id-old -> id-new, 16 -> 10 partitions), consumed from its start</td>`,
		"topic event is not valid JSON",
	} {
		if !strings.Contains(page, want) {
			t.Errorf("the page has no %q", want)
		}
	}
	if t.Failed() {
		i := strings.Index(page, "<h2>Source topics</h2>")
		t.Logf("the page's source topics: %s", page[max(i, 0):min(max(i, 0)+1500, len(page))])
	}
}

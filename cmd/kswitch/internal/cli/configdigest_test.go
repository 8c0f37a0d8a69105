package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// routedConfig is goodConfig routing every record to topic on a sink.
func routedConfig(topic string) string {
	withSink := strings.Replace(goodConfig, "role: standby}\n", "role: standby}\n  C: {brokers: [127.0.0.1:9094], role: sink}\n", 1)
	return withSink + `routing:
  default: [out]
  channels:
    out: {cluster: C, topic: ` + topic + `}
`
}

// Three agents of a fleet, one of them with a file that routes to another
// topic (it would split the traffic): the leader flags it once in its
// log and in kswitch_agents_config_disagree, every agent's /status names
// it, and so does kswitch status, with its digest.
func TestStatusNamesTheAgentWhoseFileDiffers(t *testing.T) {
	e := testenv.StartEtcdT(t)
	files := map[string]string{"agent-1": routedConfig("orders-out"), "agent-2": routedConfig("orders-out"), "agent-3": routedConfig("elsewhere")}
	var agents []*agent.Agent
	logs := map[string]*observer.ObservedLogs{}
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		cfg, err := config.Parse([]byte(files[id]), id+".yaml")
		if err != nil {
			t.Fatal(err)
		}
		cfg.Agent.ID = id
		cfg.Etcd.Endpoints = e.Endpoints()
		core, observed := observer.New(zap.InfoLevel)
		logs[id] = observed
		a, err := agent.New(cfg, agent.Options{Logger: zap.New(zapcore.NewTee(core, zaptest.NewLogger(t).Named(id).Core()))})
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		agents = append(agents, a)
		t.Cleanup(func() { _ = a.Stop(context.Background()) })
		if id == "agent-2" {
			// The odd agent joins a fleet that already agrees, under a
			// leader of that fleet: with two agents registered and one of
			// them odd, the leader's digest would decide the tie.
			wait.For(t, 10*time.Second, "agent-1 or agent-2 leading both", func() error {
				for _, a := range agents {
					if a.Leading() && len(a.Registered()) == 2 {
						return nil
					}
				}
				return fmt.Errorf("no leader seeing 2 agents yet")
			})
		}
	}
	var leader *agent.Agent
	wait.For(t, 10*time.Second, "a leader that sees the three agents", func() error {
		for _, a := range agents {
			if a.Leading() && len(a.Registered()) == 3 {
				leader = a
				return nil
			}
		}
		return fmt.Errorf("no leader seeing 3 agents yet")
	})

	// The leader's log and metric.
	warned := func() int {
		return logs[leader.ID()].FilterMessageSnippet("configuration that differs from the fleet's").Len()
	}
	wait.For(t, 10*time.Second, "the leader's warning", func() error {
		if warned() == 0 {
			return fmt.Errorf("no warning yet")
		}
		return nil
	})
	w := logs[leader.ID()].FilterMessageSnippet("configuration that differs from the fleet's").All()[0]
	if got := fmt.Sprint(w.ContextMap()["disagree"]); !strings.Contains(got, "agent-3 (routing, digest ") || strings.Contains(got, "agent-1") ||
		strings.Contains(got, "agent-2") {
		t.Errorf("the leader's warning names %s, want agent-3 and its routing only", got)
	}
	if got := metric(t, leader.HTTPAddr(), "kswitch_agents_config_disagree"); got != "1" {
		t.Errorf("kswitch_agents_config_disagree on the leader = %q, want 1", got)
	}

	// Every agent's /status names it (each reads the registrations it
	// has seen: wait for its view).
	for _, a := range agents {
		wait.For(t, 10*time.Second, a.ID()+"'s /status naming agent-3", func() error {
			var st struct {
				ConfigDigest   map[string]string `json:"config_digest"`
				ConfigDisagree []struct {
					Agent   string   `json:"agent"`
					Digest  string   `json:"digest"`
					Differs []string `json:"differs"`
				} `json:"config_disagree"`
			}
			if code, err := getJSON("http://"+a.HTTPAddr()+"/status", &st); err != nil || code != http.StatusOK {
				return fmt.Errorf("/status: %d %v", code, err)
			}
			if len(st.ConfigDisagree) != 1 || st.ConfigDisagree[0].Agent != "agent-3" || fmt.Sprint(st.ConfigDisagree[0].Differs) != "[routing]" {
				return fmt.Errorf("config_disagree %+v, want agent-3 in routing", st.ConfigDisagree)
			}
			if a.ID() == "agent-3" && st.ConfigDigest["digest"] != st.ConfigDisagree[0].Digest {
				return fmt.Errorf("agent-3's own digest %v is not the one flagged, %+v", st.ConfigDigest, st.ConfigDisagree)
			}
			return nil
		})
	}

	// kswitch status lists each agent's digest and names agent-3's.
	code, out, stderr := run(t, nil, "status", "--etcd", e.Endpoints()[0], "--fleet", "orders", "--ask=false")
	if code != 0 {
		t.Fatalf("status: exit %d: %s", code, stderr)
	}
	line := regexp.MustCompile(`(?m)^  agent-3's configuration differs from the fleet's in routing: digest ([0-9a-f]{12}), the fleet's ([0-9a-f]{12})`).FindStringSubmatch(out)
	if line == nil {
		t.Fatalf("status does not name agent-3's configuration:\n%s", out)
	}
	if !regexp.MustCompile(`(?m)^agent-3 .*`+line[1]).MatchString(out) || !regexp.MustCompile(`(?m)^agent-1 .*`+line[2]).MatchString(out) {
		t.Errorf("the CONFIG column does not show agent-3's digest %s and agent-1's %s:\n%s", line[1], line[2], out)
	}
	if strings.Contains(out, "agent-1's configuration") || strings.Contains(out, "agent-2's configuration") {
		t.Errorf("status flags an agent that agrees:\n%s", out)
	}
	if n := warned(); n != 1 {
		t.Errorf("the leader warned %d times of one disagreement, want once", n)
	}
}

// metric returns the value of the unlabelled metric name on an agent's
// /metrics, "" when it is not there.
func metric(t *testing.T, addr, name string) string {
	t.Helper()
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^` + name + ` (\S+)$`).FindSubmatch(b)
	if m == nil {
		return ""
	}
	return string(m[1])
}

func getJSON(url string, v any) (int, error) {
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get(url)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	return resp.StatusCode, json.NewDecoder(resp.Body).Decode(v)
}

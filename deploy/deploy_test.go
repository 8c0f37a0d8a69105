// Package deploy holds the files operators deploy kswitch with: the
// Prometheus alert rules, the Grafana dashboard, and what runs the agents.
// Its tests check them against the code: every metric they name exists,
// the rules do what their tests say (promtool).
package deploy

import (
	"bytes"
	"encoding/json"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// metricNames returns the names of the metrics the project's code
// registers (prometheus.*Opts{Name: …} and prometheus.NewDesc), read from
// its non-test sources.
func metricNames(t *testing.T) map[string]bool {
	t.Helper()
	re := regexp.MustCompile(`(?:Name:\s*|NewDesc\()"(kswitch_[a-z0-9_]+)"`)
	names := map[string]bool{}
	err := filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != ".." && (d.Name() == "bin" || strings.HasPrefix(d.Name(), ".")) {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range re.FindAllSubmatch(b, -1) {
			names[string(m[1])] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(names) < 30 {
		t.Fatalf("found only %d metric names in the sources: %v", len(names), names)
	}
	return names
}

// checkNames fails t for every kswitch_ metric expr names that the code
// does not register (a histogram's _bucket, _sum and _count count as it).
func checkNames(t *testing.T, where, expr string, known map[string]bool) {
	t.Helper()
	for _, name := range regexp.MustCompile(`kswitch_[a-z0-9_]+`).FindAllString(expr, -1) {
		base := name
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			if b, ok := strings.CutSuffix(name, suffix); ok && known[b] {
				base = b
			}
		}
		if !known[base] {
			t.Errorf("%s: %s is no metric of kswitch (expression %q)", where, name, expr)
		}
	}
}

type rules struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Alert       string            `yaml:"alert"`
			Expr        string            `yaml:"expr"`
			For         string            `yaml:"for"`
			Labels      map[string]string `yaml:"labels"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

// TestAlertRules: the alert rules decode strictly, name only metrics the
// code exports, each has a severity, a summary and a description, and each
// is tested (alerts_test.yaml); promtool runs those tests when make test
// gives its path (KSWITCH_PROMTOOL).
func TestAlertRules(t *testing.T) {
	known := metricNames(t)
	b, err := os.ReadFile("prometheus/alerts.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var r rules
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&r); err != nil {
		t.Fatalf("alerts.yaml: %v", err)
	}
	tests, err := os.ReadFile("prometheus/alerts_test.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var alerts []string
	for _, g := range r.Groups {
		for _, rule := range g.Rules {
			alerts = append(alerts, rule.Alert)
			checkNames(t, "alert "+rule.Alert, rule.Expr, known)
			if !slices.Contains([]string{"page", "warn"}, rule.Labels["severity"]) || rule.Annotations["summary"] == "" || rule.Annotations["description"] == "" {
				t.Errorf("alert %s: severity %q (page or warn), a summary and a description are needed", rule.Alert, rule.Labels["severity"])
			}
			if !bytes.Contains(tests, []byte("alertname: "+rule.Alert+"\n")) {
				t.Errorf("alert %s has no test in alerts_test.yaml", rule.Alert)
			}
		}
	}
	for _, want := range []string{"KswitchNoLeader", "KswitchSwitchTooLong", "KswitchCircuitBreakerOpen", "KswitchStalledPartitions",
		"KswitchLagGrowing", "KswitchCommitsFailing", "KswitchDeadLetters"} {
		if !slices.Contains(alerts, want) {
			t.Errorf("no alert %s", want)
		}
	}
	promtool := os.Getenv("KSWITCH_PROMTOOL")
	if promtool == "" {
		t.Skip("KSWITCH_PROMTOOL is not set: make test runs promtool test rules (make tools installs it)")
	}
	out, err := exec.Command(promtool, "test", "rules", "prometheus/alerts_test.yaml").CombinedOutput()
	t.Logf("promtool test rules:\n%s", out)
	if err != nil {
		t.Fatalf("promtool test rules: %v", err)
	}
	if out, err := exec.Command(promtool, "check", "rules", "prometheus/alerts.yaml").CombinedOutput(); err != nil {
		t.Fatalf("promtool check rules: %v\n%s", err, out)
	}
}

type dashboard struct {
	Title         string `json:"title"`
	UID           string `json:"uid"`
	SchemaVersion int    `json:"schemaVersion"`
	Panels        []struct {
		ID      int    `json:"id"`
		Title   string `json:"title"`
		Type    string `json:"type"`
		GridPos struct {
			X, Y, W, H int
		} `json:"gridPos"`
		Targets []struct {
			RefID string `json:"refId"`
			Expr  string `json:"expr"`
		} `json:"targets"`
	} `json:"panels"`
}

// TestGrafanaDashboard: the dashboard is JSON Grafana imports (a uid,
// panels with unique ids inside the 24-column grid), and every query
// names only metrics the code exports; the panels cover what operators
// watch.
func TestGrafanaDashboard(t *testing.T) {
	known := metricNames(t)
	b, err := os.ReadFile("grafana/kswitch-fleet.json")
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("kswitch-fleet.json: %v", err)
	}
	if d.UID == "" || d.Title == "" || d.SchemaVersion < 30 || len(d.Panels) == 0 {
		t.Fatalf("dashboard %q uid %q schema %d with %d panels", d.Title, d.UID, d.SchemaVersion, len(d.Panels))
	}
	ids := map[int]bool{}
	var all strings.Builder
	for _, p := range d.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d twice", p.ID)
		}
		ids[p.ID] = true
		if p.GridPos.W <= 0 || p.GridPos.X+p.GridPos.W > 24 || p.GridPos.H <= 0 {
			t.Errorf("panel %q: grid position %+v outside the 24 columns", p.Title, p.GridPos)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, q := range p.Targets {
			checkNames(t, "panel "+p.Title, q.Expr, known)
			all.WriteString(q.Expr + "\n")
		}
	}
	for _, m := range []string{"kswitch_active_cluster", "kswitch_switch_duration_seconds", "kswitch_switch_phase_seconds", "kswitch_consumer_lag_records",
		"kswitch_offset_commit_errors_total", "kswitch_signal_apply_seconds", "kswitch_routing_in_flight", "kswitch_routing_dead_lettered_total",
		"kswitch_offset_commit_bytes_total", "kswitch_offset_commit_budget_bytes_per_second"} {
		if !strings.Contains(all.String(), m) {
			t.Errorf("no panel shows %s", m)
		}
	}
}

// TestSystemdUnit: the unit runs `kswitch agent --config` on a file it
// may read, stops it with SIGTERM and the time to hand over, carries the
// hardening options, and systemd-analyze verify accepts it (with the
// binary replaced by one that exists here).
func TestSystemdUnit(t *testing.T) {
	b, err := os.ReadFile("systemd/kswitch.service")
	if err != nil {
		t.Fatal(err)
	}
	unit := map[string][]string{}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, "="); ok && !strings.HasPrefix(line, "#") {
			unit[k] = append(unit[k], v)
		}
	}
	exec1 := strings.Fields(strings.Join(unit["ExecStart"], ""))
	if len(exec1) != 4 || exec1[1] != "agent" || exec1[2] != "--config" {
		t.Fatalf("ExecStart %v, want <kswitch> agent --config <file>", exec1)
	}
	if ro := strings.Join(unit["ReadOnlyPaths"], " "); !strings.HasPrefix(exec1[3], ro+"/") {
		t.Errorf("the configuration %s is not under ReadOnlyPaths %q", exec1[3], ro)
	}
	for k, want := range map[string]string{"KillSignal": "SIGTERM", "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
		"PrivateTmp": "yes", "PrivateDevices": "yes", "RestrictSUIDSGID": "yes", "MemoryDenyWriteExecute": "yes", "CapabilityBoundingSet": "",
		"User": "kswitch", "Restart": "on-failure"} {
		if got := unit[k]; len(got) != 1 || got[0] != want {
			t.Errorf("%s=%v, want %q", k, got, want)
		}
	}
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("no systemd-analyze here (Debian's systemd package): the unit was not verified")
	}
	dir := t.TempDir()
	verified := strings.Replace(string(b), "ExecStart="+exec1[0], "ExecStart=/bin/true", 1)
	if err := os.WriteFile(filepath.Join(dir, "kswitch.service"), []byte(verified), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(analyze, "verify", "--man=no", filepath.Join(dir, "kswitch.service")).CombinedOutput()
	if err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
}

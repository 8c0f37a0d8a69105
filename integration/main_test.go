//go:build integration

package integration

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestMain runs the suite, then writes the scenarios' report.
func TestMain(m *testing.M) {
	code := m.Run()
	if err := writeReport(os.Getenv("KSWITCH_TEST_REPORT_DIR")); err != nil {
		fmt.Fprintln(os.Stderr, "report:", err)
	}
	os.Exit(code)
}

var (
	reportsMu sync.Mutex
	reports   []scenarioReport
)

func addReport(r scenarioReport) {
	reportsMu.Lock()
	defer reportsMu.Unlock()
	reports = append(reports, r)
}

// writeReport writes the scenarios' rows to dir as report.json and
// report.md; nothing when dir is empty or no scenario ran.
func writeReport(dir string) error {
	reportsMu.Lock()
	defer reportsMu.Unlock()
	if dir == "" || len(reports) == 0 {
		return nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	js, err := json.MarshalIndent(reports, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "report.json"), append(js, '\n'), 0o644); err != nil {
		return err
	}
	var md strings.Builder
	md.WriteString("# kswitch integration report\n\n")
	fmt.Fprintf(&md, "%s. %s (KRaft, one node each) A and B, MirrorMaker 2 A → B (both ways in the outage), etcd ×3, kswitch agents ×3, kcat; "+
		"lost and duplicated counted from the channel topic read back with kcat (integration/README.md).\n\n",
		time.Now().UTC().Format(time.RFC3339), filepath.Base(os.Getenv("KSWITCH_TEST_KAFKA_DIR")))
	md.WriteString("| scenario | covers | passed | records | lost | duplicates (unreplicated at the fault / after a hand-over) | detected s | switched s | first record on B s | failback s | methods |\n")
	md.WriteString("|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range reports {
		fmt.Fprintf(&md, "| %s | %s | %v | %d | %d | %d (%d / %d) | %s | %s | %s | %s | %s |\n", r.Scenario, r.Covers, r.Passed, r.Records, r.LostCount,
			r.Duplicates, r.DuplicatesUnreplicated, r.DuplicatesHandOver, timing(r, "failover_detected"), timing(r, "failover_switched"),
			timing(r, "failover_first_record"), timing(r, "failback_switched"), methodSummary(r.Methods))
	}
	for _, r := range reports {
		if len(r.Details) > 0 {
			fmt.Fprintf(&md, "\n%s:\n\n", r.Scenario)
			for _, d := range r.Details {
				fmt.Fprintf(&md, "- %s\n", d)
			}
		}
	}
	md.WriteString("\nEvery timing (seconds):\n\n")
	for _, r := range reports {
		fmt.Fprintf(&md, "- %s:", r.Scenario)
		for _, k := range sortedKeys(r.Timings) {
			fmt.Fprintf(&md, " %s %v;", k, r.Timings[k])
		}
		md.WriteString("\n")
	}
	return os.WriteFile(filepath.Join(dir, "report.md"), []byte(md.String()), 0o644)
}

func timing(r scenarioReport, step string) string {
	if v, ok := r.Timings[step]; ok {
		return fmt.Sprint(v)
	}
	return "–"
}

// methodSummary says, per switch, how many partitions each translation
// method moved: "failover: 4 fingerprint".
func methodSummary(m map[string][]string) string {
	var parts []string
	for _, sw := range sortedKeys(m) {
		count := map[string]int{}
		for _, pm := range m[sw] {
			_, method, _ := strings.Cut(pm, ":")
			count[method]++
		}
		var ms []string
		for _, method := range sortedKeys(count) {
			ms = append(ms, fmt.Sprintf("%d %s", count[method], method))
		}
		parts = append(parts, sw+": "+strings.Join(ms, ", "))
	}
	return strings.Join(parts, "; ")
}

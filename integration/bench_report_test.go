//go:build integration && bench

package integration

import (
	"bufio"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"
)

// benchResults is docs/benchmarks.json: the machine, the scale of the run
// and every trial's raw numbers; BENCHMARKS.md is derived from it.
type benchResults struct {
	Started         time.Time `json:"started"`
	DurationSeconds float64   `json:"duration_seconds"`
	// MakeSeconds is the whole make bench up to the writing of the
	// results: the build, the in-process benchmarks and the real stack.
	MakeSeconds float64           `json:"make_seconds,omitempty"`
	Machine     machine           `json:"machine"`
	Scale       benchScale        `json:"scale"`
	Settings    map[string]string `json:"settings"`
	Phases      []phaseTime       `json:"phases"`
	Ceiling     []ceilingTrial    `json:"ceiling"`
	Throughput  []relayTrial      `json:"throughput"`
	Cost        []costTrial       `json:"cost"`
	// Memory is the one-agent trial over MemoryRecords records.
	Memory []relayTrial `json:"memory,omitempty"`
	// MemoryLimit is the memory-limit figure's trials: one agent at the
	// default agent.memory_limit_mib and with noMemoryLimit, on records of
	// 150 B and of 1 KiB.
	MemoryLimit []relayTrial `json:"memory_limit,omitempty"`
	// TxnCycle is one transactional stream alone against the same
	// producer's idempotent path (bench_txn_test.go).
	TxnCycle []txnCycleTrial `json:"txn_cycle,omitempty"`
	// Published is what the last published page (docs/benchmarks.json at
	// git HEAD when the run started) measured of the fault figures, which
	// the relay's goal (row G8) asks to be no worse.
	Published *publishedRun    `json:"published,omitempty"`
	Failover  []failoverTrial  `json:"failover"`
	Rebalance []rebalanceTrial `json:"rebalance"`
	Pause     pauseResult      `json:"pause"`
	// Profile is where the memory trial's agent spent its CPU; the
	// profile itself is copied next to the page (profileFile).
	Profile     *agentProfile `json:"profile,omitempty"`
	profileFile string
	// GoBenchmarks are the result lines of the in-process benchmarks
	// (go test -bench . ./...) of the same make bench.
	GoBenchmarks []string `json:"go_benchmarks"`
}

type phaseTime struct {
	Name    string  `json:"name"`
	Seconds float64 `json:"seconds"`
}

type machine struct {
	CPU        string `json:"cpu"`
	Cores      int    `json:"cores"`
	MemoryMiB  int    `json:"memory_mib"`
	Kernel     string `json:"kernel"`
	Go         string `json:"go"`
	Java       string `json:"java"`
	Kafka      string `json:"kafka"`
	Etcd       string `json:"etcd"`
	Kcat       string `json:"kcat"`
	Sarama     string `json:"sarama"`
	Commit     string `json:"commit"`
	LoadBefore string `json:"load_before"`
	LoadAfter  string `json:"load_after"`
}

func describeMachine(t *testing.T) machine {
	t.Helper()
	m := machine{Cores: runtime.NumCPU(), Go: runtime.Version(),
		Kafka: strings.TrimPrefix(filepath.Base(os.Getenv("KSWITCH_TEST_KAFKA_DIR")), "kafka-"),
		Etcd:  strings.TrimPrefix(filepath.Base(os.Getenv("KSWITCH_TEST_ETCD_DIR")), "etcd-")}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPU = strings.TrimSpace(v)
				break
			}
		}
		f.Close()
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		var kb int
		fmt.Sscanf(strings.TrimSpace(strings.TrimPrefix(strings.SplitN(string(b), "\n", 2)[0], "MemTotal:")), "%d", &kb)
		m.MemoryMiB = kb / 1024
	}
	run := func(name string, args ...string) string {
		out, err := exec.Command(name, args...).CombinedOutput()
		if err != nil {
			return "unknown (" + err.Error() + ")"
		}
		return strings.TrimSpace(strings.SplitN(string(out), "\n", 2)[0])
	}
	m.Kernel = run("uname", "-sr")
	m.Java = run("java", "-version")
	m.Commit = run("git", "describe", "--always", "--dirty")
	m.Sarama = run("go", "list", "-m", "-f", "{{.Version}}", "github.com/IBM/sarama")
	// kcat -V: a banner, then "Version 1.7.1 (…) (librdkafka 2.x builtin.features=…)".
	if out, err := exec.Command("kcat", "-V").CombinedOutput(); err == nil {
		for _, l := range strings.Split(string(out), "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(l), "Version "); ok {
				m.Kcat, _, _ = strings.Cut(v, " builtin.features")
			}
		}
	}
	return m
}

func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return err.Error()
	}
	f := strings.Fields(string(b))
	return strings.Join(f[:min(3, len(f))], " ")
}

// goBenchLines returns the result lines of `go test -bench` output.
func goBenchLines(path string) []string {
	if path == "" {
		return nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return []string{"not read: " + err.Error()}
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "Benchmark") || strings.HasPrefix(l, "pause apply") || strings.HasPrefix(l, "exactly-once cost") ||
			strings.HasPrefix(l, "scale") || strings.HasPrefix(l, "etcd flat") || strings.HasPrefix(l, "etcd ceiling") || strings.HasPrefix(l, "chain switches") || strings.HasPrefix(l, "FAIL") {
			out = append(out, strings.Join(strings.Fields(l), " "))
		}
	}
	return out
}

func round1(x float64) float64 { return math.Round(x*10) / 10 }
func round3(x float64) float64 { return math.Round(x*1000) / 1000 }

// stats is a figure over trials.
type stats struct {
	N                     int
	Median, Min, Max, P99 float64
}

func statsOf(xs []float64) stats {
	if len(xs) == 0 {
		return stats{}
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	med := s[len(s)/2]
	if len(s)%2 == 0 {
		med = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	p99 := s[int(math.Ceil(0.99*float64(len(s))))-1] // nearest rank
	return stats{N: len(s), Median: med, Min: s[0], Max: s[len(s)-1], P99: p99}
}

// spreadIn is spread with a unit after the median: "0.48 s (0.39–0.61)".
func (s stats) spreadIn(dec int, unit string) string {
	if s.N == 0 {
		return "–"
	}
	if s.N == 1 {
		return fmt.Sprintf("%.*f %s (1 trial)", dec, s.Median, unit)
	}
	return fmt.Sprintf("%.*f %s (%.*f–%.*f)", dec, s.Median, unit, dec, s.Min, dec, s.Max)
}

// spread formats "median (min–max)" with the given decimals.
func (s stats) spread(dec int) string {
	if s.N == 0 {
		return "–"
	}
	if s.N == 1 {
		return fmt.Sprintf("%.*f (1 trial)", dec, s.Median)
	}
	return fmt.Sprintf("%.*f (%.*f–%.*f)", dec, s.Median, dec, s.Min, dec, s.Max)
}

func pick[T any](xs []T, keep func(T) bool, val func(T) float64) []float64 {
	var out []float64
	for _, x := range xs {
		if keep(x) {
			out = append(out, val(x))
		}
	}
	return out
}

// write writes benchmarks.json and BENCHMARKS.md to dir.
func (r *benchResults) write(dir string) error {
	r.Settings = map[string]string{
		"agents": fmt.Sprintf("the integration suite's configuration: etcd session_ttl "+sessionTTL.String()+", request_timeout 1s; source commit_interval 500ms; failover probe_interval 500ms, "+
			"probe_timeout 1s, failure_window 3s, failback auto; in the fault figures failback_stable %v (the suite's is 10 s) and max_failed_switches 1000 "+
			"(the default 3 would stop automatic switching at the third failover in 5 minutes)", benchFailbackStable),
		"channel producer":  "internal/kafka's Producer with the defaults: acks all, idempotent, up to 5 requests in flight per broker, no compression (the baseline relayloop: sarama's AsyncProducer with routing.ProducerConfig, acks all, idempotent, one request in flight)",
		"relay records":     fmt.Sprintf("%d records of 1024 bytes (ProducerPerformance), %d partitions, 1 rule, 1 channel on B, partitioner manual-same-partition", r.Scale.RelayRecords, relayPartitions),
		"kafka":             "A and B: one KRaft node each (broker and controller), 384 MiB heap, loopback",
		"mirrormaker2":      "dedicated MirrorMaker 2, 384 MiB heap, its defaults (tasks.max 1); no checkpoints or heartbeats in the throughput runs",
		"failover workload": fmt.Sprintf("3 agents on orders (%d partitions), kcat producing %d records/s to A, MirrorMaker 2 A → B with the default replication policy, every record routed to the channel topic delivered on B", ordersPartitions, produceRate),
	}
	if len(r.MemoryLimit) > 0 {
		r.Settings["memory-limit records"] = fmt.Sprintf("%d records of 150 bytes (topic relay-150) and of 1024 bytes (relay), ProducerPerformance, %d partitions; "+
			"one agent at the default agent.memory_limit_mib (96) and with %s", r.Scale.RelayRecords, relayPartitions, noMemoryLimit)
	}
	if slices.ContainsFunc(r.Throughput, func(x relayTrial) bool { return x.Relay == kswitchExactlyOnce }) {
		r.Settings["exactly_once"] = "B's delivery exactly_once, transaction_interval at its default (50 ms), a fleet of its own per trial (positions in __kswitch.positions are keyed by fleet and source topic)"
	}
	js, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "benchmarks.json"), append(js, '\n'), 0o644); err != nil {
		return err
	}
	if err := writeCharts(dir, r); err != nil {
		return err
	}
	if r.profileFile != "" {
		if err := copyProfile(r.profileFile, dir); err != nil {
			return err
		}
	}
	return os.WriteFile(filepath.Join(dir, "BENCHMARKS.md"), []byte(r.markdown()), 0o644)
}

// relayRate returns the per-trial rates of a relay.
func (r *benchResults) relayRate(relay string, instances int) []float64 {
	return pick(r.Throughput, func(x relayTrial) bool { return x.Relay == relay && x.Instances == instances },
		func(x relayTrial) float64 { return x.RecordsPerSecond })
}

// relayWhole returns the per-trial rates of a relay over the whole copy,
// from its first record at the destination to its last.
func (r *benchResults) relayWhole(relay string, instances int) []float64 {
	return pick(r.Throughput, func(x relayTrial) bool { return x.Relay == relay && x.Instances == instances },
		func(x relayTrial) float64 { return float64(x.Records) / (x.TotalSeconds - x.StartupSeconds) })
}

// medianRatio returns the ratio of the medians of a and b, and the stats
// of the per-trial ratios a[i]/b[i] (trials run side by side, in turn).
func medianRatio(a, b []float64) (float64, stats) {
	var per []float64
	for i := range min(len(a), len(b)) {
		per = append(per, a[i]/b[i])
	}
	return statsOf(a).Median / statsOf(b).Median, statsOf(per)
}

// ratio writes medianRatio's for the page's tables.
func ratio(a, b []float64) string {
	if len(a) == 0 || len(b) == 0 {
		return "–"
	}
	m, ps := medianRatio(a, b)
	if ps.N < 2 {
		return fmt.Sprintf("**%.2f**", m)
	}
	return fmt.Sprintf("**%.2f** (per trial %.2f–%.2f)", m, ps.Min, ps.Max)
}

// headlineText is the page's headline, the figures README.md quotes:
// the relay goal's rows against the franz-go loop, the kcat pipe, at_least_once
// and the memory bound, then failover; each clause only when the run
// measured it.
func (r *benchResults) headlineText() string {
	var cl []string
	med := func(xs []float64) float64 { return statsOf(xs).Median }
	ks1 := r.relayRate("kswitch", 1)
	if fr := r.relayRate("franzloop", 1); len(ks1) > 0 && len(fr) > 0 {
		rate, _ := ratioOf(ks1, fr)
		cpu, _ := ratioOf(r.relayCPU("kswitch", 1), r.relayCPU("franzloop", 1))
		cl = append(cl, fmt.Sprintf("one agent relays **%.2f×** the records/s of a franz-go loop tuned for throughput (target ≥ 1.2: %s),\n  at **%.2f×** its CPU per record (≤ 0.9: %s)",
			rate, met(rate >= 1.2), cpu, met(cpu <= 0.9)))
	}
	if kc := r.relayRate("kcat", 1); len(ks1) > 0 && len(kc) > 0 {
		m, _ := ratioOf(ks1, kc)
		cl = append(cl, fmt.Sprintf("one agent relays **%.2f×** the records/s of the kcat pipe (≥ 1.2: %s)", m, met(m >= 1.2)))
	}
	if eo := r.relayRate(kswitchExactlyOnce, 1); len(ks1) > 0 && len(eo) > 0 {
		m, _ := ratioOf(eo, ks1)
		cl = append(cl, fmt.Sprintf("exactly_once relays at **%.2f×** at_least_once's rate (≥ 0.9: %s)", m, met(m >= 0.9)))
	}
	if len(r.Memory) > 0 {
		rss := med(pick(r.Memory, func(relayTrial) bool { return true }, func(x relayTrial) float64 { return x.PeakRSSMiB }))
		cl = append(cl, fmt.Sprintf("relaying %d records of 1 KiB, one agent peaks at **%.0f MiB** resident (≤ 128: %s)", r.Memory[0].Records, rss, met(rss <= 128)))
	}
	var b strings.Builder
	if sl := r.relayRate("relayloop", 1); len(ks1) > 0 && len(sl) > 0 {
		m, _ := ratioOf(ks1, sl)
		c := fmt.Sprintf("against the bare sarama consume→produce loop (the baseline before the relay work, no target now): **%.2f×** with one agent", m)
		if k3, s3 := r.relayRate("kswitch", 3), r.relayRate("relayloop", 3); len(k3) > 0 && len(s3) > 0 {
			m3, _ := ratioOf(k3, s3)
			c += fmt.Sprintf(", **%.2f×** with three", m3)
		}
		cl = append(cl, c)
	}
	if len(cl) > 0 {
		b.WriteString("**Headline** (the relay's goal, docs/RELAY.md, \"The bench rows\"; each figure against its baseline in this run):\n\n")
		for _, c := range cl {
			fmt.Fprintf(&b, "- %s\n", c)
		}
		b.WriteString("\n")
	}
	stop := pick(r.Failover, stopped, func(x failoverTrial) float64 { return x.FirstRecordSeconds })
	if len(stop) > 0 {
		lost, dup := faultTotals(r.Failover)
		fmt.Fprintf(&b, "After a SIGKILL of the primary's broker the first record is consumed from the replica after **%.2f s** (p50 of %d trials, default\n", med(stop), len(stop))
		b.WriteString("failover settings: a refused connection is a hard failure, 500 ms window)")
		if h := pick(r.Failover, hung, func(x failoverTrial) float64 { return x.FirstRecordSeconds }); len(h) > 0 {
			fmt.Fprintf(&b, "; after a hang (the full 3 s window) **%.2f s** (p50 of %d, ≤ 4.2 s: %s)", med(h), len(h), met(med(h) <= 4.2))
		}
		fmt.Fprintf(&b, "; %d records lost and %d duplicated over all trials.\n", lost, dup)
	}
	if b.Len() > 0 {
		b.WriteString("\n")
	}
	return b.String()
}

// memoryLimitSection is the page's part on the memory-limit figure: one
// agent at the default agent.memory_limit_mib against the same agent with
// noMemoryLimit, on records of 150 B and of 1 KiB; empty when the run did
// not measure it.
func (r *benchResults) memoryLimitSection() string {
	if len(r.MemoryLimit) == 0 {
		return ""
	}
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	p("\n### The cost of the default memory limit\n\n")
	p("One agent relays %d records (12 partitions, ProducerPerformance's) to a new topic on B, with the default\n", r.MemoryLimit[0].Records)
	p("`agent.memory_limit_mib` and then with `%s` in its environment (GOMEMLIMIT wins over the configuration: no\n", noMemoryLimit)
	p("limit in effect), in turn, for each record size. CPU of the agent process from the first record at the destination to the\n")
	p("last (`/proc/<pid>/stat` read at both looks), divided by the records copied in between: start-up left out.\n")
	p("Target (the relay's goal): CPU per record at the default ≤ 1.1× without a limit, on both sizes.\n\n")
	p("| records | memory limit | records/s, 20 → 80 %% | CPU µs per record | default ÷ no limit | peak RSS MiB |\n|---|---|---|---|---|---|\n")
	for _, size := range []int{150, 1024} {
		for _, env := range []string{"", noMemoryLimit} {
			keep := func(x relayTrial) bool { return x.recordBytes() == size && x.Env == env }
			if len(pick(r.MemoryLimit, keep, func(relayTrial) float64 { return 0 })) == 0 {
				continue
			}
			what, cmp := "none (`"+env+"`)", "–"
			if env == "" {
				what = "default (`agent.memory_limit_mib`)"
				if none := r.memoryLimitCPU(size, noMemoryLimit); len(none) > 0 {
					_, cmp = ratioOf(r.memoryLimitCPU(size, ""), none)
				}
			}
			us := pick(r.MemoryLimit, keep, func(x relayTrial) float64 { return 1e6 * x.copyCPUPerRecord() })
			p("| %d B | %s | %s | %s | %s | %s |\n", size, what,
				statsOf(pick(r.MemoryLimit, keep, func(x relayTrial) float64 { return x.RecordsPerSecond })).spread(0),
				statsOf(us).spread(2), cmp,
				statsOf(pick(r.MemoryLimit, keep, func(x relayTrial) float64 { return x.PeakRSSMiB })).spread(0))
		}
	}
	return b.String()
}

func stopped(x failoverTrial) bool { return !x.hung() }

func hung(x failoverTrial) bool { return x.hung() }

// switchSteps is the switch's own time in a failover trial: A declared
// down → the first record from B.
func switchSteps(x failoverTrial) float64 { return x.FirstRecordSeconds - x.DetectedSeconds }

// failbackSeconds is A ready → the first record from A in the channel
// topic less failback_stable, not counting a wait for the producer: a
// record written to A after A became active cannot be consumed earlier.
func failbackSeconds(x failoverTrial) float64 {
	restart := x.FailbackFirstRecordSeconds - max(x.FailbackActiveSeconds, x.FailbackProducedSeconds)
	return x.FailbackActiveSeconds + max(restart, 0) - benchFailbackStable.Seconds()
}

// target is a row of the relay's goal (docs/RELAY.md, "The bench rows"),
// or one of the failover targets kept from before the relay work, with
// what this run measured.
type target struct {
	// Source names the row: "G1" to "G8" for the relay's goal, in its
	// order; "F" for the failover targets kept from before the relay
	// work, which the goal keeps ("no worse").
	Source                 string
	What, Target, Measured string
	Met                    bool
	// Missing: the run did not measure the figure (a phase left out, or
	// results written before it existed); Measured says why.
	Missing bool
}

// status is met, not met or not measured.
func (x target) status() string {
	if x.Missing {
		return "not measured"
	}
	return met(x.Met)
}

// ratioOf returns medianRatio's ratio, and it written for a goal row.
func ratioOf(a, b []float64) (float64, string) {
	m, ps := medianRatio(a, b)
	if ps.N < 2 {
		return m, fmt.Sprintf("%.2f× (1 trial)", m)
	}
	return m, fmt.Sprintf("%.2f× (per trial %.2f–%.2f)", m, ps.Min, ps.Max)
}

// relayCPU returns the CPU seconds per trial of a relay; the trials copy
// the same records.
func (r *benchResults) relayCPU(relay string, instances int) []float64 {
	return pick(r.Throughput, func(x relayTrial) bool { return x.Relay == relay && x.Instances == instances },
		func(x relayTrial) float64 { return x.CPUSeconds })
}

// memoryLimitCPU returns the CPU seconds per record of the memory-limit
// trials on records of size bytes with environment env, start-up left
// out (the same in both settings, it would pull the ratio towards 1).
func (r *benchResults) memoryLimitCPU(size int, env string) []float64 {
	return pick(r.MemoryLimit, func(x relayTrial) bool { return x.recordBytes() == size && x.Env == env }, relayTrial.copyCPUPerRecord)
}

// recordBytes is the size of the trial's records.
func (x relayTrial) recordBytes() int {
	if x.RecordBytes == 0 {
		return 1024
	}
	return x.RecordBytes
}

// seconds writes a figure in seconds: the median and the range of trials.
func seconds(xs []float64) string { return statsOf(xs).spreadIn(2, "s") }

// targets returns the relay's goal and the failover targets it keeps, each
// measured in this run against its baseline of this run; a figure the run
// did not measure is left out.
func (r *benchResults) targets() []target {
	var out []target
	add := func(src, what, tgt, measured string, ok bool) {
		out = append(out, target{Source: src, What: what, Target: tgt, Measured: measured, Met: ok})
	}
	missing := func(src, what, tgt, why string) {
		out = append(out, target{Source: src, What: what, Target: tgt, Measured: why, Missing: true})
	}
	const noPhase = "not measured in this run"
	med := func(xs []float64) float64 { return statsOf(xs).Median }
	ks1 := r.relayRate("kswitch", 1)
	if fr := r.relayRate("franzloop", 1); len(ks1) > 0 && len(fr) > 0 {
		m, s := ratioOf(ks1, fr)
		add("G1", "relay records/s, 1 agent ÷ the tuned franz-go loop", "≥ 1.2×", s, m >= 1.2)
		m, s = ratioOf(r.relayCPU("kswitch", 1), r.relayCPU("franzloop", 1))
		add("G2", "CPU per record ÷ the tuned franz-go loop", "≤ 0.9×", s, m <= 0.9)
	} else {
		missing("G1", "relay records/s, 1 agent ÷ the tuned franz-go loop", "≥ 1.2×", noPhase)
		missing("G2", "CPU per record ÷ the tuned franz-go loop", "≤ 0.9×", noPhase)
	}
	if kc := r.relayRate("kcat", 1); len(ks1) > 0 && len(kc) > 0 {
		m, s := ratioOf(ks1, kc)
		add("G3", "relay records/s, 1 agent ÷ the kcat pipe", "≥ 1.2×", s, m >= 1.2)
	} else {
		missing("G3", "relay records/s, 1 agent ÷ the kcat pipe", "≥ 1.2×", noPhase)
	}
	if eo := r.relayRate(kswitchExactlyOnce, 1); len(ks1) > 0 && len(eo) > 0 {
		m, s := ratioOf(eo, ks1)
		add("G4", "exactly_once records/s ÷ at_least_once, 1 agent", "≥ 0.9×", s, m >= 0.9)
	} else {
		missing("G4", "exactly_once records/s ÷ at_least_once, 1 agent", "≥ 0.9×", noPhase)
	}
	if len(r.Memory) > 0 {
		rss := pick(r.Memory, func(relayTrial) bool { return true }, func(x relayTrial) float64 { return x.PeakRSSMiB })
		add("G5", fmt.Sprintf("peak RSS, 1 agent, %d × 1 KiB", r.Memory[0].Records), "≤ 128 MiB", statsOf(rss).spreadIn(0, "MiB"), med(rss) <= 128)
	} else {
		missing("G5", "peak RSS, 1 agent, 1 M × 1 KiB", "≤ 128 MiB", noPhase)
	}
	stop := pick(r.Failover, stopped, func(x failoverTrial) float64 { return x.FirstRecordSeconds })
	if h := pick(r.Failover, hung, func(x failoverTrial) float64 { return x.FirstRecordSeconds }); len(h) > 0 && len(stop) > 0 {
		add("G6", "failover, A hung → first record from B at the sink, default settings, p50", "≤ 4.2 s", seconds(h), med(h) <= 4.2)
		h, s := pick(r.Failover, hung, switchSteps), med(pick(r.Failover, stopped, switchSteps))
		add("G6", "failover, A hung: the switch's own steps (declared down → first record from B), p50", fmt.Sprintf("≤ stopped + 0.3 s = %.2f s", s+0.3),
			seconds(h), med(h) <= s+0.3)
	} else {
		missing("G6", "failover, A hung → first record from B at the sink, default settings, p50; the switch's own steps", "≤ 4.2 s; ≤ stopped + 0.3 s", noPhase)
	}
	for _, size := range []int{150, 1024} {
		what := fmt.Sprintf("CPU per record, %d B records: default agent.memory_limit_mib ÷ %s", size, noMemoryLimit)
		lim, none := r.memoryLimitCPU(size, ""), r.memoryLimitCPU(size, noMemoryLimit)
		if len(lim) == 0 || len(none) == 0 {
			missing("G7", what, "≤ 1.1×", noPhase)
			continue
		}
		m, s := ratioOf(lim, none)
		add("G7", what, "≤ 1.1×", s, m <= 1.1)
	}
	r.noWorse(add, missing)
	if len(stop) > 0 {
		add("F", "failover, A stopped → first record from B, p50", "≤ 1.0 s", seconds(stop), med(stop) <= 1.0)
	}
	if fb := pick(r.Failover, func(failoverTrial) bool { return true }, failbackSeconds); len(fb) > 0 {
		add("F", "failback, A ready → first record from A, less failback_stable, p50", "≤ 0.5 s", seconds(fb), med(fb) <= 0.5)
	}
	return out
}

// noWorse adds row G8: the failover and failback figures of this run
// against the published page's. No worse means a p50 at most the
// published run's slowest trial (the trials of one run spread widely on
// these shared cores), and no more records lost or duplicated.
func (r *benchResults) noWorse(add func(src, what, tgt, measured string, ok bool), missing func(src, what, tgt, why string)) {
	const what, tgt = "failover and failback figures ÷ the published page", "no worse"
	pub := r.Published
	switch {
	case len(r.Failover) == 0:
		missing("G8", what, tgt, "not measured in this run")
		return
	case pub == nil:
		missing("G8", what, tgt, "no published page to compare with")
		return
	}
	all := func(failoverTrial) bool { return true }
	for _, f := range []struct {
		what string
		keep func(failoverTrial) bool
		val  func(failoverTrial) float64
	}{
		{"failover, A stopped → first record from B, p50", stopped, func(x failoverTrial) float64 { return x.FirstRecordSeconds }},
		{"failover, A hung: the switch's own steps, p50", hung, switchSteps},
		{"failback, A ready → first record from A, less failback_stable, p50", all, failbackSeconds},
	} {
		now, then := pick(r.Failover, f.keep, f.val), pick(pub.Failover, f.keep, f.val)
		if len(now) == 0 || len(then) == 0 {
			missing("G8", f.what+", against the published page", tgt, "not measured in this run or on the page")
			continue
		}
		worst := statsOf(then).Max
		add("G8", f.what+", against the published page", fmt.Sprintf("no worse: ≤ its slowest trial, %.2f s", worst),
			fmt.Sprintf("%s; published %s", seconds(now), seconds(then)), statsOf(now).Median <= worst)
	}
	lost, dup := faultTotals(r.Failover)
	plost, pdup := faultTotals(pub.Failover)
	add("G8", "records lost / duplicated over the failover trials, against the published page", fmt.Sprintf("no worse: ≤ %d / %d", plost, pdup),
		fmt.Sprintf("%d / %d", lost, dup), lost <= plost && dup <= pdup)
}

// faultTotals returns the records lost and duplicated over trials.
func faultTotals(xs []failoverTrial) (lost, dup int) {
	for _, x := range xs {
		lost += x.Lost
		dup += x.Duplicated
	}
	return lost, dup
}

// publishedRun is the part of a published benchmarks.json that a run
// compares with.
type publishedRun struct {
	// Started is when that run started; Page is the commit that last
	// changed docs/benchmarks.json.
	Started  time.Time       `json:"started"`
	Page     string          `json:"page"`
	Failover []failoverTrial `json:"failover"`
}

// readPublished reads docs/benchmarks.json at git HEAD: the page as
// published, not as a run in progress may have rewritten it.
func readPublished() (*publishedRun, error) {
	b, err := exec.Command("git", "show", "HEAD:docs/benchmarks.json").Output()
	if err != nil {
		return nil, fmt.Errorf("git show HEAD:docs/benchmarks.json: %w", err)
	}
	var old benchResults
	if err := json.Unmarshal(b, &old); err != nil {
		return nil, fmt.Errorf("docs/benchmarks.json at HEAD: %w", err)
	}
	if len(old.Failover) == 0 {
		return nil, fmt.Errorf("docs/benchmarks.json at HEAD has no failover trials")
	}
	page, err := exec.Command("git", "log", "-1", "--format=%h", "--", ":/docs/benchmarks.json").Output()
	if err != nil {
		return nil, fmt.Errorf("git log docs/benchmarks.json: %w", err)
	}
	return &publishedRun{Started: old.Started, Page: strings.TrimSpace(string(page)), Failover: old.Failover}, nil
}

func (r *benchResults) markdown() string {
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	m := r.Machine
	p("# kswitch benchmarks\n\n")
	total := ""
	if r.MakeSeconds > 0 {
		total = fmt.Sprintf(" (make bench in all, build and in-process benchmarks included: %s)", time.Duration(r.MakeSeconds)*time.Second)
	}
	p("Written by `make bench` (`integration/bench*_test.go`) on %s; the real-stack part took %s%s. Every number below is in\n",
		r.Started.Format("2006-01-02 15:04 MST"), time.Duration(r.DurationSeconds)*time.Second, total)
	p("[benchmarks.json](benchmarks.json) with every trial. Each figure is the median over its trials with the\n")
	p("range (min–max) in parentheses; each comparison is a ratio against a baseline measured in the same run,\n")
	p("on the same brokers, with the same records. Completion is read back from Kafka (end offsets of the\n")
	p("destination, the channel topic read with kcat), never from kswitch's counters.\n\n")
	if r.Scale.Quick {
		p("> **Quick run** (`KSWITCH_BENCH_QUICK=1`): fewer trials and records than a full run; not for publishing.\n\n")
	}
	p("%s", r.headlineText())
	if ts := r.targets(); len(ts) > 0 {
		p("The relay's goal (rows G1-G8, docs/RELAY.md, \"The bench rows\") and the failover targets kept from before the relay\n")
		p("work (rows F), each measured in this run against its baseline of this run (a ratio: the ratio of the medians, with\n")
		p("the range of the per-trial ratios):\n\n")
		p("| row | figure | target | measured | |\n|---|---|---|---|---|\n")
		for _, x := range ts {
			p("| %s | %s | %s | %s | %s |\n", x.Source, x.What, x.Target, x.Measured, x.status())
		}
		p("\n")
		if pub := r.Published; pub != nil && len(r.Failover) > 0 {
			p("Rows G8 compare with the page published before this run (docs/benchmarks.json at commit %s, run of %s).\n\n",
				pub.Page, pub.Started.Format("2006-01-02 15:04 MST"))
		}
	}

	p("## Machine\n\n| | |\n|---|---|\n")
	p("| CPU | %s, %d cores (shared by the brokers, MirrorMaker 2, etcd, the agents and the baselines) |\n", m.CPU, m.Cores)
	p("| memory | %d MiB |\n| kernel | %s |\n| Go | %s; sarama %s |\n| Java | %s |\n", m.MemoryMiB, m.Kernel, m.Go, m.Sarama, m.Java)
	kcatV := m.Kcat
	if strings.Count(kcatV, "(") > strings.Count(kcatV, ")") {
		kcatV += ")" // cut before its feature list
	}
	p("| Kafka | %s, KRaft, one node per cluster (A and B), 384 MiB heap, loopback |\n| etcd | %s, three members |\n| kcat | %s |\n", m.Kafka, m.Etcd, kcatV)
	p("| kswitch | %s |\n| load average (1, 5, 15 min) | before %s; after %s |\n", m.Commit, m.LoadBefore, m.LoadAfter)
	p("| run | %s:", r.Started.Format(time.RFC3339))
	for _, ph := range r.Phases {
		p(" %s %.0f s;", ph.Name, ph.Seconds)
	}
	p(" total %.0f s |\n\n", r.DurationSeconds)

	// 1. Throughput.
	p("## 1. Relay throughput\n\n")
	p("![Relay throughput against the baselines](throughput.svg)\n\n")
	p("%d records of 1 KiB in topic `relay` on A (%d partitions), copied to a new topic on B per trial; records/s over\n", r.Scale.RelayRecords, relayPartitions)
	p("the middle of the copy (20 %% → 80 %% of the records at the destination), which leaves out start-up, shown\n")
	p("separately. kswitch: `kswitch agent` processes, one rule, one channel (`manual-same-partition`).\n")
	p("Baseline: `integration/tools/relayloop`, a sarama consumer group → async producer loop with\n")
	p("`routing.ProducerConfig` (acks all, idempotent), committing acknowledged records every 500 ms like the agents.\n")
	p("Each ratio column is kswitch's rate divided by the row's (kswitch ×3 for the ×3 baseline, kswitch ×1 otherwise);\n")
	p("the ratio of the medians, with the range of the ratios of trials run one after the other. The first → last rate\n")
	p("includes the group's or fleet's rebalances while members join and the tail of the last partitions.\n\n")
	p("| relay | records/s, 20 → 80 %% | kswitch ÷ this | records/s, first → last record | kswitch ÷ this | start-up s | CPU s per trial | peak RSS MiB |\n|---|---|---|---|---|---|---|---|\n")
	rows := []struct {
		relay     string
		instances int
		label     string
	}{
		{"kswitch", 1, "kswitch, 1 agent"},
		{kswitchExactlyOnce, 1, "kswitch, 1 agent, B's `delivery: exactly_once`"},
		{"relayloop", 1, "baseline relayloop, 1 process"},
		{"kswitch", 3, "kswitch, 3 agents"},
		{"relayloop", 3, "baseline relayloop, 3 processes (one group)"},
		{"franzloop", 1, "franz-go loop tuned for throughput (`relayloop -client franz-go`), 1 process"},
		{"mirrormaker2", 1, "MirrorMaker 2 (same topic, own JVM)"},
		{"kcat", 1, "`kcat -C \\| kcat -P` (idempotent producer)"},
	}
	for _, row := range rows {
		keep := func(x relayTrial) bool { return x.Relay == row.relay && x.Instances == row.instances }
		rates, whole := r.relayRate(row.relay, row.instances), r.relayWhole(row.relay, row.instances)
		if len(rates) == 0 && row.relay == kswitchExactlyOnce {
			continue // results written before the row existed
		}
		cmp, cmpWhole := "–", "–"
		if row.relay != "kswitch" && len(rates) > 0 {
			cmp = ratio(r.relayRate("kswitch", row.instances), rates)
			cmpWhole = ratio(r.relayWhole("kswitch", row.instances), whole)
		}
		p("| %s | %s | %s | %s | %s | %s | %s | %s |\n", row.label, statsOf(rates).spread(0), cmp, statsOf(whole).spread(0), cmpWhole,
			statsOf(pick(r.Throughput, keep, func(x relayTrial) float64 { return x.StartupSeconds })).spread(1),
			statsOf(pick(r.Throughput, keep, func(x relayTrial) float64 { return x.CPUSeconds })).spread(1),
			statsOf(pick(r.Throughput, func(x relayTrial) bool { return keep(x) && x.PeakRSSMiB > 0 }, func(x relayTrial) float64 { return x.PeakRSSMiB })).spread(0))
	}
	for _, tool := range []string{"ProducerPerformance", "ConsumerPerformance"} {
		rates := pick(r.Ceiling, func(x ceilingTrial) bool { return x.Tool == tool }, func(x ceilingTrial) float64 { return x.RecordsPerSecond })
		what := "produce to A, acks all (records/s as it reports)"
		if tool == "ConsumerPerformance" {
			what = "consume `relay` from A (fetch.nMsg.sec)"
		}
		p("| ceiling: Kafka's `%s`, %s | %s | %s | | | | | |\n", tool, what, statsOf(rates).spread(0), ratio(r.relayRate("kswitch", 1), rates))
	}
	pp := statsOf(pick(r.Ceiling, func(x ceilingTrial) bool { return x.Tool == "ProducerPerformance" }, func(x ceilingTrial) float64 { return x.RecordsPerSecond }))
	if pp.N > 0 && pp.Median < statsOf(r.relayRate("kswitch", 1)).Median {
		p("\nProducerPerformance writes more slowly than the relays do: it is a fresh JVM (its rate, timed by itself from the\n")
		p("first send, includes the JIT's warm-up on these 2 cores) with the Java client's idempotent producer (acks all,\n")
		p("5 requests in flight, batches of up to 128 KiB). So it is the ceiling of Kafka's own tool here, not of the brokers.\n")
	}
	if eo := pick(r.Throughput, func(x relayTrial) bool { return x.Relay == kswitchExactlyOnce }, func(x relayTrial) float64 { return float64(x.Markers) }); len(eo) > 0 {
		share := pick(r.Throughput, func(x relayTrial) bool { return x.Relay == kswitchExactlyOnce },
			func(x relayTrial) float64 { return 100 * float64(x.Markers) / float64(x.Records+x.Markers) })
		p("\nexactly_once: the same agent with B's `delivery: exactly_once` (a Kafka transaction per source partition every\n")
		p("`transaction_interval`, 50 ms by default, holding the source position too), run right after each at_least_once trial.\n")
		p("Its records/s are taken from the end offsets as the others' are: records written, committed or not yet, and the\n")
		p("transactions' markers; markers a trial: %s, %% of the offsets: %s. The trial ends, and its first → last rate\n", statsOf(eo).spread(0), statsOf(share).spread(2))
		p("stops, at the first look with no transaction open at which kcat, reading read_committed, counts every record.\n")
		if cpu := r.relayCPUShares(); cpu != "" {
			p("\n%s", cpu)
		}
	}
	var extra []string
	for _, x := range append(slices.Clone(r.Throughput), r.MemoryLimit...) {
		if x.Delivered != x.Records {
			extra = append(extra, fmt.Sprintf("%s ×%d trial %d: %d at the destination for %d records", x.Relay, x.Instances, x.Trial, x.Delivered, x.Records))
		}
	}
	if len(extra) > 0 {
		p("\nDestinations holding more than the source (duplicates): %s.\n", strings.Join(extra, "; "))
	} else {
		p("\nEvery destination held exactly the %d records when its trial ended.\n", r.Scale.RelayRecords)
	}

	for _, m := range r.Memory {
		p("\nMemory: one agent relaying %d records of 1 KiB (12 partitions) peaked at **%.0f MiB** resident (VmHWM) at %.0f records/s\n", m.Records, m.PeakRSSMiB, m.RecordsPerSecond)
		p("(the relay's goal: ≤ 128 MiB). What the agent holds is bounded by configuration: `source.max_in_flight_mib` (32 MiB by default) caps the bytes of\n")
		p("records fetched and not yet acknowledged by every destination; a fetch waits while the budget is spent; `agent.memory_limit_mib`\n")
		p("(96 by default) is the Go runtime's soft limit on the process.\n")
	}
	p("%s", r.memoryLimitSection())

	// 2. Failover.
	p("\n## 2. Failover: A's broker SIGKILLed → first record consumed from B\n\n")
	p("![Failover timeline per trial](failover.svg)\n\n")
	p("Trials: %d. Before each, the fleet is paused until MirrorMaker 2 has copied 150 records more than it consumed\n", len(pick(r.Failover, stopped, switchSteps)))
	p("(so records wait on B), then A's broker gets SIGKILL and the fleet is resumed. Seconds after the kill, on\n")
	p("the benchmark's clock (its etcd watch and a 20 ms poll of the channel topic's end offsets); the switch's\n")
	p("phases from its `history/` event. Target: first record p50 ≤ 1.0 s at default settings (was: under failure_window + 1 s = 4 s).\n\n")
	p("| step | p50 s | max s | every trial |\n|---|---|---|---|\n")
	all := func(x failoverTrial) bool { return true }
	keep := stopped
	frow := func(label string, val func(failoverTrial) float64) {
		xs := pick(r.Failover, keep, val)
		s := statsOf(xs)
		p("| %s | %.3f | %.3f | %s |\n", label, s.Median, s.Max, joinFloats(xs, 3))
	}
	frow("detection: A declared down, switch started (`state/active` switching)", func(x failoverTrial) float64 { return x.DetectedSeconds })
	frow("decision: every agent released A and acknowledged (phase revoke)", func(x failoverTrial) float64 { return x.Phases["revoke"] })
	frow("translation of every partition (phase translate)", func(x failoverTrial) float64 { return x.Phases["translate"] })
	frow("activation (phase activate); B active at", func(x failoverTrial) float64 { return x.ActiveSeconds })
	frow("restart: B active → first record from B in the channel topic", func(x failoverTrial) float64 { return x.FirstRecordSeconds - x.ActiveSeconds })
	frow("**first record consumed from B** (total)", func(x failoverTrial) float64 { return x.FirstRecordSeconds })
	frow("first agent commit on B past the translated offsets", func(x failoverTrial) float64 { return x.FirstCommitSeconds })
	frow("the switch's own steps: A declared down → first record from B", switchSteps)
	if len(pick(r.Failover, hung, switchSteps)) > 0 {
		keep = hung
		p("\n**A hung.** Trials: %d, the same, but A's broker gets SIGSTOP (the kernel still accepts connections; nothing\n", len(pick(r.Failover, hung, switchSteps)))
		p("answers) and SIGCONT for the failback. A hang is not a hard failure: every agent must have seen A fail for the\n")
		p("full failure_window. Target: the switch's own steps within the stopped case's + 0.3 s.\n\n")
		p("| step | p50 s | max s | every trial |\n|---|---|---|---|\n")
		frow("detection: A declared down, switch started", func(x failoverTrial) float64 { return x.DetectedSeconds })
		frow("decision: every agent released A and acknowledged (phase revoke)", func(x failoverTrial) float64 { return x.Phases["revoke"] })
		frow("translation of every partition (phase translate)", func(x failoverTrial) float64 { return x.Phases["translate"] })
		frow("restart: B active → first record from B in the channel topic", func(x failoverTrial) float64 { return x.FirstRecordSeconds - x.ActiveSeconds })
		frow("**the switch's own steps: A declared down → first record from B**", switchSteps)
		frow("first record consumed from B (total)", func(x failoverTrial) float64 { return x.FirstRecordSeconds })
	}
	p("\n| trial | fault | translation | lost | duplicated | records checked |\n|---|---|---|---|---|---|\n")
	for _, x := range r.Failover {
		var ms []string
		for _, k := range sortedKeys(x.Methods) {
			ms = append(ms, fmt.Sprintf("%d %s", x.Methods[k], k))
		}
		fault := faultStopped
		if x.hung() {
			fault = faultHung
		}
		p("| %d | %s | %s | %d | %d | %d |\n", x.Trial, fault, strings.Join(ms, ", "), x.Lost, x.Duplicated, x.Records)
	}
	p("\nLost: records on A below the fleet's committed offsets that are not in the channel topic; duplicated:\n")
	p("the increase, during the trial, of extra copies in the channel topic (both read back with kcat).\n")

	// 3. Failback.
	p("\n## 3. Failback: A caught up → consuming from A\n\n")
	p("A's broker restarted on its data (after a hang: SIGCONT); it is caught up as soon as it answers metadata (nothing is\n")
	p("produced on B). The fleet returns once A has been healthy for failback_stable (%v here) and holds what was consumed\n", benchFailbackStable)
	p("on B. The producer (kcat) reconnects to A on its own schedule, so the fleet's restart is counted from when A is\n")
	p("active or holds a new record, whichever is later: nothing newer can be consumed before. All trials.\n\n")
	p("| step | p50 s | max s | every trial |\n|---|---|---|---|\n")
	keep = all
	frow("A ready → A active", func(x failoverTrial) float64 { return x.FailbackActiveSeconds })
	frow("A ready → the producer's first record on A", func(x failoverTrial) float64 { return x.FailbackProducedSeconds })
	frow("A ready → first record from A in the channel topic", func(x failoverTrial) float64 { return x.FailbackFirstRecordSeconds })
	frow("restart: A active (or its first new record, if later) → first record from A in the channel topic", func(x failoverTrial) float64 {
		return x.FailbackFirstRecordSeconds - max(x.FailbackActiveSeconds, x.FailbackProducedSeconds)
	})
	frow("**A ready → A active, plus the restart, less failback_stable**", failbackSeconds)

	// 4. Rebalance.
	p("\n## 4. Rebalance: an agent SIGKILLed → its partitions consumed elsewhere\n\n")
	p("Three agents; a follower (not the leader) gets SIGKILL and is started again after each trial. Seconds after\n")
	p("the kill until an assignment gives all its partitions to others, and until each of them has a record in the\n")
	p("channel topic delivered by its new owner (the last one's). `agent.death_detection: gossip` (the default):\n")
	p("memberlist declares the agent dead and the leader revokes its etcd lease; `lease`: the partitions move when\n")
	p("the lease expires (session_ttl %s).\n\n", sessionTTL)
	p("| death detection | trials | reassigned p50 / max s | consumed elsewhere p50 / max s | every trial (consumed) |\n|---|---|---|---|---|\n")
	for _, mode := range []string{"gossip", "lease"} {
		keep := func(x rebalanceTrial) bool { return x.DeathDetection == mode }
		re := statsOf(pick(r.Rebalance, keep, func(x rebalanceTrial) float64 { return x.ReassignedSeconds }))
		cons := pick(r.Rebalance, keep, func(x rebalanceTrial) float64 { return x.ConsumedSeconds })
		cs := statsOf(cons)
		p("| %s | %d | %.3f / %.3f | %.3f / %.3f | %s |\n", mode, cs.N, re.Median, re.Max, cs.Median, cs.Max, joinFloats(cons, 3))
	}
	g := pick(r.Rebalance, func(x rebalanceTrial) bool { return x.DeathDetection == "gossip" }, func(x rebalanceTrial) float64 { return x.ConsumedSeconds })
	l := pick(r.Rebalance, func(x rebalanceTrial) bool { return x.DeathDetection == "lease" }, func(x rebalanceTrial) float64 { return x.ConsumedSeconds })
	p("\nRatio gossip ÷ lease (consumed elsewhere, medians): %s.\n", ratio(g, l))

	// 5. Pause.
	pr := r.Pause
	ap, wp, pp := statsOf(pr.ApplyMs), statsOf(pr.WatchMs), statsOf(pr.PollMs)
	p("\n## 5. Pause: etcd write → every agent stopped\n\n")
	p("%d flips of `signals/fleet` between pause and start with three agents consuming. From the write's\n", pr.Flips)
	p("response until every agent's `/status` shows `signals_applied` at or past the write's revision (every\n")
	p("partition parked, or running again); baseline: a bare etcd watch in the benchmark process seeing the same write.\n")
	p("The agents are polled over HTTP: one round of `/status` requests takes %.2f ms (p50), the resolution of the figure.\n\n", pp.Median)
	p("| | p50 ms | p99 ms | max ms |\n|---|---|---|---|\n")
	p("| kswitch: every agent applied | %.2f | %.2f | %.2f |\n", ap.Median, ap.P99, ap.Max)
	p("| baseline: bare etcd watch | %.2f | %.2f | %.2f |\n", wp.Median, wp.P99, wp.Max)
	if wp.Median > 0 {
		p("| ratio kswitch ÷ watch | **%.1f** | %.1f | |\n", ap.Median/wp.Median, ap.P99/wp.P99)
	}

	// 6. Cost.
	p("\n## 6. Cost: CPU and memory at the same rate\n\n")
	if len(r.Cost) > 0 {
		c0 := r.Cost[0]
		p("One agent and one baseline relayloop side by side, each copying the same topic (12 partitions) to its own\n")
		p("topic on B while ProducerPerformance writes %d records/s of 1 KiB for %d s (%d records). CPU seconds\n", c0.Rate, r.Scale.CostSeconds, c0.Records)
		p("(utime + stime from `/proc/<pid>/stat`) over the producer's run; peak RSS is `VmHWM` from `/proc/<pid>/status`.\n")
		p("Both had every record at their destination within the lag shown after the producer finished.\n\n")
		p("| | CPU s | CPU ms per 1000 records | peak RSS MiB | lag s |\n|---|---|---|---|---|\n")
		for _, k := range []string{"kswitch", "relayloop"} {
			cpu := pick(r.Cost, func(costTrial) bool { return true }, func(x costTrial) float64 { return x.CPUSeconds[k] })
			per := pick(r.Cost, func(costTrial) bool { return true }, func(x costTrial) float64 { return 1e6 * x.CPUSeconds[k] / float64(x.Records) })
			rss := pick(r.Cost, func(costTrial) bool { return true }, func(x costTrial) float64 { return x.PeakRSSMiB[k] })
			lag := pick(r.Cost, func(costTrial) bool { return true }, func(x costTrial) float64 { return x.Lag[k] })
			p("| %s | %s | %s | %s | %s |\n", k, statsOf(cpu).spread(2), statsOf(per).spread(1), statsOf(rss).spread(0), statsOf(lag).spread(2))
		}
		cpu := func(k string) []float64 {
			return pick(r.Cost, func(costTrial) bool { return true }, func(x costTrial) float64 { return x.CPUSeconds[k] })
		}
		rss := func(k string) []float64 {
			return pick(r.Cost, func(costTrial) bool { return true }, func(x costTrial) float64 { return x.PeakRSSMiB[k] })
		}
		p("| ratio kswitch ÷ relayloop | %s | | %s | |\n", ratio(cpu("kswitch"), cpu("relayloop")), ratio(rss("kswitch"), rss("relayloop")))
	}

	// 7. Profile.
	if pr := r.Profile; pr != nil {
		p("\n## 7. Where the agent's CPU goes\n\n")
		p("A CPU profile of the memory trial's agent (`agent.pprof`, `/debug/pprof/profile`), %d s from its first record at\n", int(pr.Seconds))
		p("the destination, while it relayed at full speed: %.2f CPU seconds sampled. Each row is the share of the samples with a\n", pr.SampledSeconds)
		p("frame of that part on their stack, so parts that call others include them (the agent's loop calls routing; every\n")
		p("part allocates). The profile is `%s` next to this page: `go tool pprof -http=: bin/kswitch docs/%s`.\n\n", profileFile, profileFile)
		p("| part of the record path | frames | share of CPU |\n|---|---|---|\n")
		for _, sh := range pr.Shares {
			p("| %s | `%s` | %.1f %% |\n", sh.What, sh.Frames, sh.Percent)
		}
		p("\nThe functions that spend it themselves (`go tool pprof -top`):\n\n```\n%s\n```\n", strings.Join(pr.Top, "\n"))
	}

	if len(r.TxnCycle) > 0 {
		p("\n## 8. One transactional stream alone\n\n")
		p("internal/kafka's `TxnStream` on B, in the test's process, without an agent: %d records of 1 KiB over 4 partitions,\n", txnCycleRecords)
		p("committed every %d KiB, at most %d records not yet committed (about one stream's share of the agent's default\n", txnCycleCommitBytes>>10, txnCycleHeld)
		p("budget), against the same producer's idempotent path held to %d records not yet acknowledged.\n\n", txnCycleHeld)
		p("_alternating_ is a probe of a design, not of what the agent does: two streams (two transactional ids) take turns,\n")
		p("one sending while the other commits, the same records held at most (RELAY.md section 8, item 10).\n\n")
		p("| trial | idempotent records/s | transactional records/s | ratio | commits | mean commit | CONCURRENT_TRANSACTIONS retries | alternating records/s | ratio |\n|---|---|---|---|---|---|---|---|---|\n")
		rate := func(mode string) []float64 {
			return pick(r.TxnCycle, func(x txnCycleTrial) bool { return x.Mode == mode }, func(x txnCycleTrial) float64 { return x.RecordsPerSecond })
		}
		idem, txn, alt := rate("idempotent"), rate("transactional"), rate("alternating")
		n := 0 // transactional trial n beside idempotent trial n
		for _, x := range r.TxnCycle {
			if x.Mode != "transactional" || n >= len(idem) {
				continue
			}
			p("| %d | %.0f | %.0f | %.2f× | %d | %.1f ms | %d |", x.Trial, idem[n], x.RecordsPerSecond, x.RecordsPerSecond/idem[n], x.Commits, x.CommitMillis, x.ConcurrentRetries)
			if n < len(alt) {
				p(" %.0f | %.2f× |\n", alt[n], alt[n]/idem[n])
			} else {
				p(" | |\n")
			}
			n++
		}
		p("\ntransactional ÷ idempotent: %s.\n", ratio(txn, idem))
		if len(alt) > 0 {
			p("alternating ÷ idempotent: %s.\n", ratio(alt, idem))
		}
	}

	p("\n## In-process benchmarks (`go test -bench . -benchtime 1x ./...`, same make bench)\n\n```\n")
	for _, l := range r.GoBenchmarks {
		p("%s\n", l)
	}
	p("```\n\n")
	if slices.ContainsFunc(r.GoBenchmarks, func(l string) bool { return strings.HasPrefix(l, "scale ") }) {
		p("### How the cost grows\n\n")
		p("`BenchmarkScale`, `BenchmarkEtcdDatabaseUnderCompaction` and `BenchmarkCommitCeiling`, from the lines above; `scale.svg` is drawn by the same run.\n\n")
		p("%s\n", scaleTable(r.GoBenchmarks))
		p("![failover and kill rebalance times, and etcd bytes per second, against the partitions](scale.svg)\n\n")
	}
	p("## How to read and reproduce\n\n")
	p("- `make bench` (about %.0f minutes here) builds kswitch and the baseline, fetches Kafka's tools once, runs the\n", max(r.MakeSeconds, r.DurationSeconds)/60)
	p("  in-process benchmarks, then `TestBenchmarksOnRealStack` (build tags `integration bench`), and rewrites this page\n")
	p("  and `benchmarks.json`. `KSWITCH_BENCH_QUICK=1 make bench` does one trial of each, for development.\n")
	p("- Everything runs on one machine: the relays compete with both brokers for the same cores, so the absolute\n")
	p("  rates are this machine's; the ratios are the point.\n")
	for _, k := range sortedKeys(r.Settings) {
		p("- %s: %s.\n", k, r.Settings[k])
	}
	return b.String()
}

func met(ok bool) string {
	if ok {
		return "met"
	}
	return "**not met**"
}

func joinFloats(xs []float64, dec int) string {
	var s []string
	for _, x := range xs {
		s = append(s, fmt.Sprintf("%.*f", dec, x))
	}
	return strings.Join(s, ", ")
}

// scaleFields are the figures of a BenchmarkScale line, each a pattern
// and how its groups are shown.
var scaleFields = []struct {
	re     *regexp.Regexp
	format string
}{
	{regexp.MustCompile(`^scale (\d+) partitions (\d+) agents:`), "%s × %s"},
	{regexp.MustCompile(`start ([\d.]+) s`), "%s"},
	{regexp.MustCompile(`join ([\d.]+) s`), "%s"},
	{regexp.MustCompile(`leave ([\d.]+) s`), "%s"},
	{regexp.MustCompile(`kill ([\d.]+) s`), "%s"},
	{regexp.MustCompile(`failover ([\d.]+) s \(revoke [\d.]+, translate ([\d.]+)`), "%s (%s)"},
	{regexp.MustCompile(`idle ([\d.]+) etcd writes/s`), "%s"},
	{regexp.MustCompile(`at (\d+) records/s: (\d+) etcd writes/s, (\d+) kB/s`), "%s → %s, %s"},
	{regexp.MustCompile(`([\d.]+) revisions/s`), "%s"},
	{regexp.MustCompile(`db \+([\d.]+) MB/min`), "%s"},
	{regexp.MustCompile(`leader ([\d.]+) cores of the process's ([\d.]+)`), "%s of %s"},
	{regexp.MustCompile(`(\d+) B heap a partition`), "%s"},
	{regexp.MustCompile(`(\d+) records/s end to end`), "%s"},
	{regexp.MustCompile(`(\d+) lost, (\d+) twice`), "%s / %s"},
	{regexp.MustCompile(`(\d+) of \d+ by fingerprint`), "%s"},
}

// scaleTable renders BenchmarkScale's lines as a table, then its targets
// and the etcd lines (the database under compaction, the commit ceiling)
// as a list.
func scaleTable(lines []string) string {
	var b strings.Builder
	b.WriteString("| partitions × agents | start s | join s | leave s | kill s | failover s (translate) | idle etcd writes/s | at records/s → etcd writes/s, kB/s | revisions/s | db before compaction MB/min | leader cores of the process's | heap B a partition | records/s end to end | lost / twice | by fingerprint |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	var notes []string
	for _, l := range lines {
		switch {
		case strings.HasPrefix(l, "scale target:"), strings.HasPrefix(l, "etcd flat:"), strings.HasPrefix(l, "etcd ceiling"):
			notes = append(notes, "- "+strings.TrimPrefix(l, "scale target: "))
		case strings.HasPrefix(l, "scale "):
			b.WriteString("|")
			for _, f := range scaleFields {
				m := f.re.FindStringSubmatch(l)
				if m == nil {
					b.WriteString(" - |")
					continue
				}
				args := make([]any, len(m)-1)
				for i, g := range m[1:] {
					args[i] = g
				}
				fmt.Fprintf(&b, " "+f.format+" |", args...)
			}
			b.WriteString("\n")
		}
	}
	b.WriteString("\n")
	for _, n := range notes {
		b.WriteString(n + "\n")
	}
	return b.String()
}

// relayCPUShares compares, for one agent at least once and exactly once,
// the CPU seconds of the agent and of Kafka's brokers over a trial, and
// how busy they kept the machine's cores: where the machine's CPU went
// when exactly_once moved fewer records/s. Empty for results without the
// brokers' CPU.
func (r *benchResults) relayCPUShares() string {
	var b strings.Builder
	for _, relay := range []string{"kswitch", kswitchExactlyOnce} {
		one := func(x relayTrial) bool {
			return x.Relay == relay && x.Instances == 1 && x.BrokersCPUSeconds > 0 && x.RecordBytes == 0
		}
		agent := statsOf(pick(r.Throughput, one, func(x relayTrial) float64 { return x.CPUSeconds }))
		if agent.N == 0 {
			return ""
		}
		brokers := statsOf(pick(r.Throughput, one, func(x relayTrial) float64 { return x.BrokersCPUSeconds }))
		busy := statsOf(pick(r.Throughput, one, func(x relayTrial) float64 {
			return 100 * (x.CPUSeconds + x.BrokersCPUSeconds) / (x.TotalSeconds * float64(max(r.Machine.Cores, 1)))
		}))
		fmt.Fprintf(&b, "- %s ×1: the agent's CPU %s s, the brokers' (A and B) %s s over the trial; together %s %% of the machine's %d cores.\n",
			relay, agent.spread(2), brokers.spread(2), busy.spread(0), r.Machine.Cores)
	}
	return "CPU, from the relay's start to its last record:\n\n" + b.String()
}

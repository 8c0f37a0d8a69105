//go:build integration && bench

package integration

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The real-stack benchmarks of `make bench`. They reuse the
// integration suite's harness (etcd ×3, Kafka A and B, MirrorMaker 2, kcat
// and kswitch agents as OS processes) and carry a second build tag, bench,
// so that `make integration` neither builds nor runs them. Every kswitch
// figure is measured next to a baseline in the same run, on the same
// brokers, with the same record counts; completion is read back from Kafka
// (end offsets of the destination, the channel topic read with kcat), never
// from kswitch's own counters. Results go to $KSWITCH_BENCH_OUT as
// benchmarks.json (every trial) and BENCHMARKS.md.
//
// Environment (the Makefile's bench target sets all but the last):
//
//	KSWITCH_BENCH_OUT        directory of benchmarks.json and BENCHMARKS.md
//	KSWITCH_BENCH_RELAYLOOP  the baseline relay binary (tools/relayloop)
//	KSWITCH_BENCH_TOOLS      jars of Kafka's kafka-tools (benchtools/pom.xml)
//	KSWITCH_BENCH_GO         output of the in-process Go benchmarks, quoted in the page
//	KSWITCH_BENCH_MAKE_STARTED  when make bench started (Unix seconds), for its total time
//	KSWITCH_BENCH_QUICK=1    fewer trials and records, for development; the page says so
//	KSWITCH_BENCH_ONLY=a,b   only these phases (throughput, txncycle, memory, memlimit, cost, failover, rebalance, pause), for development
//	KSWITCH_BENCH_TRACE=dir  an execution trace (1 s) and a CPU profile (2 s) of each 1-agent kswitch relay trial into dir, for development
//	KSWITCH_BENCH_RELAYS=a,b only these relays in the throughput phase (kswitch, kswitch-exactly-once, relayloop, franzloop, mirrormaker2, kcat) and not Kafka's own tools, for development

// benchScale is how much work a run does.
type benchScale struct {
	Quick bool `json:"quick"`
	// RelayRecords is the record count of every relay trial, both sides.
	RelayRecords int `json:"relay_records"`
	// RelayTrials is the number of trials of each relay and ceiling, and
	// of each setting of the memory-limit figure (which relays
	// RelayRecords records of 150 B and of 1 KiB).
	RelayTrials int `json:"relay_trials"`
	// CostRate and CostSeconds: the producer's rate and duration while an
	// agent and the baseline relay the same records side by side.
	CostRate    int `json:"cost_rate"`
	CostSeconds int `json:"cost_seconds"`
	CostTrials  int `json:"cost_trials"`
	// FailoverTrials (A's broker SIGKILLed) and FailoverHungTrials
	// (SIGSTOPped) also give the failback samples.
	FailoverTrials     int `json:"failover_trials"`
	FailoverHungTrials int `json:"failover_hung_trials"`
	// MemoryRecords is the record count of the one-agent memory trial.
	MemoryRecords   int `json:"memory_records"`
	RebalanceTrials int `json:"rebalance_trials"`
	PauseFlips      int `json:"pause_flips"`
}

func scaleFromEnv() benchScale {
	s := benchScale{RelayRecords: 300_000, RelayTrials: 3, CostRate: 2000, CostSeconds: 20, CostTrials: 3,
		FailoverTrials: 5, FailoverHungTrials: 3, MemoryRecords: 1_000_000, RebalanceTrials: 5, PauseFlips: 200}
	if q, _ := strconv.ParseBool(os.Getenv("KSWITCH_BENCH_QUICK")); q {
		s = benchScale{Quick: true, RelayRecords: 30_000, RelayTrials: 1, CostRate: 1000, CostSeconds: 8, CostTrials: 1,
			FailoverTrials: 1, FailoverHungTrials: 1, MemoryRecords: 100_000, RebalanceTrials: 1, PauseFlips: 20}
	}
	return s
}

// relayPartitions is the partition count of the relay benchmarks' topics.
const relayPartitions = 12

// TestBenchmarksOnRealStack runs every real-stack figure in one stack and
// writes the results. Run through `make bench`.
func TestBenchmarksOnRealStack(t *testing.T) {
	out := os.Getenv("KSWITCH_BENCH_OUT")
	relayloop := os.Getenv("KSWITCH_BENCH_RELAYLOOP")
	tools := os.Getenv("KSWITCH_BENCH_TOOLS")
	if out == "" || relayloop == "" || tools == "" {
		fatal(t, "KSWITCH_BENCH_OUT, KSWITCH_BENCH_RELAYLOOP and KSWITCH_BENCH_TOOLS are not set: run `make bench`")
	}
	if jars, _ := filepath.Glob(filepath.Join(tools, "kafka-tools-[0-9]*.jar")); len(jars) == 0 {
		fatalf(t, "no kafka-tools jar in %s: run `make bench`, which fetches Kafka's performance tools", tools)
	}
	began := time.Now()
	res := &benchResults{Scale: scaleFromEnv(), Started: began.UTC(), Machine: describeMachine(t)}
	res.Machine.LoadBefore = loadAverage()
	// The figures "no worse than the last published page" compare with.
	if pub, err := readPublished(); err != nil {
		t.Logf("no published page to compare with: %v", err)
	} else {
		res.Published = pub
	}
	rep := newReport("bench")
	st := startStack(t, rep.timer(t), prefixPolicy, false)
	bx := &bench{t: t, st: st, relayloop: relayloop, tools: tools, res: res, scale: res.Scale, filled: map[string]int{}}
	if r := os.Getenv("KSWITCH_BENCH_RELAYS"); r != "" {
		bx.relays = strings.Split(r, ",")
	}
	only := os.Getenv("KSWITCH_BENCH_ONLY") // development: a comma-separated list of phases
	phase := func(name string, f func()) {
		t.Helper()
		if only != "" && name != "stack" && !slices.Contains(strings.Split(only, ","), name) {
			return
		}
		at := time.Now()
		f()
		d := time.Since(at)
		res.Phases = append(res.Phases, phaseTime{Name: name, Seconds: round3(d.Seconds())})
		t.Logf("bench phase %-10s %v (run so far %v)", name, d.Round(time.Second), time.Since(began).Round(time.Second))
	}
	phase("stack", func() {})
	res.Phases[0].Seconds = round3(time.Since(began).Seconds())
	phase("throughput", bx.throughput)
	phase("txncycle", bx.txnCycle)
	phase("memory", bx.memory)
	phase("memlimit", bx.memoryLimit)
	phase("cost", bx.cost)
	phase("failover", bx.failover)
	phase("rebalance", bx.rebalance)
	phase("pause", bx.pause)
	res.Machine.LoadAfter = loadAverage()
	res.GoBenchmarks = goBenchLines(os.Getenv("KSWITCH_BENCH_GO"))
	res.DurationSeconds = round3(time.Since(began).Seconds())
	if at, err := strconv.ParseInt(os.Getenv("KSWITCH_BENCH_MAKE_STARTED"), 10, 64); err == nil {
		res.MakeSeconds = float64(time.Now().Unix() - at)
	}
	for _, x := range res.targets() {
		t.Logf("target %s: %s: %s, measured %s: %s", x.Source, x.What, x.Target, x.Measured, strings.Trim(x.status(), "*"))
	}
	if t.Failed() {
		fatalf(t, "not writing %s: the run failed", out)
	}
	if err := res.write(out); err != nil {
		fatal(t, err)
	}
	t.Logf("real-stack benchmarks: %v; wrote %s", time.Since(began).Round(time.Second), out)
}

// TestBenchmarksPage rewrites $KSWITCH_BENCH_OUT/BENCHMARKS.md from the
// benchmarks.json there, without running anything: for changes to the
// page's wording. make bench does not run it.
func TestBenchmarksPage(t *testing.T) {
	out := os.Getenv("KSWITCH_BENCH_OUT")
	if out == "" {
		fatal(t, "KSWITCH_BENCH_OUT is not set: the directory of benchmarks.json (docs)")
	}
	b, err := os.ReadFile(filepath.Join(out, "benchmarks.json"))
	if err != nil {
		fatal(t, err)
	}
	var res benchResults
	if err := json.Unmarshal(b, &res); err != nil {
		fatalf(t, "%s/benchmarks.json: %v", out, err)
	}
	if err := writeCharts(out, &res); err != nil {
		fatal(t, err)
	}
	if err := os.WriteFile(filepath.Join(out, "BENCHMARKS.md"), []byte(res.markdown()), 0o644); err != nil {
		fatal(t, err)
	}
}

// bench is one run of the real-stack benchmarks.
type bench struct {
	t         *testing.T
	st        *stack
	relayloop string
	tools     string
	res       *benchResults
	scale     benchScale
	// filled holds the source topics on A written so far, by name: their
	// record count, so that a phase reuses what another wrote.
	filled map[string]int
	// The fleet of the fault figures, its producer and the watch of its
	// channel topic.
	agents    []*agentProc
	prod      *producer
	delivered *deliveredWatch
	// profileFrom is the HTTP address of the last agent a relay started,
	// profilePath where its profile was written.
	profileFrom, profilePath string
	// relays, when set (KSWITCH_BENCH_RELAYS), are the only relays the
	// throughput phase runs.
	relays []string
}

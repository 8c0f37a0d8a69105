//go:build integration && bench

package integration

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/IBM/sarama"
)

// Relay throughput (figure 1) and cost (figure 6). Every relay copies the
// same RelayRecords records of 1 KiB (written once by Kafka's
// ProducerPerformance into topic relay on A, 12 partitions) to a fresh
// topic on B; a trial ends when the destination's end offsets add up to
// the record count. The rate is taken over the middle of the copy (from
// 20 % to 80 % of the records at the destination), which leaves out each
// relay's start-up (JVM, group join, election and assignment) and the tail
// of the last partitions; both are kept in the trial data.

// relayTrial is one copy of the relay topic by one relay.
type relayTrial struct {
	// Relay is kswitch, kswitch-exactly-once (B's delivery exactly_once),
	// relayloop, franzloop, mirrormaker2 or kcat.
	Relay     string `json:"relay"`
	Instances int    `json:"instances"`
	Trial     int    `json:"trial"`
	Records   int64  `json:"records"`
	// RecordBytes is the size of each record's value; 0 (results written
	// before the 150 B trials): 1024.
	RecordBytes int `json:"record_bytes,omitempty"`
	// Env is what the trial added to the relay's environment
	// (GOMEMLIMIT=8GiB); empty: nothing.
	Env string `json:"env,omitempty"`
	// Markers (kswitch-exactly-once) is the destination's end offsets less
	// the records read back read_committed: the transactions' markers, one
	// a partition and transaction.
	Markers int64 `json:"markers,omitempty"`
	// Delivered is what the destination held when the trial ended: more
	// than Records would be duplicates.
	Delivered int64 `json:"delivered"`
	// StartupSeconds: processes started → first record at the destination.
	StartupSeconds float64 `json:"startup_seconds"`
	// TotalSeconds: processes started → every record at the destination.
	TotalSeconds float64 `json:"total_seconds"`
	// SteadySeconds: 20 % → 80 % of the records at the destination.
	SteadySeconds    float64 `json:"steady_seconds"`
	RecordsPerSecond float64 `json:"records_per_second"`
	// CPUSeconds (user + system) and PeakRSSMiB (VmHWM) of the relay's
	// processes, read from /proc when the copy was complete; the peak is
	// the largest process's.
	CPUSeconds float64 `json:"cpu_seconds,omitempty"`
	PeakRSSMiB float64 `json:"peak_rss_mib,omitempty"`
	// StartupCPUSeconds is the relay's CPU seconds at the first look that
	// saw records at the destination, FirstRecords how many it saw: what
	// CPUSeconds spent on the rest of the copy excludes start-up. Absent
	// in results written before.
	StartupCPUSeconds float64 `json:"startup_cpu_seconds,omitempty"`
	FirstRecords      int64   `json:"first_records,omitempty"`
	// BrokersCPUSeconds is the CPU seconds Kafka's A and B (their JVMs)
	// spent from the relay's start until the copy was complete (for
	// exactly_once, at the look that found no transaction open): on a
	// machine whose cores the brokers share with the relay, what a relay
	// makes the brokers do counts against its own rate. Absent in results
	// written before.
	BrokersCPUSeconds float64 `json:"brokers_cpu_seconds,omitempty"`
}

// copyCPUPerRecord is the CPU seconds a record cost from the first record
// at the destination to the last, start-up left out; over the whole trial
// for results written before StartupCPUSeconds.
func (x relayTrial) copyCPUPerRecord() float64 {
	if x.StartupCPUSeconds == 0 || x.FirstRecords >= x.Records {
		return x.CPUSeconds / float64(x.Records)
	}
	return (x.CPUSeconds - x.StartupCPUSeconds) / float64(x.Records-x.FirstRecords)
}

// ceilingTrial is one run of Kafka's own performance tools.
type ceilingTrial struct {
	Tool             string  `json:"tool"` // ProducerPerformance, ConsumerPerformance
	Trial            int     `json:"trial"`
	Records          int64   `json:"records"`
	RecordsPerSecond float64 `json:"records_per_second"`
	// Output is the tool's result line(s), as printed.
	Output string `json:"output"`
}

// costTrial is an agent and the baseline relaying the same records side
// by side, at the producer's rate.
type costTrial struct {
	Trial   int   `json:"trial"`
	Rate    int   `json:"rate"`
	Records int64 `json:"records"`
	// Seconds is the producer's run; each relay had every record at its
	// destination within LagSeconds of the producer's end.
	Seconds float64            `json:"seconds"`
	Lag     map[string]float64 `json:"lag_seconds"`
	// CPUSeconds over the producer's run, PeakRSSMiB over the process's
	// life, by relay.
	CPUSeconds map[string]float64 `json:"cpu_seconds"`
	PeakRSSMiB map[string]float64 `json:"peak_rss_mib"`
}

func (bx *bench) throughput() {
	t, st, n := bx.t, bx.st, bx.scale.RelayRecords
	// The brokers' ceiling, and the source topic: the first producer run
	// fills relay.
	for i := 1; i <= bx.scale.RelayTrials; i++ {
		if i == 1 && bx.filled["relay"] == 0 {
			bx.res.Ceiling = append(bx.res.Ceiling, bx.fillSource("relay", n, 1024))
			continue
		}
		if bx.relays != nil {
			continue
		}
		topic := fmt.Sprintf("ceiling-%d", i)
		st.a.createTopic(t, topic, relayPartitions)
		bx.res.Ceiling = append(bx.res.Ceiling, bx.producerPerf(i, topic, n, -1))
	}
	for i := 1; i <= bx.scale.RelayTrials && bx.relays == nil; i++ {
		bx.res.Ceiling = append(bx.res.Ceiling, bx.consumerPerf(i, "relay", n))
	}
	// Baseline and kswitch alternate, so that drift of the machine
	// (another process, page cache) hits both alike; so do kswitch at
	// least once and exactly once (row G4: ≥ 0.9×).
	run := func(kind string, instances, i int) {
		if bx.relays == nil || slices.Contains(bx.relays, kind) {
			bx.res.Throughput = append(bx.res.Throughput, bx.relay(kind, instances, i, "relay", n))
		}
	}
	for i := 1; i <= bx.scale.RelayTrials; i++ {
		for _, instances := range []int{1, 3} {
			run("relayloop", instances, i)
			if instances == 1 {
				run("franzloop", 1, i)
			}
			run("kswitch", instances, i)
			if instances == 1 {
				run(kswitchExactlyOnce, 1, i)
			}
		}
		run("mirrormaker2", 1, i)
		run("kcat", 1, i)
	}
}

// kswitchExactlyOnce is the relay kind of kswitch agents whose channel's
// cluster, B, has delivery exactly_once.
const kswitchExactlyOnce = "kswitch-exactly-once"

// noMemoryLimit is the environment of the memory-limit figure's baseline:
// GOMEMLIMIT wins over agent.memory_limit_mib (docs/CONSUMING.md), and
// 8 GiB is more than the agent ever holds here.
const noMemoryLimit = "GOMEMLIMIT=8GiB"

// fillSource creates topic on A and writes n records of size bytes to it
// with ProducerPerformance, once a run: a phase that needs a topic another
// phase wrote reuses it. It returns the producer's run (the first
// ceiling trial when topic is relay).
func (bx *bench) fillSource(topic string, n, size int) ceilingTrial {
	t := bx.t
	if had, ok := bx.filled[topic]; ok {
		if had != n {
			fatalf(t, "%s on A was filled with %d records, want %d", topic, had, n)
		}
		return ceilingTrial{}
	}
	bx.st.a.createTopic(t, topic, relayPartitions)
	ct := bx.producerPerfSized(1, topic, n, -1, size)
	ends, err := endOffsets(bx.st.a.addr, topic)
	if err != nil {
		fatal(t, err)
	}
	if sum(ends) != int64(n) {
		fatalf(t, "%s on A holds %d records, ProducerPerformance wrote %d", topic, sum(ends), n)
	}
	bx.filled[topic] = n
	return ct
}

// memory relays MemoryRecords records of 1 KiB with one agent, for its peak
// resident set against the relay goal's bound (row G5: 128 MiB at 1 M
// records), which source.max_in_flight_mib sets (records fetched and not
// yet acknowledged by every destination; 32 MiB by default) with
// agent.memory_limit_mib.
func (bx *bench) memory() {
	n := bx.scale.MemoryRecords
	bx.fillSource("memory", n, 1024)
	bx.res.Memory = append(bx.res.Memory, bx.relayWith(relayRun{kind: "kswitch", instances: 1, trial: 1, src: "memory", n: n, size: 1024, profile: true}))
}

// memoryLimit relays RelayRecords records of 150 B and of 1 KiB with one
// agent at the default agent.memory_limit_mib and with noMemoryLimit in
// its environment, in turn, for the CPU a record costs under the default
// limit (row G7: ≤ 1.1× without a limit, on both sizes).
func (bx *bench) memoryLimit() {
	n := bx.scale.RelayRecords
	sources := []struct {
		topic string
		size  int
	}{{"relay-150", 150}, {"relay", 1024}}
	for _, src := range sources {
		bx.fillSource(src.topic, n, src.size)
	}
	for i := 1; i <= bx.scale.RelayTrials; i++ {
		for _, src := range sources {
			for _, env := range []string{"", noMemoryLimit} {
				tag := "memory-limit"
				if env != "" {
					tag = "no-memory-limit"
				}
				tr := bx.relayWith(relayRun{kind: "kswitch", instances: 1, trial: i, src: src.topic, n: n, size: src.size, env: env, tag: tag})
				bx.res.MemoryLimit = append(bx.res.MemoryLimit, tr)
			}
		}
	}
}

// relay runs one trial of one relay copying src (n records of 1 KiB) from
// A to a fresh topic on B.
func (bx *bench) relay(kind string, instances, trial int, src string, n int) relayTrial {
	return bx.relayWith(relayRun{kind: kind, instances: instances, trial: trial, src: src, n: n, size: 1024})
}

// relayRun is one trial of a relay: what relay copies, and how it runs.
type relayRun struct {
	kind             string
	instances, trial int
	src              string
	n, size          int // records in src, and each one's value size
	// env is added to the environment of kswitch agents (NAME=value).
	env string
	// tag tells the trial's destination topic and group apart from
	// another phase's trial of the same relay, source and number.
	tag string
	// profile: the (one) agent serves agent.pprof, and a CPU profile of
	// profileSeconds is taken from its first record at the destination
	// (bench.res.Profile).
	profile bool
}

// name is the trial's part of its destination topic's and group's names.
func (r relayRun) name() string {
	n := fmt.Sprintf("%s-%s-%d-%d", r.src, r.kind, r.instances, r.trial)
	if r.tag != "" {
		n += "-" + r.tag
	}
	return n
}

// fleet is the fleet name of a kswitchExactlyOnce trial's agents, one a
// trial, and empty for the others (the suite's fleet). The positions an
// exactly_once cluster keeps in __kswitch.positions are keyed by fleet and
// source topic: under the suite's fleet, the next trial's agent would read
// the last trial's position and skip every record as delivered.
func (r relayRun) fleet() string {
	if r.kind != kswitchExactlyOnce {
		return ""
	}
	return fmt.Sprintf("bench-eo-%s-%d", r.src, r.trial)
}

// relayWith runs one trial of one relay copying src from A to a fresh
// topic on B. A kswitchExactlyOnce trial ends when the destination holds
// every record read_committed (watchCommitted), the others when its end
// offsets add up to the record count (watchFill).
func (bx *bench) relayWith(r relayRun) relayTrial {
	t, st := bx.t, bx.st
	kind, instances, trial, src, n := r.kind, r.instances, r.trial, r.src, r.n
	dest := "out-" + r.name()
	if kind == "mirrormaker2" {
		// MirrorMaker 2 names the copy after the source alias, one per
		// trial so that each starts from nothing.
		dest = fmt.Sprintf("S%d.%s", trial, src)
	} else {
		st.b.createTopic(t, dest, relayPartitions)
	}
	brokersBefore := bx.brokersCPU()
	began := time.Now()
	procs := bx.startRelay(r, dest)
	var (
		f        fill
		err      error
		markers  int64
		startCPU float64
	)
	var profiled chan error
	atFirst := func() {
		startCPU = bx.relayUsage(procs).cpu
		if r.profile {
			profiled = make(chan error, 1)
			bx.profilePath = filepath.Join(t.TempDir(), profileFile)
			go func() { profiled <- profileAgent(bx.profileFrom, bx.profilePath) }()
		} else if dir := os.Getenv("KSWITCH_BENCH_TRACE"); dir != "" && strings.HasPrefix(kind, "kswitch") && instances == 1 {
			profiled = make(chan error, 1)
			path := filepath.Join(dir, fmt.Sprintf("%s-%d", kind, trial))
			go func() {
				cpu := make(chan error, 1)
				go func() { cpu <- profileAgent(bx.profileFrom, path+".pprof") }()
				profiled <- errors.Join(traceAgent(bx.profileFrom, path+".trace"), <-cpu)
			}()
		}
	}
	var brokersAfter float64
	if kind == kswitchExactlyOnce {
		// The brokers' CPU is read before the count's read of the whole
		// topic, which is the harness's work.
		f, markers, err = watchCommitted(st.b.addr, dest, int64(n), 5*time.Minute, atFirst, func() { brokersAfter = bx.brokersCPU() })
	} else {
		f, err = watchFill(st.b.addr, dest, int64(n), 5*time.Minute, atFirst)
		brokersAfter = bx.brokersCPU()
	}
	tr := relayTrial{Relay: kind, Instances: instances, Trial: trial, Records: int64(n), Delivered: f.last, Markers: markers, Env: r.env,
		StartupCPUSeconds: round3(startCPU), FirstRecords: f.nFirst}
	if r.size != 1024 {
		tr.RecordBytes = r.size
	}
	if profiled != nil && r.profile {
		bx.summarizeProfile(<-profiled) // ends within profileSeconds + 10 s (its client's timeout)
	} else if profiled != nil {
		if err := <-profiled; err != nil {
			t.Logf("no trace of %s trial %d: %v", kind, trial, err)
		}
	}
	usage := bx.relayUsage(procs)
	tr.BrokersCPUSeconds = round3(brokersAfter - brokersBefore)
	bx.stopRelay(kind, procs)
	if f := r.fleet(); f != "" {
		if _, derr := st.etcd.etcdctl("del", "--prefix", "/kswitch/"+f+"/"); derr != nil {
			fatal(t, derr)
		}
	}
	if err != nil {
		fatalf(t, "%s ×%d, trial %d: %v", kind, instances, trial, err)
	}
	if !f.p80.After(f.p20) {
		fatalf(t, "%s ×%d, trial %d: %s filled from 20 %% to 80 %% between two looks 20 ms apart: too few records to measure a rate", kind, instances, trial, dest)
	}
	tr.StartupSeconds = round3(f.first.Sub(began).Seconds())
	tr.TotalSeconds = round3(f.done.Sub(began).Seconds())
	tr.SteadySeconds = round3(f.p80.Sub(f.p20).Seconds())
	tr.RecordsPerSecond = round1(float64(f.n80-f.n20) / f.p80.Sub(f.p20).Seconds())
	tr.CPUSeconds, tr.PeakRSSMiB = round3(usage.cpu), round1(float64(usage.hwmKiB)/1024)
	if kind == "kcat" {
		tr.PeakRSSMiB = 0 // the kcats may have exited: their peaks are gone
	}
	env := ""
	if r.env != "" {
		env = ", " + r.env
	}
	t.Logf("relay %-12s ×%d trial %d, %s (%d B%s): %.0f records/s (startup %.1fs, total %.1fs, cpu %.1fs, brokers' cpu %.1fs, rss %.0f MiB)",
		kind, instances, trial, src, r.size, env, tr.RecordsPerSecond, tr.StartupSeconds, tr.TotalSeconds, tr.CPUSeconds, tr.BrokersCPUSeconds, tr.PeakRSSMiB)
	return tr
}

// relayUsage is the CPU seconds of a relay's processes and the largest
// peak resident set among them.
func (bx *bench) relayUsage(procs []*proc) procUsage {
	var usage procUsage
	for _, p := range procs {
		u, err := treeUsage(p.cmd.Process.Pid)
		if err != nil {
			bx.t.Logf("%s: %v", p.name, err)
		}
		usage.cpu += u.cpu
		usage.hwmKiB = max(usage.hwmKiB, u.hwmKiB)
	}
	return usage
}

// brokersCPU is the CPU seconds A's and B's JVMs have used so far.
func (bx *bench) brokersCPU() float64 {
	var cpu float64
	for _, b := range []*kafkaBroker{bx.st.a, bx.st.b} {
		u, err := treeUsage(b.proc.cmd.Process.Pid)
		if err != nil {
			bx.t.Logf("broker %s: %v", b.name, err)
		}
		cpu += u.cpu
	}
	return cpu
}

// startRelay starts the processes of one relay trial.
func (bx *bench) startRelay(r relayRun, dest string) []*proc {
	t, st := bx.t, bx.st
	kind, instances, trial, src := r.kind, r.instances, r.trial, r.src
	group := "g-" + r.name()
	var procs []*proc
	switch kind {
	case "relayloop":
		for i := 1; i <= instances; i++ {
			procs = append(procs, bx.startRelayloop(fmt.Sprintf("relayloop-%d", i), src, group, dest))
		}
	case "franzloop":
		procs = append(procs, bx.startRelayloop("franzloop", src, group, dest, "-client", "franz-go"))
	case "kswitch", kswitchExactlyOnce:
		v := agentVariant{exactlyOnce: kind == kswitchExactlyOnce}
		if r.env != "" {
			v.env = []string{r.env}
		}
		if r.profile || os.Getenv("KSWITCH_BENCH_TRACE") != "" {
			v.env = append(v.env, "KSWITCH_AGENT_PPROF=true")
		}
		if f := r.fleet(); f != "" {
			v.args = []string{"--fleet=" + f}
		}
		for _, a := range bx.startRelayAgentsWith(instances, src, group, dest, v) {
			procs = append(procs, a.proc)
			bx.profileFrom = a.http
		}
	case "mirrormaker2":
		procs = append(procs, bx.startCopyMirrorMaker(fmt.Sprintf("S%d", trial), src))
	case "kcat":
		// The same records through a pipe: kcat reads A from the
		// beginning to its end (-e) and the second kcat writes each value
		// to B with the idempotent producer (acks all); partitions follow
		// librdkafka's partitioner. The shell then waits to be killed, so
		// that the CPU time of both kcats, its children, can be read.
		cmd := fmt.Sprintf("kcat -C -b %s -t %s -o beginning -e -q -f '%%s\\n' | kcat -P -b %s -t %s -X enable.idempotence=true; sleep 3600",
			st.a.addr, src, st.b.addr, dest)
		procs = append(procs, startProc(t, "kcat-pipe", "bash", "-c", cmd))
	default:
		fatalf(t, "no relay %q", kind)
	}
	return procs
}

func (bx *bench) stopRelay(kind string, procs []*proc) {
	for _, p := range procs {
		switch kind {
		case "relayloop", "franzloop", "kswitch", kswitchExactlyOnce:
			p.signal(syscall.SIGTERM) // a clean stop: commits, leaves the group
		default:
			p.expected.Store(true)
			_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL) // the process group: bash and both kcats
		}
	}
	for _, p := range procs {
		if err := p.wait(20 * time.Second); err != nil && p.running() {
			bx.t.Fatalf("%s does not stop: %v", p.name, err)
		}
	}
	if kind == "kswitch" || kind == kswitchExactlyOnce {
		bx.resetFleet()
	}
}

// resetFleet removes the fleet's keys once its agents are gone, so that
// the next fleet starts from nothing.
func (bx *bench) resetFleet() {
	if _, err := bx.st.etcd.etcdctl("del", "--prefix", fleetPrefix); err != nil {
		bx.t.Fatal(err)
	}
}

func (bx *bench) startRelayloop(name, src, group, dest string, extra ...string) *proc {
	args := append([]string{"-from", bx.st.a.addr, "-topic", src, "-group", group,
		"-to", bx.st.b.addr, "-dest", dest, "-version", kafkaVersion, "-commit-interval", "500ms"}, extra...)
	return startProc(bx.t, name, bx.relayloop, args...)
}

// startRelayAgents starts n agents that relay src to dest on B with one
// rule and one channel, as the baseline does: into the same partition.
// extraArgs are added to each agent's command line.
func (bx *bench) startRelayAgents(n int, src, group, dest string, extraArgs []string) []*agentProc {
	return bx.startRelayAgentsWith(n, src, group, dest, agentVariant{args: extraArgs})
}

// agentVariant is how a trial's agents differ from the suite's.
type agentVariant struct {
	// exactlyOnce sets B's delivery (the channel's cluster) to
	// exactly_once.
	exactlyOnce bool
	// args are added to each agent's command line, env (NAME=value) to
	// its environment.
	args, env []string
}

// startRelayAgentsWith is startRelayAgents with a variant.
func (bx *bench) startRelayAgentsWith(n int, src, group, dest string, v agentVariant) []*agentProc {
	c := bx.st.agentConfig()
	if v.exactlyOnce {
		c.Clusters += "    delivery: exactly_once\n" // B's, the last cluster
	}
	c.Source = fmt.Sprintf("  topics: [%s]\n  group: %s\n  initial_offset: oldest\n  refresh_interval: 2s\n  commit_interval: 500ms\n", src, group)
	c.Extra = fmt.Sprintf(`routing:
  rules:
    - name: all
      match: 'true'
      channels: [out]
  channels:
    out: {cluster: B, topic: %s, partitioner: manual-same-partition}
`, dest)
	var agents []*agentProc
	for i := 1; i <= n; i++ {
		agents = append(agents, bx.startAgentEnv(fmt.Sprintf("agent-%d", i), c, v.args, v.env))
	}
	return agents
}

// startAgent is startAgentWith with extra command-line arguments.
func (bx *bench) startAgent(id string, c agentConfig, extraArgs []string) *agentProc {
	return bx.startAgentEnv(id, c, extraArgs, nil)
}

// startAgentEnv is startAgent with more environment (NAME=value).
func (bx *bench) startAgentEnv(id string, c agentConfig, extraArgs, env []string) *agentProc {
	bin, _ := binaries(bx.t)
	conf, httpAddr := writeAgentConfigWith(bx.t, id, c)
	args := append([]string{"agent", "--config", conf}, extraArgs...)
	return &agentProc{id: id, http: httpAddr, conf: conf, proc: startProcWith(bx.t, procOptions{Env: env}, id, bin, args...)}
}

// startCopyMirrorMaker runs MirrorMaker 2 copying topic from A (under the
// alias, so the copy is <alias>.<topic> on B) with its defaults (one task),
// and nothing else: no groups, checkpoints or heartbeats.
func (bx *bench) startCopyMirrorMaker(alias, topic string) *proc {
	t, st := bx.t, bx.st
	dir := t.TempDir()
	conf := filepath.Join(dir, "mm2.properties")
	props := fmt.Sprintf(`clusters = %[1]s, B
%[1]s.bootstrap.servers = %[2]s
B.bootstrap.servers = %[3]s
%[1]s->B.enabled = true
%[1]s->B.topics = %[4]s
%[1]s->B.groups.exclude = .*
B->%[1]s.enabled = false
emit.heartbeats.enabled = false
emit.checkpoints.enabled = false
sync.group.offsets.enabled = false
sync.topic.configs.enabled = false
sync.topic.acls.enabled = false
%[5]splugin.discovery = service_load
`, alias, st.a.addr, st.b.addr, topic, mm2OneBroker)
	if err := os.WriteFile(conf, []byte(props), 0o644); err != nil {
		fatal(t, err)
	}
	return startProc(t, "mirrormaker-"+alias, st.env.java,
		append(st.env.jvmArgs("384m", dir, "org.apache.kafka.connect.mirror.MirrorMaker"), conf)...)
}

// fill is how a destination topic filled up, as seen by watchFill.
type fill struct {
	first, p20, p80, done time.Time
	nFirst, n20, n80      int64 // records at first, p20 and p80
	last                  int64 // records at the last look
}

// mark notes, at the first look at or past each, when the destination
// held its first record (calling atFirst, if not nil), 20 % and 80 % of
// n: got records at now.
func (f *fill) mark(now time.Time, got, n int64, atFirst func()) {
	if got > 0 && f.first.IsZero() {
		f.first, f.nFirst = now, got
		if atFirst != nil {
			atFirst()
		}
	}
	if got >= n/5 && f.p20.IsZero() {
		f.p20, f.n20 = now, got
	}
	if got >= n*4/5 && f.p80.IsZero() {
		f.p80, f.n80 = now, got
	}
}

// watchFill polls the end offsets of topic on addr (one ListOffsets
// request for all partitions, every 20 ms) until they add up to n, and
// says when they passed 0, 20 %, 80 % and 100 % of n. The topic may not
// exist yet (MirrorMaker 2 creates it). atFirst, if not nil, is called
// at the first look that sees records.
func watchFill(addr, topic string, n int64, timeout time.Duration, atFirst func()) (fill, error) {
	var f fill
	cl, err := sarama.NewClient([]string{addr}, saramaConfig(5*time.Second))
	if err != nil {
		return f, err
	}
	defer cl.Close()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for ; ; <-tick.C {
		if time.Now().After(deadline) {
			return f, fmt.Errorf("%s on %s holds %d records after %v, want %d", topic, addr, f.last, timeout, n)
		}
		ends, err := topicEnds(cl, topic)
		if err != nil {
			continue // not created yet, or a leader moving
		}
		now, got := time.Now(), sum(ends)
		f.last = got
		f.mark(now, got, n, atFirst)
		if got >= n {
			f.done = now
			return f, nil
		}
	}
}

// watchCommitted is watchFill for a destination written in transactions.
// The first record, 20 % and 80 % are taken from the end offsets, as
// watchFill does: records written, committed or not yet, plus the
// transactions' markers (one a partition and transaction, well under 1 %
// of a copy). The copy is done at the first look at which no transaction
// is open (the last stable offsets equal the end offsets) and a
// read_committed read of the topic with kcat counts n records or more;
// the read comes after the look and does not delay it. fill.last is that
// count, and markers the end offsets less it. atFirst is as watchFill's;
// atStable, if not nil, is called at each such look, before the read.
func watchCommitted(addr, topic string, n int64, timeout time.Duration, atFirst, atStable func()) (f fill, markers int64, err error) {
	cl, err := sarama.NewClient([]string{addr}, saramaConfig(5*time.Second))
	if err != nil {
		return f, 0, err
	}
	defer cl.Close()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	counted := int64(-1) // the stable offsets' sum last counted
	for ; ; <-tick.C {
		if time.Now().After(deadline) {
			return f, 0, fmt.Errorf("%s on %s holds %d records read_committed after %v, want %d", topic, addr, max(f.last, 0), timeout, n)
		}
		ends, err := topicEndsAt(cl, topic, sarama.ReadUncommitted)
		if err != nil {
			continue
		}
		now, got := time.Now(), sum(ends)
		f.mark(now, got, n, atFirst)
		if got < n || got == counted {
			continue
		}
		stable, err := topicEndsAt(cl, topic, sarama.ReadCommitted)
		if err != nil || sum(stable) != got {
			continue // a transaction is open
		}
		counted = got
		if atStable != nil {
			atStable()
		}
		records, err := countCommitted(addr, topic)
		if err != nil {
			return f, 0, err
		}
		f.last = records
		if records >= n {
			f.done = now
			return f, got - records, nil
		}
	}
}

// countCommitted reads topic on addr from the beginning to its last stable
// offsets with kcat, read_committed, and counts the records.
func countCommitted(addr, topic string) (int64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := kcat(ctx, "-C", "-b", addr, "-t", topic, "-o", "beginning", "-e", "-q", "-f", `%p\n`,
		"-X", "isolation.level=read_committed", "-X", "fetch.wait.max.ms=50")
	if err != nil {
		return 0, err
	}
	return int64(strings.Count(out, "\n")), nil
}

// topicEnds returns the end offsets of every partition of topic with one
// ListOffsets request to the partitions' leader (every cluster here has
// one broker).
func topicEnds(cl sarama.Client, topic string) (map[int32]int64, error) {
	return topicEndsAt(cl, topic, sarama.ReadUncommitted)
}

// topicEndsAt is topicEnds at an isolation level: ReadCommitted answers
// the last stable offsets, below any open transaction.
func topicEndsAt(cl sarama.Client, topic string, level sarama.IsolationLevel) (map[int32]int64, error) {
	ps, err := cl.Partitions(topic)
	if err != nil {
		_ = cl.RefreshMetadata(topic)
		return nil, err
	}
	if len(ps) == 0 {
		return nil, fmt.Errorf("%s has no partitions", topic)
	}
	b, err := cl.Leader(topic, ps[0])
	if err != nil {
		return nil, err
	}
	req := &sarama.OffsetRequest{Version: 1}
	if level == sarama.ReadCommitted {
		req.Version, req.IsolationLevel = 2, level
	}
	for _, p := range ps {
		req.AddBlock(topic, p, sarama.OffsetNewest, 1)
	}
	resp, err := b.GetAvailableOffsets(req)
	if err != nil {
		return nil, err
	}
	out := map[int32]int64{}
	for _, p := range ps {
		blk := resp.GetBlock(topic, p)
		if blk == nil {
			return nil, fmt.Errorf("%s/%d: no answer", topic, p)
		}
		if blk.Err != sarama.ErrNoError {
			return nil, fmt.Errorf("%s/%d: %w", topic, p, blk.Err)
		}
		out[p] = blk.Offset
	}
	return out, nil
}

// procUsage is what a process tree has used: CPU seconds (user + system)
// and the largest peak resident set (VmHWM) of its processes.
type procUsage struct {
	cpu    float64
	hwmKiB int64
}

// clockTicks is USER_HZ, the unit of /proc/<pid>/stat's times: 100 on
// every Linux architecture kswitch is built for.
const clockTicks = 100

// treeUsage reads /proc for pid and its descendants.
func treeUsage(pid int) (procUsage, error) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return procUsage{}, err
	}
	// Fields after the command (which may hold spaces) in parentheses:
	// state is field 3, utime 14, stime 15, and the children's that the
	// process waited for, cutime 16 and cstime 17.
	rest := string(stat[strings.LastIndexByte(string(stat), ')')+2:])
	f := strings.Fields(rest)
	if len(f) < 15 {
		return procUsage{}, fmt.Errorf("/proc/%d/stat: %q", pid, stat)
	}
	var ticks int64
	for _, field := range f[11:15] {
		n, err := strconv.ParseInt(field, 10, 64)
		if err != nil {
			return procUsage{}, fmt.Errorf("/proc/%d/stat: %w", pid, err)
		}
		ticks += n
	}
	u := procUsage{cpu: float64(ticks) / clockTicks}
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return procUsage{}, err
	}
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			u.hwmKiB, _ = strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		}
	}
	children, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pid, pid))
	for _, c := range strings.Fields(string(children)) {
		cpid, _ := strconv.Atoi(c)
		if cu, err := treeUsage(cpid); err == nil {
			u.cpu += cu.cpu
			u.hwmKiB = max(u.hwmKiB, cu.hwmKiB)
		}
	}
	return u, nil
}

// kafkaTool runs one of Kafka's command-line tools (main class, from the
// broker's jars and kafka-tools') to completion and returns its output.
func (bx *bench) kafkaTool(name, main string, args ...string) string {
	t, env := bx.t, bx.st.env
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	// The tools print their results on stdout; their logs (warnings
	// only) go to stderr.
	log4j := filepath.Join(t.TempDir(), "log4j2.properties")
	if err := os.WriteFile(log4j, []byte(`appender.err.type = Console
appender.err.name = STDERR
appender.err.target = SYSTEM_ERR
appender.err.layout.type = PatternLayout
appender.err.layout.pattern = [%d{HH:mm:ss.SSS}] %p %m (%c{1})%n
rootLogger.level = warn
rootLogger.appenderRef.err.ref = STDERR
`), 0o644); err != nil {
		fatal(t, err)
	}
	cp := filepath.Join(env.libs, "*") + ":" + filepath.Join(bx.tools, "*")
	all := append([]string{"-Xms256m", "-Xmx256m", "-XX:+UseG1GC", "-Djava.awt.headless=true",
		"-Dlog4j2.configurationFile=" + log4j, "-cp", cp, main}, args...)
	cmd := exec.CommandContext(ctx, env.java, all...)
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	logf := filepath.Join(logDir(t), name+".log")
	_ = os.WriteFile(logf, []byte(stdout.String()+stderr.String()), 0o644)
	if err != nil {
		fatalf(t, "%s: %v; last output:\n%s", name, err, tail(logf, 20))
	}
	return stdout.String()
}

var producerPerfLine = regexp.MustCompile(`(?m)^(\d+) records sent, ([\d.]+) records/sec.*$`)

// producerPerf writes n records of 1 KiB to topic on A with Kafka's
// ProducerPerformance, acks all (kswitch's default) and batches of up to
// 128 KiB (the default 16 KiB would make the ceiling lower than what
// sarama's unbounded batches reach), at rate per second (-1: as fast as it
// can).
func (bx *bench) producerPerf(trial int, topic string, n, rate int) ceilingTrial {
	return bx.producerPerfSized(trial, topic, n, rate, 1024)
}

// producerPerfSized is producerPerf with records of size bytes.
func (bx *bench) producerPerfSized(trial int, topic string, n, rate, size int) ceilingTrial {
	out := bx.kafkaTool(fmt.Sprintf("producer-perf-%s-%d", topic, trial), "org.apache.kafka.tools.ProducerPerformance",
		"--topic", topic, "--num-records", strconv.Itoa(n), "--record-size", strconv.Itoa(size), "--throughput", strconv.Itoa(rate),
		"--producer-props", "bootstrap.servers="+bx.st.a.addr, "acks=all", "batch.size=131072", "linger.ms=5")
	m := producerPerfLine.FindAllStringSubmatch(out, -1)
	if len(m) == 0 {
		bx.t.Fatalf("ProducerPerformance printed no result line:\n%s", out)
	}
	last := m[len(m)-1] // the summary follows the periodic lines
	sent, _ := strconv.ParseInt(last[1], 10, 64)
	r, _ := strconv.ParseFloat(last[2], 64)
	if sent != int64(n) {
		bx.t.Fatalf("ProducerPerformance sent %d records, want %d: %s", sent, n, last[0])
	}
	bx.t.Logf("ProducerPerformance %s: %s", topic, last[0])
	return ceilingTrial{Tool: "ProducerPerformance", Trial: trial, Records: sent, RecordsPerSecond: r, Output: last[0]}
}

// consumerPerf reads n records of topic on A with Kafka's
// ConsumerPerformance in a new group; the rate is its fetch.nMsg.sec (the
// group join left out, as the relays' steady rates leave out start-up).
func (bx *bench) consumerPerf(trial int, topic string, n int) ceilingTrial {
	out := bx.kafkaTool(fmt.Sprintf("consumer-perf-%d", trial), "org.apache.kafka.tools.ConsumerPerformance",
		"--bootstrap-server", bx.st.a.addr, "--topic", topic, "--messages", strconv.Itoa(n),
		"--group", fmt.Sprintf("perf-%d", trial), "--timeout", "60000")
	// A header line naming the columns, then the values.
	lines := strings.Split(strings.TrimSpace(out), "\n")
	for i := 0; i+1 < len(lines); i++ {
		if !strings.HasPrefix(lines[i], "start.time") {
			continue
		}
		cols := strings.Split(lines[i], ",")
		vals := strings.Split(lines[i+1], ",")
		got := map[string]string{}
		for j := range min(len(cols), len(vals)) {
			got[strings.TrimSpace(cols[j])] = strings.TrimSpace(vals[j])
		}
		msgs, err1 := strconv.ParseInt(got["data.consumed.in.nMsg"], 10, 64)
		rate, err2 := strconv.ParseFloat(got["fetch.nMsg.sec"], 64)
		if err1 != nil || err2 != nil || msgs != int64(n) {
			bx.t.Fatalf("ConsumerPerformance: want %d records, got %v (%v, %v)", n, got, err1, err2)
		}
		bx.t.Logf("ConsumerPerformance: %d records, %.0f records/s", msgs, rate)
		return ceilingTrial{Tool: "ConsumerPerformance", Trial: trial, Records: msgs, RecordsPerSecond: rate,
			Output: lines[i] + "\n" + lines[i+1]}
	}
	bx.t.Fatalf("ConsumerPerformance printed no result:\n%s", out)
	return ceilingTrial{}
}

// cost runs one agent and one baseline relay side by side, each copying
// the same topic to its own destination while ProducerPerformance writes
// to it at a fixed rate, and compares their CPU time and peak memory.
func (bx *bench) cost() {
	t, st := bx.t, bx.st
	for i := 1; i <= bx.scale.CostTrials; i++ {
		src := fmt.Sprintf("cost-%d", i)
		st.a.createTopic(t, src, relayPartitions)
		dests := map[string]string{"kswitch": src + "-kswitch", "relayloop": src + "-relayloop"}
		for _, d := range dests {
			st.b.createTopic(t, d, relayPartitions)
		}
		agent := bx.startRelayAgents(1, src, "g-"+dests["kswitch"], dests["kswitch"], nil)[0]
		loop := bx.startRelayloop("relayloop-cost", src, "g-"+dests["relayloop"], dests["relayloop"])
		pids := map[string]int{"kswitch": agent.cmd.Process.Pid, "relayloop": loop.cmd.Process.Pid}
		// Both ready: the agent owns every partition, the baseline's group
		// is stable with its member.
		waitFor(t, time.Minute, "the agent and the baseline consume every partition", func() error {
			if n := bx.st.tl.owners()[agent.id]; n != relayPartitions {
				return fmt.Errorf("the agent owns %d partitions", n)
			}
			return groupStable(st.a.addr, "g-"+dests["relayloop"], 1)
		})
		before := map[string]procUsage{}
		for k, pid := range pids {
			u, err := treeUsage(pid)
			if err != nil {
				fatal(t, err)
			}
			before[k] = u
		}
		n := bx.scale.CostRate * bx.scale.CostSeconds
		type filled struct {
			relay string
			f     fill
			err   error
		}
		fills := make(chan filled, len(dests))
		for k, d := range dests {
			go func() {
				f, err := watchFill(st.b.addr, d, int64(n), bx.costTimeout(), nil)
				fills <- filled{k, f, err}
			}()
		}
		began := time.Now()
		bx.producerPerf(i, src, n, bx.scale.CostRate)
		produced := time.Now()
		ct := costTrial{Trial: i, Rate: bx.scale.CostRate, Records: int64(n), Seconds: round3(produced.Sub(began).Seconds()),
			Lag: map[string]float64{}, CPUSeconds: map[string]float64{}, PeakRSSMiB: map[string]float64{}}
		for range dests {
			r := <-fills
			if r.err != nil {
				fatalf(t, "cost trial %d, %s: %v", i, r.relay, r.err)
			}
			ct.Lag[r.relay] = round3(max(0, r.f.done.Sub(produced).Seconds()))
		}
		for k, pid := range pids {
			u, err := treeUsage(pid)
			if err != nil {
				fatal(t, err)
			}
			ct.CPUSeconds[k] = round3(u.cpu - before[k].cpu)
			ct.PeakRSSMiB[k] = round1(float64(u.hwmKiB) / 1024)
		}
		bx.stopRelay("relayloop", []*proc{loop})
		bx.stopRelay("kswitch", []*proc{agent.proc})
		t.Logf("cost trial %d at %d records/s: cpu %v s, peak rss %v MiB, lag %v s", i, ct.Rate, ct.CPUSeconds, ct.PeakRSSMiB, ct.Lag)
		bx.res.Cost = append(bx.res.Cost, ct)
	}
}

// costTimeout bounds a cost trial's copy: the producer's run and a minute.
func (bx *bench) costTimeout() time.Duration {
	return time.Duration(bx.scale.CostSeconds)*time.Second + time.Minute
}

// groupStable returns nil when Kafka group on addr is Stable with members
// members.
func groupStable(addr, group string, members int) error {
	adm, err := sarama.NewClusterAdmin([]string{addr}, saramaConfig(3*time.Second))
	if err != nil {
		return err
	}
	defer adm.Close()
	ds, err := adm.DescribeConsumerGroups([]string{group})
	if err != nil {
		return err
	}
	if len(ds) != 1 || ds[0].State != "Stable" || len(ds[0].Members) != members {
		return fmt.Errorf("group %s: %+v", group, ds)
	}
	return nil
}

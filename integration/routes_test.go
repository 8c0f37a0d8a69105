//go:build integration

package integration

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The routing versions of TestRoutesOnRealKafka. Odd records go to the
// channel "delivered" under every version; an even record's copy says
// which version routed it: none (version 0, the configuration file), one
// in topic evens (version 1) or one in topic evens-v2 (version 2).
const (
	// routesV1 adds a rule: even records to delivered and to evens.
	routesV1 = `mode: all
rules:
  - name: evens
    match: 'value matches "[02468]$"'
    channels: [delivered, evens]
default: [delivered]
channels:
  evens: {cluster: B, topic: evens, partitioner: manual-same-partition}
`
	// routesV2 points the channel evens at another topic; the rules stay.
	routesV2 = `channels:
  evens: {cluster: B, topic: evens-v2, partitioner: manual-same-partition}
`
	// brokenMatch does not compile.
	brokenMatch = `mode: all
rules:
  - name: evens
    match: 'value matches'
    channels: [delivered, evens]
default: [delivered]
`
	// unknownChannel names a channel nobody defined.
	unknownChannel = `mode: all
rules:
  - name: evens
    match: 'value matches "[02468]$"'
    channels: [delivered, nowhere]
default: [delivered]
`
)

// evensTopics are the topics on B holding the even records' copies, by
// routing version (index 0: version 1).
var evensTopics = []string{"evens", "evens-v2"}

// routesChange is one `kswitch routes apply` during the stream, with the
// bounds it sets on which records the new version may route.
type routesChange struct {
	version int64 // the etcd revision apply wrote, kswitch_config_version
	// committed is the fleet's committed offsets on A just before apply:
	// those records were acknowledged, so routed, by an older version.
	committed map[int32]int64
	// handed is the number of the first record handed to kcat after every
	// agent reported the version in force: it and every later record can
	// only be routed by this version or a newer one.
	handed int
}

// routingView is the routing part of an agent's /status.
type routingView struct {
	Handler struct {
		Ready       bool      `json:"ready"`
		Version     int64     `json:"version"`
		Since       time.Time `json:"since"`
		Source      string    `json:"source"`
		Rules       []string  `json:"rules"`
		LastRefusal *struct {
			Version int64     `json:"version"`
			At      time.Time `json:"at"`
			Reason  string    `json:"reason"`
			Current bool      `json:"current"`
		} `json:"last_refusal"`
	} `json:"handler"`
}

func (a *agentProc) routing() (routingView, error) {
	var v routingView
	code, err := getJSON("http://"+a.http+"/status", &v)
	if err == nil && code != 200 {
		err = fmt.Errorf("%s /status: HTTP %d", a.id, code)
	}
	return v, err
}

// TestRoutesOnRealKafka changes the fleet's routing while it relays: a
// rule added with `kswitch routes apply` (even records also to a second
// channel), then that channel pointed at another topic; then bad rule sets:
// `kswitch routes apply` refuses a rule that does not compile and one that
// names an unknown channel, writing nothing, and the agents refuse a
// broken rule written straight with etcdctl, showing why in /status, and
// go on routing with the version in force. Read back with kcat: nothing
// lost, nothing duplicated (but after an owner's death, see
// timeline.handOvers), every even record routed by exactly one version,
// versions never going back along a partition, and each record on the
// right side of the changes wherever the suite's clock decides it (the
// records in flight at a change may go either way: they are counted).
func TestRoutesOnRealKafka(t *testing.T) {
	rep := newReport("routes-apply")
	rep.Covers = "routes changed with kswitch routes apply mid-stream; bad rule sets refused by the CLI and by the agents"
	defer func() {
		rep.Passed = !t.Failed()
		addReport(rep)
	}()
	timed := rep.timer(t)
	st := startStack(t, timed, prefixPolicy, false) // B hosts the channels
	for _, topic := range evensTopics {
		st.b.createTopic(t, topic, ordersPartitions)
	}
	conf := st.agentConfig()
	var agents []*agentProc
	for i := 1; i <= 3; i++ {
		agents = append(agents, startAgentWith(t, fmt.Sprintf("agent-%d", i), conf))
	}
	prod := startProducer(t, st.a.addr, "orders", produceRate)
	st.moving(t, "the fleet consumes every partition of A", time.Minute)
	routingInForce(t, agents, 0)

	// apply writes rules, under which the channel evens writes to topic,
	// and returns once every agent has it in force and an even record
	// routed by it is on topic: the next change must not come before
	// this version routed anything (a CI run applied version 2 before
	// version 1 had routed one even record).
	apply := func(step, rules, topic string) routesChange {
		t.Helper()
		path := filepath.Join(t.TempDir(), step+".yaml")
		if err := os.WriteFile(path, []byte(rules), 0o644); err != nil {
			fatal(t, err)
		}
		ch := routesChange{committed: offsetsOf(st.tl.offsets("A", "orders"))}
		began := time.Now()
		out := kswitchCLI(t, "routes", "apply", "-f", path, "--config", agents[0].conf)
		m := regexp.MustCompile(`version (\d+) written`).FindStringSubmatch(out)
		if m == nil {
			fatalf(t, "kswitch routes apply does not say which version it wrote:\n%s", out)
		}
		ch.version, _ = strconv.ParseInt(m[1], 10, 64)
		since := routingInForce(t, agents, ch.version)
		ch.handed = prod.notHandedYet()
		timed(step+"_in_force", since.Sub(began))
		timed(step+"_seen_in_metrics", time.Since(began))
		st.moving(t, "the fleet relays on routing version "+m[1], 30*time.Second)
		waitFor(t, 30*time.Second, "an even record routed by version "+m[1]+" is on "+topic, func() error {
			ends, err := endOffsets(st.b.addr, topic)
			if err != nil {
				return err
			}
			for _, end := range ends {
				if end > 0 {
					return nil
				}
			}
			return fmt.Errorf("%s on B is empty", topic)
		})
		return ch
	}
	v1 := apply("routes_v1", routesV1, evensTopics[0])
	v2 := apply("routes_v2", routesV2, evensTopics[1])
	changes := []routesChange{v1, v2}

	// Bad rule sets through the CLI: refused, nothing written.
	routesBefore, err := st.etcd.etcdctl("get", "--print-value-only", fleetPrefix+"routes")
	if err != nil {
		fatal(t, err)
	}
	for _, bad := range []struct{ name, what, rules, want string }{
		{"broken-match", "a match that does not compile", brokenMatch, "rules[0].match"},
		{"unknown-channel", "a rule naming an unknown channel", unknownChannel, `channel "nowhere" is not defined`},
	} {
		path := filepath.Join(t.TempDir(), bad.name+".yaml")
		if err := os.WriteFile(path, []byte(bad.rules), 0o644); err != nil {
			fatal(t, err)
		}
		out, err := runKswitch(t, "routes", "apply", "-f", path, "--config", agents[0].conf)
		if err == nil {
			errorf(t, "kswitch routes apply accepted %s:\n%s", bad.name, out)
		} else if !strings.Contains(out, bad.want) || !strings.Contains(out, "nothing written") {
			errorf(t, "kswitch routes apply refused %s (%v) without saying %q and that nothing was written:\n%s", bad.name, err, bad.want, out)
		}
		rep.Details = append(rep.Details, fmt.Sprintf("`kswitch routes apply` of %s refused (%v): %q", bad.what, exitStatus(err), lastLine(out)))
	}
	if now, err := st.etcd.etcdctl("get", "--print-value-only", fleetPrefix+"routes"); err != nil || now != routesBefore {
		errorf(t, "a refused apply changed %sroutes: %q, was %q (%v)", fleetPrefix, now, routesBefore, err)
	}

	// A broken rule written straight to etcd: every agent refuses it,
	// says why, and keeps version 2.
	out, err := st.etcd.etcdctl("put", "-w", "json", fleetPrefix+"routes", brokenMatch)
	if err != nil {
		fatal(t, err)
	}
	var put struct {
		Header struct {
			Revision int64 `json:"revision"`
		} `json:"header"`
	}
	if err := json.Unmarshal([]byte(out), &put); err != nil || put.Header.Revision == 0 {
		fatalf(t, "etcdctl put -w json: %q: %v", out, err)
	}
	broken := time.Now()
	var reasons []string
	waitFor(t, 10*time.Second, "every agent refuses the broken routes written with etcdctl", func() error {
		reasons = reasons[:0]
		for _, a := range agents {
			v, err := a.routing()
			if err != nil {
				return err
			}
			ref := v.Handler.LastRefusal
			if ref == nil || ref.Version != put.Header.Revision || !ref.Current {
				return fmt.Errorf("%s: last refusal %+v, want version %d, current", a.id, ref, put.Header.Revision)
			}
			if !strings.Contains(ref.Reason, "rules[0].match") {
				return fmt.Errorf("%s refused version %d without naming rules[0].match: %q", a.id, ref.Version, ref.Reason)
			}
			if v.Handler.Version != v2.version {
				return fmt.Errorf("%s: version %d in force, want %d", a.id, v.Handler.Version, v2.version)
			}
			refused, err := a.metric("kswitch_routing_versions_refused_total")
			if err != nil {
				return err
			}
			inForce, err := a.metric("kswitch_config_version")
			if err != nil {
				return err
			}
			if refused < 1 || int64(inForce) != v2.version {
				return fmt.Errorf("%s /metrics: %v versions refused, version %v in force", a.id, refused, inForce)
			}
			reasons = append(reasons, a.id+": "+strings.ReplaceAll(ref.Reason, "\n", "; "))
		}
		return nil
	})
	timed("routes_broken_refused", time.Since(broken))
	rep.Details = append(rep.Details, fmt.Sprintf("`etcdctl put` of routes that do not compile (revision %d): refused by every agent, version %d kept: %s",
		put.Header.Revision, v2.version, strings.Join(reasons, " | ")))
	show := kswitchCLI(t, "routes", "show", "--config", agents[0].conf)
	if !strings.Contains(show, "INVALID") || !strings.Contains(show, "rules[0].match") {
		errorf(t, "kswitch routes show does not say the routes in etcd are invalid and why:\n%s", show)
	}
	if status := kswitchCLI(t, "status", "--config", agents[0].conf); !strings.Contains(status, "rules[0].match") {
		t.Logf("NOTE (kswitch): `kswitch status` does not show the refused routes; `kswitch routes show` and each agent's /status do")
	}
	st.moving(t, "the fleet relays on version 2 with a refused version in etcd", 30*time.Second)

	// Verdict: nothing lost or duplicated in delivered, and every even
	// record routed by one version, in order.
	r := st.relayVerdict(t, prod)
	rep.verdict = r.verdict
	// Nothing fails in this test, but on an overloaded machine an agent's
	// etcd session can expire: its partitions' next owners deliver again
	// what it delivered after its last commit (verdict.DuplicatesHandOver).
	if !r.ok() {
		errorf(t, "lost %d %v; duplicates not explained by a death %v; deliveries the committed offsets do not explain: %v",
			r.LostCount, r.Lost, r.BadDuplicates, r.PositionMismatch)
	}
	var copies []map[int32][]kRecord
	for _, topic := range evensTopics {
		c, err := readTopic(st.b.addr, topic)
		if err != nil {
			fatal(t, err)
		}
		copies = append(copies, c)
	}
	vs := judgeVersions(r.source, r.delivered, copies, changes)
	rep.Details = append(rep.Details, vs.String())
	t.Logf("routing versions: %s", vs)
	if len(vs.problems) > 0 {
		errorf(t, "records not routed by exactly one version, in order:\n%s", strings.Join(vs.problems, "\n"))
	}
	for i, n := range vs.byVersion {
		if n == 0 {
			errorf(t, "no even record was routed by version %d: the scenario did not exercise it", i)
		}
	}
	timed("scenario", time.Since(st.began))
}

// routingInForce waits until every agent reports routing version in force,
// in /status and as kswitch_config_version in /metrics, and returns the
// latest time an agent put it in force (its /status since).
func routingInForce(t *testing.T, agents []*agentProc, version int64) time.Time {
	t.Helper()
	var last time.Time
	waitFor(t, 10*time.Second, fmt.Sprintf("every agent routes with version %d", version), func() error {
		last = time.Time{}
		for _, a := range agents {
			v, err := a.routing()
			if err != nil {
				return err
			}
			if !v.Handler.Ready || v.Handler.Version != version {
				return fmt.Errorf("%s: routing version %d (ready %v), last refusal %+v", a.id, v.Handler.Version, v.Handler.Ready, v.Handler.LastRefusal)
			}
			m, err := a.metric("kswitch_config_version")
			if err != nil {
				return err
			}
			if int64(m) != version {
				return fmt.Errorf("%s: kswitch_config_version %v", a.id, m)
			}
			last = maxTime(last, v.Handler.Since)
		}
		return nil
	})
	return last
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// exitStatus says how a command ended: "exit status 1", or err.
func exitStatus(err error) string {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ProcessState.String()
	}
	return fmt.Sprint(err)
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// versionVerdict is how the routing versions fell on the records.
type versionVerdict struct {
	// byVersion counts the even records each version routed.
	byVersion []int
	// inFlight counts, per change, the even records the suite's clock
	// could not place on either side (consumed between the last commit
	// seen before apply and every agent reporting the new version), and
	// of those, the ones the new version routed.
	inFlight, inFlightNew []int
	// redelivered counts the even records delivered more than once (after
	// a hand-over), each time by the version then in force: not judged.
	redelivered int
	problems    []string
}

func (v versionVerdict) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "even records by routing version %v (odd ones go to delivered under every version)", v.byVersion)
	for i := range v.inFlight {
		fmt.Fprintf(&b, "; change to version %d: %d even records in flight, %d of them routed by the new version",
			i+1, v.inFlight[i], v.inFlightNew[i])
	}
	if v.redelivered > 0 {
		fmt.Fprintf(&b, "; %d even records delivered twice after a hand-over, not judged", v.redelivered)
	}
	if len(v.problems) > 0 {
		fmt.Fprintf(&b, "; %d problems", len(v.problems))
	}
	return b.String()
}

// judgeVersions decides, for every record of source (orders on A, by
// partition in offset order), which routing version routed it from the
// copies (copies[i]: the topic version i+1 sends even records to) and
// checks that each even record was routed by one version, to the
// partition it came from, that the versions never go back along a
// partition, and that each change's bounds hold (routesChange). Even
// records delivered more than once (in delivered, the channel every
// version sends every record to) are counted, not judged.
func judgeVersions(source, delivered map[int32][]kRecord, copies []map[int32][]kRecord, changes []routesChange) versionVerdict {
	v := versionVerdict{byVersion: make([]int, len(copies)+1), inFlight: make([]int, len(changes)), inFlightNew: make([]int, len(changes))}
	type copyAt struct {
		version   int
		partition int32
	}
	deliveries := map[string]int{}
	for _, recs := range delivered {
		for _, r := range recs {
			deliveries[r.Value]++
		}
	}
	where := map[string][]copyAt{}
	for i, c := range copies {
		for p, recs := range c {
			for _, r := range recs {
				where[r.Value] = append(where[r.Value], copyAt{i + 1, p})
			}
		}
	}
	problem := func(format string, args ...any) {
		if len(v.problems) < 20 {
			v.problems = append(v.problems, fmt.Sprintf(format, args...))
		}
	}
	for p, recs := range source {
		last, lastAt := 0, int64(-1)
		for _, r := range recs {
			n, err := strconv.Atoi(strings.TrimPrefix(r.Value, "r"))
			if err != nil {
				problem("orders/%d@%d: value %q is not a record of the suite", p, r.Offset, r.Value)
				continue
			}
			cs := where[r.Value]
			if n%2 == 1 {
				if len(cs) > 0 {
					problem("odd record %s (orders/%d@%d) was copied by versions %v", r.Value, p, r.Offset, cs)
				}
				continue
			}
			if deliveries[r.Value] > 1 {
				v.redelivered++
				continue
			}
			version := 0
			switch {
			case len(cs) > 1:
				problem("%s (orders/%d@%d) was copied %d times: %v", r.Value, p, r.Offset, len(cs), cs)
				continue
			case len(cs) == 1:
				version = cs[0].version
				if cs[0].partition != p {
					problem("%s came from orders/%d, its copy is in partition %d (partitioner manual-same-partition)", r.Value, p, cs[0].partition)
				}
			}
			v.byVersion[version]++
			if version < last {
				problem("orders/%d: %s at offset %d routed by version %d after offset %d by version %d", p, r.Value, r.Offset, version, lastAt, last)
			}
			last, lastAt = version, r.Offset
			for i, ch := range changes {
				newer := i + 1 // the version ch put in force
				committed, handed := r.Offset < ch.committed[p], n >= ch.handed
				switch {
				case committed && version >= newer:
					problem("%s (orders/%d@%d) was committed before version %d (revision %d) was applied, yet routed by version %d", r.Value, p, r.Offset, newer, ch.version, version)
				case handed && version < newer:
					problem("%s (orders/%d@%d) was produced after every agent had version %d (revision %d) in force, yet routed by version %d", r.Value, p, r.Offset, newer, ch.version, version)
				case !committed && !handed:
					v.inFlight[i]++
					if version >= newer {
						v.inFlightNew[i]++
					}
				}
			}
		}
	}
	return v
}

// TestJudgeVersions checks the routing-version verdict on made-up reads.
func TestJudgeVersions(t *testing.T) {
	// Records 0..9 in partition 0; version 1 applied when offset 2 was
	// committed, in force everywhere before record 6 was produced.
	source := map[int32][]kRecord{0: recs(0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)}
	changes := []routesChange{{version: 10, committed: map[int32]int64{0: 2}, handed: 6}}
	copies := func(ns ...int) []map[int32][]kRecord { return []map[int32][]kRecord{{0: recs(0, 0, ns...)}} }
	for _, tc := range []struct {
		name     string
		copies   []map[int32][]kRecord
		problems int
		inFlight int
	}{
		{"the change between records 2 and 4", copies(4, 6, 8), 0, 2},
		{"the change between records 0 and 2", copies(2, 4, 6, 8), 0, 2},
		{"record 0, committed before the apply, copied", copies(0, 2, 4, 6, 8), 1, 2},
		{"record 6, produced once version 1 was everywhere, not copied", copies(8), 1, 2},
		{"version 1, then version 0 again", copies(2, 6, 8), 1, 2},
		{"an odd record copied", copies(4, 5, 6, 8), 1, 2},
		{"an even record copied twice", copies(4, 6, 6, 8), 1, 2},
	} {
		v := judgeVersions(source, source, tc.copies, changes)
		if len(v.problems) != tc.problems || v.inFlight[0] != tc.inFlight {
			errorf(t, "%s: %d problems %v, %d in flight; want %d problems, %d in flight", tc.name, len(v.problems), v.problems, v.inFlight[0], tc.problems, tc.inFlight)
		}
	}
}

//go:build integration && bench

package integration

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// profileSeconds is how long the memory trial's agent is profiled, from
// its first record at the destination (the trial relays for about 5 s).
const profileSeconds = 2

// agentProfile is where one agent's CPU went while it relayed at full
// speed: a CPU profile (agent.pprof) of the memory trial, summed by part
// of the record path.
type agentProfile struct {
	Seconds float64 `json:"seconds"`
	// SampledSeconds is the CPU time the profile sampled.
	SampledSeconds float64        `json:"sampled_seconds"`
	Shares         []profileShare `json:"shares"`
	// Top is `go tool pprof -top` of the profile, its first rows.
	Top []string `json:"top"`
}

// profileShare is the share of the samples with a frame of one part of
// the record path on their stack. Parts overlap where one calls another.
type profileShare struct {
	What    string  `json:"what"`
	Frames  string  `json:"frames"`
	Percent float64 `json:"percent"`
}

// profileParts are the parts of the record path a profile is summed by:
// a regular expression of frames (go tool pprof -focus) each.
var profileParts = []struct{ what, frames string }{
	{"fetch: reading responses off the socket (sarama's Broker)", `sarama\.\(\*Broker\)\.responseReceiver`},
	{"fetch: requests and decoding batches (internal/kafka Fetcher)", `kafka\.\(\*fetchBroker\)\.run`},
	{"agent: handing records on (partition loop, tracker, gate; includes routing)", `agent\.\(\*worker\)\.consume`},
	{"routing: rules, channels, produce messages (Router.Handle)", `routing\.\(\*Router\)\.Handle`},
	{"produce: building, encoding (sarama) and writing requests", `kafka\.\(\*sink\)\.send`},
	{"produce: answers, acknowledgements, commits' bookkeeping", `kafka\.\(\*sink\)\.handle`},
	{"Go: allocation (every caller)", `^runtime\.mallocgc$`},
	{"Go: garbage collector's background marking", `^runtime\.gcBgMarkWorker$`},
}

// profileAgent takes a CPU profile of the agent serving HTTP at addr and
// writes it to path.
func profileAgent(addr, path string) error {
	return download(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", addr, profileSeconds), path, time.Duration(profileSeconds+10)*time.Second)
}

// traceAgent takes a 1-second execution trace of the agent serving HTTP
// at addr (KSWITCH_BENCH_TRACE, for development: go tool trace
// -pprof=sync, net or sched shows where its goroutines wait).
func traceAgent(addr, path string) error {
	return download(fmt.Sprintf("http://%s/debug/pprof/trace?seconds=1", addr), path, 11*time.Second)
}

// download writes what a GET of url answers to path.
func download(url, path string, timeout time.Duration) error {
	c := &http.Client{Timeout: timeout}
	resp, err := c.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s answered %s", url, resp.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

var accounting = regexp.MustCompile(`accounting for ([0-9.]+)(m?s), ([0-9.]+)% of ([0-9.]+)(m?s) total`)

// summarizeProfile sums the profile at path of the binary bin by
// profileParts, with go tool pprof.
func summarizeProfile(bin, path string) (agentProfile, error) {
	pprof := func(args ...string) (string, error) {
		out, err := exec.Command("go", append(append([]string{"tool", "pprof"}, args...), bin, path)...).Output()
		if err != nil {
			return "", fmt.Errorf("go tool pprof %s: %w", strings.Join(args, " "), err)
		}
		return string(out), nil
	}
	seconds := func(v, unit string) float64 {
		x, _ := strconv.ParseFloat(v, 64)
		if unit == "ms" {
			x /= 1000
		}
		return x
	}
	p := agentProfile{Seconds: profileSeconds}
	top, err := pprof("-top", "-nodecount=15")
	if err != nil {
		return p, err
	}
	for _, l := range strings.Split(strings.TrimSpace(top), "\n") {
		if m := accounting.FindStringSubmatch(l); m != nil {
			p.SampledSeconds = seconds(m[4], m[5])
		}
		if strings.HasPrefix(l, " ") { // the table's rows and its header
			p.Top = append(p.Top, l)
		}
	}
	for _, part := range profileParts {
		out, err := pprof("-top", "-nodecount=100000", "-nodefraction=0", "-edgefraction=0", "-focus="+part.frames)
		if err != nil {
			return p, err
		}
		share := profileShare{What: part.what, Frames: part.frames}
		if m := accounting.FindStringSubmatch(out); m != nil {
			share.Percent, _ = strconv.ParseFloat(m[3], 64)
		}
		p.Shares = append(p.Shares, share)
	}
	return p, nil
}

// profileFile is the name of the memory trial's profile next to the page
// (benchResults.write copies it there), for go tool pprof -http.
const profileFile = "agent-cpu.pprof"

// copyProfile copies the profile at from into dir.
func copyProfile(from, dir string) error {
	b, err := os.ReadFile(from)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, profileFile), b, 0o644)
}

// summarizeProfile sums the profile the memory trial took (err: how
// taking it failed) into the results. A profile that could not be taken
// or read is logged, and the page goes without it.
func (bx *bench) summarizeProfile(err error) {
	if err != nil {
		bx.t.Logf("no profile of the agent: %v", err)
		return
	}
	bin, _ := binaries(bx.t)
	p, err := summarizeProfile(bin, bx.profilePath)
	if err != nil {
		bx.t.Logf("no summary of the agent's profile: %v", err)
		return
	}
	bx.res.Profile, bx.res.profileFile = &p, bx.profilePath
	for _, sh := range p.Shares {
		bx.t.Logf("profile: %5.1f %%  %s", sh.Percent, sh.What)
	}
}

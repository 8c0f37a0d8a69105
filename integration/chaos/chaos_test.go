//go:build chaos

package chaos

import (
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// TestChaos is make chaos: CHAOS_SEED (default: drawn and printed),
// CHAOS_DURATION (default 10m), CHAOS_FAULTS (kinds or prefixes,
// comma-separated; default all), CHAOS_MODE (at_least_once or
// exactly_once), CHAOS_RATE (records/s, default 100), CHAOS_BIN and
// CHAOS_STACK (the binaries), CHAOS_LOG_DIR (default a temporary
// directory, kept when the run fails or CHAOS_KEEP_LOGS=1).
func TestChaos(t *testing.T) {
	cfg := Config{Duration: 10 * time.Minute, Mode: AtLeastOnce, Rate: 100, Out: os.Stdout,
		Bin: os.Getenv("CHAOS_BIN"), StackBin: os.Getenv("CHAOS_STACK")}
	if cfg.Bin == "" || cfg.StackBin == "" {
		t.Skip("CHAOS_BIN and CHAOS_STACK are not set: run make chaos")
	}
	if s := os.Getenv("CHAOS_SEED"); s != "" {
		seed, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("CHAOS_SEED=%q: %v", s, err)
		}
		cfg.Seed = seed
	} else {
		cfg.Seed = rand.Uint64() % 1_000_000
	}
	if s := os.Getenv("CHAOS_DURATION"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d < time.Minute {
			t.Fatalf("CHAOS_DURATION=%q: a Go duration of at least 1m", s)
		}
		cfg.Duration = d
	}
	kinds, err := ParseKinds(os.Getenv("CHAOS_FAULTS"))
	if err != nil {
		t.Fatal(err)
	}
	cfg.Kinds = kinds
	if s := os.Getenv("CHAOS_MODE"); s != "" {
		cfg.Mode = Mode(s)
		if cfg.Mode != AtLeastOnce && cfg.Mode != ExactlyOnce {
			t.Fatalf("CHAOS_MODE=%q: at_least_once or exactly_once", s)
		}
	}
	if s := os.Getenv("CHAOS_RATE"); s != "" {
		if cfg.Rate, err = strconv.Atoi(s); err != nil || cfg.Rate <= 0 {
			t.Fatalf("CHAOS_RATE=%q: a positive number", s)
		}
	}
	// The run's logs and data: under CHAOS_LOG_DIR when set, else a
	// temporary directory; removed when the run passes, unless
	// CHAOS_KEEP_LOGS=1.
	if base := os.Getenv("CHAOS_LOG_DIR"); base != "" {
		cfg.Dir = filepath.Join(base, strconv.FormatUint(cfg.Seed, 10)+"-"+time.Now().Format("20060102-150405"))
		err = os.MkdirAll(cfg.Dir, 0o755)
	} else {
		cfg.Dir, err = os.MkdirTemp("", "kswitch-chaos-")
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("seed %d: replay with make chaos CHAOS_SEED=%d CHAOS_DURATION=%v CHAOS_FAULTS=%s CHAOS_MODE=%s",
		cfg.Seed, cfg.Seed, cfg.Duration, os.Getenv("CHAOS_FAULTS"), cfg.Mode)
	res, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatalf("seed %d: the run could not be made: %v (logs in %s)", cfg.Seed, err, cfg.Dir)
	}
	if res.Failed() {
		t.Fatalf("seed %d: %d invariants broken (logs in %s)", cfg.Seed, len(res.Violations), cfg.Dir)
	}
	if os.Getenv("CHAOS_KEEP_LOGS") != "1" {
		os.RemoveAll(cfg.Dir)
	}
}

// TestTimelineReplays: the same plan draws the same timeline.
func TestTimelineReplays(t *testing.T) {
	p := Plan{Seed: 7, Duration: 10 * time.Minute, Warmup: warmup, Quiet: quiet, MeanGap: meanGap}
	a, b := p.Timeline(), p.Timeline()
	if len(a) == 0 || len(a) != len(b) {
		t.Fatalf("%d and %d faults", len(a), len(b))
	}
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("fault %d: %v and %v", i, a[i], b[i])
		}
		if a[i].Heal > p.Duration-p.Quiet || a[i].At < p.Warmup {
			t.Fatalf("fault %v outside [%v, %v]", a[i], p.Warmup, p.Duration-p.Quiet)
		}
	}
}

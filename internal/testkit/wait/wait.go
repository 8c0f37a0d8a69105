// Package wait lets tests wait on a condition with a deadline instead of
// sleeping and hoping.
package wait

import (
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// For polls cond until it returns nil, and fails the test with cond's last
// error when timeout passes first. The poll interval starts at 10 ms and
// grows to 200 ms, so a quick condition is seen quickly and a slow one does
// not spin.
func For(t testing.TB, timeout time.Duration, what string, cond func() error) {
	t.Helper()
	if err := Until(timeout, cond); err != nil {
		t.Fatalf("%s: not true after %v: %v", what, timeout, err)
	}
}

// Until polls cond until it returns nil or timeout passes, and returns
// cond's last error in the latter case. For use outside a test's goroutine.
func Until(timeout time.Duration, cond func() error) error {
	deadline := time.Now().Add(timeout)
	tick := 10 * time.Millisecond
	for {
		err := cond()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(tick)
		tick = min(2*tick, 200*time.Millisecond)
	}
}

// LeakGrace is how long VerifyTestMain waits for goroutines to end after
// the tests. Some libraries stop goroutines asynchronously: memberlist's
// Shutdown returns while a probe it started may still wait out its probe
// timeout and TCP fallback (up to its 1 s probe interval).
const LeakGrace = 5 * time.Second

// VerifyTestMain runs the tests, then fails the run if goroutines other
// than those opts ignore are still running after LeakGrace. Use it in
// TestMain instead of goleak.VerifyTestMain, whose own retries last about
// one second.
func VerifyTestMain(m *testing.M, opts ...goleak.Option) {
	code := m.Run()
	if code == 0 {
		if err := Until(LeakGrace, func() error { return goleak.Find(opts...) }); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: goroutines still running %v after the tests: %v\n", LeakGrace, err)
			code = 1
		}
	}
	os.Exit(code)
}

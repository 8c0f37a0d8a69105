package devstack_test

import (
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kswitch/kswitch/internal/testkit/testenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testenv.LeakOptions()...)
}

// waitFor polls cond until it returns nil or timeout passes, and fails the
// test with cond's last error then.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	tick := 50 * time.Millisecond
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not done after %v: %v", what, timeout, err)
		}
		time.Sleep(tick)
		tick = min(2*tick, 500*time.Millisecond)
	}
}

// within runs fn and fails the test if it takes longer than d. For steps whose
// latency is the contract under test (a fault must be noticed quickly).
func within(t *testing.T, d time.Duration, what string, fn func() error) error {
	t.Helper()
	start := time.Now()
	err := fn()
	took := time.Since(start)
	if took > d {
		t.Fatalf("%s took %v, want <= %v (err: %v)", what, took, d, err)
	}
	t.Logf("%s took %v: %v", what, took.Round(time.Millisecond), err)
	return err
}

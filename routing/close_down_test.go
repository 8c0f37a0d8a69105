package routing

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// goroutinesOf returns the stacks of the goroutines running code of any
// of the packages named.
func goroutinesOf(pkgs ...string) []string {
	buf := make([]byte, 16<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		for _, p := range pkgs {
			if strings.Contains(g, p) {
				out = append(out, g)
				break
			}
		}
	}
	return out
}

// TestCloseWhileTheChannelIsDown: a router closed while its channel's
// cluster refuses connections, with records queued in the producer, stops
// the producer's goroutines when Close returns. The producer looks for the
// partition's leader again in place until its client is closed; then each
// message still queued for the partition is failed back. Before, each of
// them was also followed by a backoff (100 ms, up to 1 s for retried
// messages): the producer's goroutines ran for 41 s after Close returned,
// failing about 1 000 queued messages one by one.
func TestCloseWhileTheChannelIsDown(t *testing.T) {
	w, r, f := orderedWorld(t, nil, nil)
	w.kafkas["C"].Fail()
	waitFailing(t, r, "c")
	time.Sleep(2 * time.Second) // records wait in the producer
	f.stop()
	w.unackedOnClose = true
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	start := time.Now()
	err := r.Close(ctx)
	t.Logf("Close took %v: %v", time.Since(start).Round(time.Millisecond), err)
	closed := time.Now()
	wait.For(t, 30*time.Second, "the producer's goroutines gone", func() error {
		if gs := goroutinesOf("IBM/sarama"); len(gs) > 0 {
			return errors.New(gs[0])
		}
		return nil
	})
	if d := time.Since(closed); d > 2*time.Second {
		t.Errorf("the producer's goroutines ran for %v after Close returned", d.Round(time.Millisecond))
	}
	w.kafkas["C"].Recover()
	// sarama's circuit breakers (go-resiliency) each sleep 10 s once they
	// open: let them end, for the package's leak check.
	wait.For(t, 15*time.Second, "circuit breaker timers ended", func() error {
		if gs := goroutinesOf("resiliency/breaker"); len(gs) > 0 {
			return errors.New(gs[0])
		}
		return nil
	})
}

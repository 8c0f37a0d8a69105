package agent

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// commitHold stops a worker's partitions from handing records on while
// its commits do not succeed: records handed on and not committed are
// delivered again by the partition's next owner, so while etcd is lost (or
// refuses the commits) every record delivered widens the re-delivery.
// Without it an agent that loses etcd delivers until its session ends,
// up to about three session TTLs; with it, until `bound` after the first
// commit attempt that did not succeed.
//
// The worker marks each commit attempt that has something to commit and
// each success; a watchdog goroutine (the worker's) holds delivery once an
// attempt has gone unanswered or failed for longer than bound, and the
// next success releases it. Partition loops wait at the hold before each
// burst of records, as at their pause gate.
type commitHold struct {
	bound time.Duration
	off   bool // hooks.NoCommitHold: never hold (a baseline)

	held atomic.Bool
	mu   sync.Mutex
	// since is the start of the first commit attempt not followed by a
	// success; zero when every attempt succeeded.
	since   time.Time
	heldAt  time.Time
	release chan struct{} // closed while not held
}

func newCommitHold(bound time.Duration, off bool) *commitHold {
	h := &commitHold{bound: bound, off: off, release: make(chan struct{})}
	close(h.release)
	return h
}

// holdBound is how long a commit attempt may go without success before
// delivery is held: a quarter of the commit interval, at least 50 ms (a
// healthy commit takes milliseconds; one slower than that holds delivery
// a moment, and loses nothing). Records delivered twice after etcd is lost
// are then those handled between the last successful commit and the hold:
// about 1.25 commit intervals, instead of until the session ends (about
// the session TTL).
func holdBound(commitInterval time.Duration) time.Duration {
	return max(commitInterval/4, 50*time.Millisecond)
}

// attempt notes a commit attempt starting at now.
func (h *commitHold) attempt(now time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.since.IsZero() {
		h.since = now
	}
}

// succeeded notes that every position is committed (or none is pending),
// and releases a hold. It reports how long delivery was held, 0 if not.
func (h *commitHold) succeeded(now time.Time) time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.since = time.Time{}
	if !h.held.Load() {
		return 0
	}
	h.held.Store(false)
	close(h.release)
	return now.Sub(h.heldAt)
}

// check holds delivery when an attempt has gone without success for
// longer than the bound; it reports whether it started a hold, and since
// when commits have failed.
func (h *commitHold) check(now time.Time) (bool, time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.off || h.held.Load() || h.since.IsZero() || now.Sub(h.since) <= h.bound {
		return false, h.since
	}
	h.held.Store(true)
	h.heldAt = now
	h.release = make(chan struct{})
	return true, h.since
}

// failingSince returns since when commits have not succeeded while
// delivery is held; zero when it is not.
func (h *commitHold) failingSince() time.Time {
	if !h.held.Load() {
		return time.Time{}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.since
}

// wait returns at once unless delivery is held; then when it is released
// or ctx ends (ctx.Err()).
func (h *commitHold) wait(ctx context.Context) error {
	if !h.held.Load() {
		return nil
	}
	h.mu.Lock()
	ch := h.release
	h.mu.Unlock()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

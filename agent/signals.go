package agent

import (
	"context"
	"time"

	"go.uber.org/zap"
)

// applySignals pauses and resumes the running partitions to match the
// signals in force, and measures how long after the watcher saw a pause
// every affected partition had stopped delivering.
func (w *worker) applySignals(ctx context.Context) {
	state := w.signals.State()
	seen := time.Time{}
	for _, s := range state.Signals() {
		if s.Seen.After(seen) {
			seen = s.Seen
		}
	}
	var parked []<-chan struct{}
	for tp, r := range w.parts {
		paused, scope := state.Paused(r.logical, w.id)
		if paused == r.gate.isPaused() {
			continue
		}
		parked = append(parked, r.gate.set(paused))
		if paused {
			r.fp.Pause()
			w.log.Info("partition paused", zap.Stringer("partition", tp), zap.Stringer("scope", scope))
		} else {
			r.fp.Resume()
			w.log.Info("partition resumed", zap.Stringer("partition", tp))
		}
	}
	w.metrics.setPaused(state)
	rev := state.Revision()
	if len(parked) == 0 || seen.IsZero() {
		w.signalsApplied.Store(rev)
		return
	}
	// The partitions park when their loops next reach the gate: at once,
	// or after the record being handed to the handler. Measure it without
	// holding up the worker.
	w.bg.Add(1)
	go func() {
		defer w.bg.Done()
		for _, ch := range parked {
			select {
			case <-ch:
			case <-ctx.Done():
				return
			}
		}
		w.metrics.signalApply.Observe(time.Since(seen).Seconds())
		// Later revisions may have been applied meanwhile: never go back.
		for {
			cur := w.signalsApplied.Load()
			if cur >= rev || w.signalsApplied.CompareAndSwap(cur, rev) {
				break
			}
		}
	}()
}

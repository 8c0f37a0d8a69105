package agent

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// rateMeter measures a count per second: the records handed to the
// handler, sampled every second, over the last rateWindow.
type rateMeter struct {
	n       atomic.Int64
	mu      sync.Mutex
	samples []rateSample // oldest first, at most rateWindow seconds
}

type rateSample struct {
	at time.Time
	n  int64
}

const rateWindow = 10 * time.Second

// run samples the count every second until ctx ends.
func (m *rateMeter) run(ctx context.Context) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	m.sample(time.Now())
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tick.C:
			m.sample(now)
		}
	}
}

func (m *rateMeter) sample(now time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.samples = append(m.samples, rateSample{at: now, n: m.n.Load()})
	for len(m.samples) > 2 && now.Sub(m.samples[0].at) > rateWindow {
		m.samples = m.samples[1:]
	}
}

// perSecond returns the count per second over the window sampled so far
// (0 before two samples).
func (m *rateMeter) perSecond() float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.samples) < 2 {
		return 0
	}
	first, last := m.samples[0], m.samples[len(m.samples)-1]
	if d := last.at.Sub(first.at).Seconds(); d > 0 {
		return float64(last.n-first.n) / d
	}
	return 0
}

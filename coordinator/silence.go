package coordinator

import (
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"
)

// silentAfter is how long a registered agent may owe an acknowledgement
// before it is planned without: past the longest an agent takes to apply
// a generation (a release drains for up to 5 s, waits up to 15 s for its
// exactly_once producers, then commits), and past a few session TTLs, so
// that an agent that hangs loses its lease before it is called silent.
func silentAfter(sessionTTL time.Duration) time.Duration {
	return max(3*sessionTTL, 30*time.Second)
}

// silence keeps the leader from planning on registered agents that never
// acknowledge: a registration is proof of a lease, not of an agent (a
// stranger can put one on any live lease). An agent applies the current
// assignment when it starts and every later one (the newest, when several
// came while it applied), and acknowledges each: it owes an
// acknowledgement from the first turn that sees the current generation
// above its last one, whether or not that generation gives it anything.
// One that still owes it after silentAfter is silent: left out of the
// live agents the leader plans on and counts for a failover quorum, and
// named in the leader's status, until it acknowledges the generation it
// owed (an agent acknowledges every generation it applies, so a real one
// that was slow comes back with its next). Safe for concurrent use.
type silence struct {
	after  time.Duration
	log    *zap.Logger
	mu     sync.Mutex
	owing  map[string]debt
	silent map[string]string // id → why
}

// debt is a generation an agent has not acknowledged since when.
type debt struct {
	gen   int64
	since time.Time
}

func newSilence(after time.Duration, log *zap.Logger) *silence {
	return &silence{after: after, log: log, owing: map[string]debt{}, silent: map[string]string{}}
}

// live returns the registered agents that are not silent, given the
// current assignment and what each acknowledged, at now.
func (s *silence) live(now time.Time, registered []string, cur Assignment, acks map[string]int64) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	for id := range s.owing {
		if !slices.Contains(registered, id) {
			delete(s.owing, id)
			delete(s.silent, id)
		}
	}
	out := make([]string, 0, len(registered))
	for _, id := range registered {
		d, owes := s.owing[id]
		if owes && acks[id] >= d.gen {
			if _, was := s.silent[id]; was {
				s.log.Info("agent acknowledges again; planning on it", zap.String("silent_agent", id), zap.Int64("generation", acks[id]))
			}
			delete(s.owing, id)
			delete(s.silent, id)
			owes = false
		}
		if !owes && acks[id] < cur.Generation {
			d, owes = debt{gen: cur.Generation, since: now}, true
			s.owing[id] = d
		}
		if owes && now.Sub(d.since) >= s.after {
			if _, was := s.silent[id]; !was {
				why := fmt.Sprintf("registered, but has not acknowledged generation %d for %s (acknowledged %d): planned without until it does",
					d.gen, now.Sub(d.since).Round(time.Second), acks[id])
				s.silent[id] = why
				s.log.Warn("agent is silent: its partitions go to the others", zap.String("silent_agent", id), zap.String("why", why))
			}
			continue
		}
		out = append(out, id)
	}
	return out
}

// reasons returns the silent agents with why, nil when none.
func (s *silence) reasons() map[string]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.silent) == 0 {
		return nil
	}
	return maps.Clone(s.silent)
}

package coordinator

import (
	"fmt"
	"maps"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/state"
)

// silentAfter is how long a registered agent may owe an acknowledgement
// before it is planned without: past the longest an agent takes to apply
// a generation (a release drains for up to 5 s, waits up to 15 s for its
// exactly_once producers, then commits), and past a few session TTLs, so
// that an agent that hangs loses its lease before it is called silent.
func silentAfter(sessionTTL time.Duration) time.Duration {
	return max(3*sessionTTL, 30*time.Second)
}

// silence keeps the leader from planning on registered agents that are
// not agents: a registration is proof of a lease, not of an agent (a
// stranger can put one on any live lease). Membership is earned:
//
//   - a registered agent is planned on once it has shown it is the process
//     its registration names (Proof: its HTTP endpoint at the registered
//     address names it on the registration's lease, or it speaks the
//     fleet's keyed gossip) and has acknowledged a generation on its
//     lease (an agent applies the current assignment when it starts and
//     acknowledges it, whether or not it gives it anything). The fleet's
//     first plan (no member yet, and the assignment places nobody) is
//     made on every registration not refuted, as the agents of a fleet
//     starting together are not all asked yet: planned one by one, they
//     would each move partitions again; a stranger's registration among
//     them is silent after silentAfter like any member that never
//     acknowledges. Membership lasts while the registration does. An
//     agent the current assignment places (planned on by this or an
//     earlier leader) is a member, even before it acknowledged the
//     generation that placed it, so that neither a new leader nor the
//     next turn moves partitions away from agents it has not asked yet
//     (the debt below covers one that never acknowledges);
//   - one whose endpoint answers as someone else is left out at once;
//   - an agent owes an acknowledgement from the first turn that sees the
//     current generation above its last one. One that still owes it after
//     silentAfter, or has not earned membership by then, is silent: left
//     out of the live agents the leader plans on and counts for a failover
//     quorum, and named in the leader's status, until it acknowledges the
//     generation it owed (an agent acknowledges every generation it
//     applies, so a real one that was slow comes back with its next).
//
// Safe for concurrent use.
type silence struct {
	after   time.Duration
	log     *zap.Logger
	mu      sync.Mutex
	owing   map[string]debt
	joining map[string]time.Time // registered, not yet a member: since when
	members map[string]bool      // earned membership while registered
	silent  map[string]string    // id → why
}

// debt is a generation an agent has not acknowledged since when.
type debt struct {
	gen   int64
	since time.Time
}

func newSilence(after time.Duration, log *zap.Logger) *silence {
	return &silence{after: after, log: log, owing: map[string]debt{}, joining: map[string]time.Time{}, members: map[string]bool{}, silent: map[string]string{}}
}

// Proof is what the leader knows of whether a registered agent is the
// process its registration names (Membership.Vouched).
type Proof int

const (
	// ProofUnknown: not checked yet, or its endpoint did not answer.
	ProofUnknown Proof = iota
	// ProofShown: its HTTP endpoint at the registered address names it
	// on its registration's lease, or it speaks the fleet's keyed gossip.
	ProofShown
	// ProofRefuted: its endpoint answers as another agent or lease.
	ProofRefuted
)

// live returns the registered agents that are members and not silent,
// given the current assignment, what each acknowledged, and each one's
// proof, at now.
func (s *silence) live(now time.Time, registered []string, cur state.Assignment, acks map[string]int64, proof func(id string) (Proof, string)) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	// An agent that left is forgotten, and counted afresh if it
	// registers again.
	reg := make(map[string]bool, len(registered))
	for _, id := range registered {
		reg[id] = true
	}
	maps.DeleteFunc(s.owing, func(id string, _ debt) bool { return !reg[id] })
	maps.DeleteFunc(s.joining, func(id string, _ time.Time) bool { return !reg[id] })
	maps.DeleteFunc(s.members, func(id string, _ bool) bool { return !reg[id] })
	maps.DeleteFunc(s.silent, func(id string, _ string) bool { return !reg[id] })
	// The fleet's first plan: nobody is a member or placed yet.
	first := len(s.members) == 0 && !placesAnyone(cur)
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
			s.quiet(id, fmt.Sprintf("registered, but has not acknowledged generation %d for %s (acknowledged %d): planned without until it does",
				d.gen, now.Sub(d.since).Round(time.Second), acks[id]))
			continue
		}
		p, why := proof(id)
		acked := acks[id] > 0 || cur.Generation == 0
		switch {
		case p == ProofRefuted:
			delete(s.members, id)
			s.quiet(id, "registered, but "+why+": planned without")
			continue
		case s.members[id], len(cur.OwnedBy(id)) > 0, cur.Revokes(id), acked && p == ProofShown, first:
			s.members[id] = true
			delete(s.joining, id)
			if _, was := s.silent[id]; was {
				s.log.Info("agent is a member again; planning on it", zap.String("silent_agent", id))
				delete(s.silent, id)
			}
			out = append(out, id)
			continue
		}
		since, ok := s.joining[id]
		if !ok {
			since, s.joining[id] = now, now
		}
		if now.Sub(since) >= s.after {
			if !acked {
				why = "has acknowledged no generation on its registration's lease"
			}
			s.quiet(id, fmt.Sprintf("registered for %s, but not a member: %s", now.Sub(since).Round(time.Second), why))
		}
	}
	return out
}

// placesAnyone reports whether a gives any agent a partition to consume
// or to release.
func placesAnyone(a state.Assignment) bool {
	for _, c := range a.Sections() {
		if sec := a.Section(c); len(sec.Owned) > 0 || len(sec.Revoking) > 0 {
			return true
		}
	}
	return false
}

// quiet names id silent with why (the first one, until it is a member
// again), logging it. Called with mu held.
func (s *silence) quiet(id, why string) {
	if _, was := s.silent[id]; !was {
		s.log.Warn("agent is silent: its partitions go to the others", zap.String("silent_agent", id), zap.String("why", why))
		s.silent[id] = why
	}
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

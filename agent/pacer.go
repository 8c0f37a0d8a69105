package agent

import (
	"math"
	"slices"
	"time"
)

// commitPacer keeps an agent's periodic commits within its share of the
// fleet's etcd budget (source.commit_budget_kib): a token bucket of bytes,
// refilled at the share's rate and holding at most one commit interval of
// it. Every tick the worker commits its changed positions, longest
// uncommitted first, while the bucket has bytes; the rest wait for a later
// tick. A partition's commits then come about every
// changed partitions × bytes a position ÷ share, and the fleet writes at
// most the budget whatever its partition count.
//
// Final commits (released partitions, a clean stop) are not paced: they
// are what the next owner starts from. They are charged all the same, so
// the average stays within the share. Owned by the worker's goroutine.
type commitPacer struct {
	// rate is this agent's share in bytes per second; 0: unbounded.
	rate     float64
	interval time.Duration
	tokens   float64
	at       time.Time // of the last refill
}

// share sets the agent's rate to fleet bytes per second × mine ÷ total
// owned partitions (all of the fleet's when total is 0: the agent is
// alone or nothing is assigned yet). fleet 0 means no bound.
func (p *commitPacer) share(fleet float64, mine, total int) {
	switch {
	case fleet <= 0:
		p.rate = 0
	case total <= 0 || mine >= total:
		p.rate = fleet
	default:
		// An agent that owns nothing keeps a sliver, for the commits
		// of partitions it still releases.
		p.rate = fleet * float64(max(mine, 1)) / float64(total)
	}
}

// bucket is the most the pacer lets through at once: one interval of the
// share.
func (p *commitPacer) bucket() float64 { return p.rate * p.interval.Seconds() }

// refill adds the bytes earned since the last refill and returns what is
// available now; +Inf when unbounded.
func (p *commitPacer) refill(now time.Time) float64 {
	if p.rate <= 0 {
		return math.Inf(1)
	}
	if p.at.IsZero() {
		p.tokens = p.bucket()
	} else if d := now.Sub(p.at); d > 0 {
		p.tokens = min(p.bucket(), p.tokens+d.Seconds()*p.rate)
	}
	p.at = now
	return p.tokens
}

// charge takes bytes written from the bucket, which may go below zero
// (a final commit, or an estimate that fell short): later ticks repay it.
func (p *commitPacer) charge(bytes int64) {
	if p.rate > 0 {
		p.tokens -= float64(bytes)
	}
}

// dueCommit is a partition whose position changed since its last commit.
type dueCommit struct {
	part cpart
	last time.Time // of its last commit (zero: never)
}

// pick returns the partitions to commit within avail bytes at about each
// bytes a position, the longest uncommitted first (never committed before
// all; ties in partition order), as many as avail pays for rounded up (at
// least one when avail is positive), and how many wait for a later tick.
func pick(due []dueCommit, avail, each float64) (now []cpart, waiting int) {
	slices.SortFunc(due, func(a, b dueCommit) int {
		if c := a.last.Compare(b.last); c != 0 {
			return c
		}
		return a.part.Compare(b.part)
	})
	n := len(due)
	if !math.IsInf(avail, 1) {
		n = 0
		if avail > 0 {
			// Rounded up: the overdraft is repaid by the next
			// tick, so the share is used exactly on average.
			n = min(len(due), int(math.Ceil(avail/max(each, 1))))
		}
	}
	for _, d := range due[:n] {
		now = append(now, d.part)
	}
	return now, len(due) - n
}

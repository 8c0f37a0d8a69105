//go:build chaos

package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/signals"
	"github.com/kswitch/kswitch/state"
)

// history is etcd's history of the fleet's keys, followed by a watch from
// revision 1: every run's etcd is new, and the stack's etcd does not
// compact (devstack.StartEtcd), so the watch sees every revision, across
// etcd's restarts too (the client resumes it after the last revision it
// delivered). Should etcd compact revisions the watch has not delivered,
// the loss is recorded (lost) and reported as a violation: the checks
// built on the history cannot pass on part of it.
//
// It keeps what the checks need, in revision order: every value of
// state/assignment, every committed position (offsets/: partition, agent,
// generation, offset), every acknowledgement (acks/), every signal
// (signals/) and when each agent last registered (agents/), each with the
// time the watch delivered it (etcd's events carry no time; a delivery
// comes within milliseconds of the write unless the driver is starved).
// It owns one goroutine, ended by stop.
type history struct {
	k      keys.Fleet
	cancel context.CancelFunc
	done   chan struct{}

	mu          sync.Mutex
	rev         int64 // the last revision delivered
	assignments []assignmentAt
	commits     []commitAt
	acks        []ackAt
	registered  map[string]time.Time // agent id → when its registration was last created (a new session)
	pauses      map[string]time.Time // signal key → since when it pauses (in force now)
	lastPause   time.Time            // when the last pause ended
	malformed   []string             // values the checker could not read
	lost        []string             // revisions compacted before the watch delivered them
}

// assignmentAt is one value of state/assignment.
type assignmentAt struct {
	rev  int64
	seen time.Time
	a    state.Assignment
}

// commitAt is one committed position, as offsets.Store wrote it.
type commitAt struct {
	rev        int64
	seen       time.Time
	part       clusterPart
	agent      string // "leader:<id>" for the leader's writes during a switch
	generation int64
	offset     int64
}

// ackAt is one acknowledgement of a generation by an agent.
type ackAt struct {
	rev        int64
	seen       time.Time
	agent      string
	generation int64
}

// clusterPart is a partition of a source topic on one cluster: A's orders
// and B's A.orders are different streams (and offsets).
type clusterPart struct {
	cluster, topic string
	partition      int32
}

func (c clusterPart) String() string { return fmt.Sprintf("%s:%s/%d", c.cluster, c.topic, c.partition) }

func startHistory(cli *clientv3.Client, k keys.Fleet) *history {
	ctx, cancel := context.WithCancel(context.Background())
	h := &history{k: k, cancel: cancel, done: make(chan struct{}), pauses: map[string]time.Time{}, registered: map[string]time.Time{}}
	go func() {
		defer close(h.done)
		h.follow(ctx, cli)
	}()
	return h
}

func (h *history) stop() {
	h.cancel()
	<-h.done
}

// follow watches the fleet's prefix from the revision after the last one
// delivered, again after the watch breaks, until ctx ends.
func (h *history) follow(ctx context.Context, cli *clientv3.Client) {
	for ctx.Err() == nil {
		h.mu.Lock()
		from := h.rev + 1
		h.mu.Unlock()
		wctx, cancel := context.WithCancel(ctx)
		for wr := range cli.Watch(wctx, h.k.Prefix(), clientv3.WithPrefix(), clientv3.WithRev(from)) {
			if wr.CompactRevision > 0 {
				h.mu.Lock()
				h.lost = append(h.lost, fmt.Sprintf("revisions %d to %d were compacted before the watch delivered them", from, wr.CompactRevision-1))
				h.rev = max(h.rev, wr.CompactRevision-1)
				h.mu.Unlock()
				break
			}
			if wr.Err() != nil {
				break // watched again below, from the last revision delivered
			}
			h.add(wr.Events, time.Now())
		}
		cancel()
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond): // etcd stopped: the next watch waits for it
		}
	}
}

// add records events delivered at seen.
func (h *history) add(evs []*clientv3.Event, seen time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, ev := range evs {
		kv := ev.Kv
		h.rev = max(h.rev, kv.ModRevision)
		key := string(kv.Key)
		switch {
		case key == h.k.Assignment() && ev.Type == clientv3.EventTypePut:
			a, err := state.ParseAssignment(kv.Value)
			if err != nil {
				h.malformed = append(h.malformed, fmt.Sprintf("%s at revision %d: %v", key, kv.ModRevision, err))
				continue
			}
			h.assignments = append(h.assignments, assignmentAt{rev: kv.ModRevision, seen: seen, a: a})
		case strings.HasPrefix(key, h.k.Offsets()) && ev.Type == clientv3.EventTypePut:
			c, err := parseCommit(strings.TrimPrefix(key, h.k.Offsets()), kv.Value)
			if err != nil {
				h.malformed = append(h.malformed, fmt.Sprintf("%s at revision %d: %v", key, kv.ModRevision, err))
				continue
			}
			c.rev, c.seen = kv.ModRevision, seen
			h.commits = append(h.commits, c)
		case strings.HasPrefix(key, h.k.Acks()) && ev.Type == clientv3.EventTypePut:
			g, err := strconv.ParseInt(string(kv.Value), 10, 64)
			if err != nil {
				h.malformed = append(h.malformed, fmt.Sprintf("%s at revision %d: %v", key, kv.ModRevision, err))
				continue
			}
			h.acks = append(h.acks, ackAt{rev: kv.ModRevision, seen: seen, agent: strings.TrimPrefix(key, h.k.Acks()), generation: g})
		case strings.HasPrefix(key, h.k.Agents()) && ev.Type == clientv3.EventTypePut && ev.IsCreate():
			// A registration created: the agent's new session runs a new
			// worker, whose partitions start afresh.
			h.registered[strings.TrimPrefix(key, h.k.Agents())] = seen
		case strings.HasPrefix(key, h.k.Signals()):
			paused := false
			if ev.Type == clientv3.EventTypePut {
				// A value agents refuse pauses nothing; the checker
				// takes it as a pause, which only narrows its checks.
				p, _, err := signals.Parse(kv.Value)
				paused = p || err != nil
			}
			if _, was := h.pauses[key]; was && !paused {
				delete(h.pauses, key)
				h.lastPause = seen
			} else if !was && paused {
				h.pauses[key] = seen
			}
		}
	}
}

// parseCommit reads a committed position: the key after offsets/ is
// <cluster>/<topic>/<partition>, the value offsets' JSON (docs/ARCHITECTURE.md,
// "etcd keys").
func parseCommit(rest string, val []byte) (commitAt, error) {
	f := strings.Split(rest, "/")
	if len(f) != 3 {
		return commitAt{}, errors.New("not <cluster>/<topic>/<partition>")
	}
	p, err := strconv.ParseInt(f[2], 10, 32)
	if err != nil {
		return commitAt{}, fmt.Errorf("partition: %w", err)
	}
	var v struct {
		Offset     *int64 `json:"offset"`
		Agent      string `json:"agent"`
		Generation int64  `json:"generation"`
	}
	if err := json.Unmarshal(val, &v); err != nil {
		return commitAt{}, err
	}
	if v.Offset == nil || v.Agent == "" || v.Generation <= 0 {
		return commitAt{}, fmt.Errorf("offset, agent or generation missing: %s", val)
	}
	return commitAt{part: clusterPart{f[0], f[1], int32(p)}, agent: v.Agent, generation: v.Generation, offset: *v.Offset}, nil
}

// caughtUp waits until the watch has delivered etcd's current revision,
// or ctx ends.
func (h *history) caughtUp(ctx context.Context, cli *clientv3.Client) error {
	gctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	resp, err := cli.Get(gctx, h.k.Assignment())
	cancel()
	if err != nil {
		return fmt.Errorf("chaos: etcd's current revision: %w", err)
	}
	want := resp.Header.Revision
	for {
		h.mu.Lock()
		got := h.rev
		h.mu.Unlock()
		if got >= want {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("chaos: the history watch delivered revision %d of %d: %w", got, want, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// checkCommits checks etcd's history of positions:
//
//   - fenced-commit: an agent's commit at revision R carries the generation
//     of the state/assignment in force at R, which gives the agent that
//     partition (owned or revoking). That is what offsets.Store's fence
//     compares (the registration's lease and ModRevision(state/assignment)
//     in the commit's transaction) together with the agent's
//     Assignment.MayCommit: a commit that breaks it was written by an
//     agent acting on an assignment no longer in force.
//   - one-deliverer-per-generation: no two agents commit positions of one
//     partition under one generation.
//
// The leader's writes during a switch ("leader:<id>", fenced by its term)
// are of neither kind.
func (h *history) checkCommits(r *run, res *Result) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, l := range h.lost {
		res.Violations = append(res.Violations, Violation{Invariant: "history", Record: l,
			Detail: "etcd compacted revisions the checker had not read: commits in them are not checked (the stack's etcd must not compact)"})
	}
	for _, m := range h.malformed {
		res.Violations = append(res.Violations, Violation{Invariant: "history", Record: m, Detail: "a value the checker cannot read"})
	}
	type partGen struct {
		part clusterPart
		gen  int64
	}
	first := map[partGen]commitAt{}
	var cur *assignmentAt
	ai := 0
	var fenced, twice []Violation
	for _, c := range h.commits {
		for ai < len(h.assignments) && h.assignments[ai].rev <= c.rev {
			cur = &h.assignments[ai]
			ai++
		}
		if strings.HasPrefix(c.agent, "leader:") {
			continue
		}
		res.CommitsChecked++
		at := c.seen.Sub(r.start)
		rec := fmt.Sprintf("%s offset %d committed by %s under generation %d at revision %d (%.1fs)", c.part, c.offset, c.agent, c.generation, c.rev, at.Seconds())
		switch {
		case cur == nil:
			fenced = append(fenced, Violation{Invariant: "fenced-commit", At: at, Record: rec, Detail: "committed before any state/assignment"})
		case c.generation != cur.a.Generation:
			fenced = append(fenced, Violation{Invariant: "fenced-commit", At: at, Record: rec,
				Detail: fmt.Sprintf("the assignment in force is generation %d (revision %d): the commit passed no fence", cur.a.Generation, cur.rev)})
		case !cur.a.MayCommit(c.agent, c.part.cluster, state.TopicPartition{Topic: c.part.topic, Partition: c.part.partition}):
			fenced = append(fenced, Violation{Invariant: "fenced-commit", At: at, Record: rec,
				Detail: fmt.Sprintf("generation %d does not give %s to %s (neither owned nor revoking)", cur.a.Generation, c.part, c.agent)})
		}
		k := partGen{c.part, c.generation}
		if f, ok := first[k]; !ok {
			first[k] = c
		} else if f.agent != c.agent {
			twice = append(twice, Violation{Invariant: "one-deliverer-per-generation", At: at, Record: rec,
				Detail: fmt.Sprintf("%s committed %s under generation %d too (offset %d at revision %d)", f.agent, c.part, c.generation, f.offset, f.rev)})
			first[k] = c // report each further agent once
		}
	}
	for _, vs := range [][]Violation{fenced, twice} {
		if len(vs) > 0 {
			v := vs[0]
			v.Detail = fmt.Sprintf("%d commits; the first: %s", len(vs), v.Detail)
			res.Violations = append(res.Violations, v)
		}
	}
}

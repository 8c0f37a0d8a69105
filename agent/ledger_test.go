package agent_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/state"
)

// ledger records every record every agent handled, and checks the
// ownership invariants as records arrive (not by sampling at the end).
type ledger struct {
	mu         sync.Mutex
	seen       map[string]int                  // record id -> times handled
	first      map[string]string               // record id -> agent that handled it first
	lastGen    map[state.TopicPartition]holder // partition -> newest (token, generation) delivered, and by whom
	genHolder  map[string]string               // "topic/partition@token.generation" -> agent
	lastOffset map[string]int64                // "agent/session topic/partition@generation" -> last offset
	gen        map[string]int64                // record id -> generation it was first handled under
	firstAt    map[string]time.Time            // record id -> when it was first handled
	perGen     map[int64]int                   // generation -> deliveries under it
	// deliveries are every delivery of each record id: what a duplicate
	// is explained with (dupDeliveries).
	deliveries map[string][]delivery
	violations []string
}

// delivery is one hand-over of a record to a handler, as the ledger saw it.
type delivery struct {
	agent      string
	cluster    string
	tp         state.TopicPartition
	offset     int64
	generation int64
	session    int64
	at         time.Time
}

func (d delivery) String() string {
	return fmt.Sprintf("%s %s %s@%d gen %d session %x at %s", d.agent, d.cluster, d.tp, d.offset, d.generation, d.session,
		d.at.UTC().Format("15:04:05.000"))
}

type holder struct {
	agent      string
	token, gen int64
}

// before reports whether h's generation comes before (token, gen):
// generations are ordered within a term's token, and a later token's
// come after whatever their numbers.
func (h holder) before(token, gen int64) bool {
	return h.token < token || h.token == token && h.gen < gen
}

func newLedger() *ledger {
	return &ledger{
		seen: map[string]int{}, first: map[string]string{},
		lastGen:   map[state.TopicPartition]holder{},
		genHolder: map[string]string{}, lastOffset: map[string]int64{}, gen: map[string]int64{},
		firstAt: map[string]time.Time{}, perGen: map[int64]int{}, deliveries: map[string][]delivery{},
	}
}

// handledUnder returns how many deliveries were made under generation gen.
func (l *ledger) handledUnder(gen int64) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.perGen[gen]
}

// handler returns agent id's handler.
func (l *ledger) handler(id string) record.Handler {
	return record.HandlerFunc(func(_ context.Context, r *record.Record) error {
		l.record(id, r)
		r.Ack()
		return nil
	})
}

func (l *ledger) record(id string, r *record.Record) {
	l.mu.Lock()
	defer l.mu.Unlock()
	tp := state.TopicPartition{Topic: r.Topic, Partition: r.Partition}
	key := string(r.Value)
	l.seen[key]++
	l.perGen[r.Generation]++
	l.deliveries[key] = append(l.deliveries[key], delivery{agent: id, cluster: r.Cluster, tp: tp, offset: r.Offset,
		generation: r.Generation, session: r.Session, at: time.Now()})
	if _, ok := l.first[key]; !ok {
		l.first[key] = id
		l.gen[key] = r.Generation
		l.firstAt[key] = time.Now()
	}
	// A partition's records come from one agent at a time, each owner
	// under a later generation than the one before: a delivery under an
	// older generation than one already seen means a former owner still
	// delivers after the partition moved on.
	if last, ok := l.lastGen[tp]; !ok || last.before(r.Token, r.Generation) || last.token == r.Token && last.gen == r.Generation {
		l.lastGen[tp] = holder{agent: id, token: r.Token, gen: r.Generation}
	} else {
		l.violations = append(l.violations, fmt.Sprintf("%s delivered %s under generation %d (token %d) after %s did under %d (token %d)",
			id, tp, r.Generation, r.Token, last.agent, last.gen, last.token))
	}
	gk := fmt.Sprintf("%s@%d.%d", tp, r.Token, r.Generation)
	if h, ok := l.genHolder[gk]; ok && h != id {
		l.violations = append(l.violations, fmt.Sprintf("%s and %s both hold %s", h, id, gk))
	}
	l.genHolder[gk] = id
	// Within one session of one agent a partition's offsets only grow; a
	// new session may consume again from the committed offset, and a
	// topic created again (another id) from its start.
	ok := fmt.Sprintf("%s/%x %s %s", id, r.Session, gk, r.TopicID)
	if last, seen := l.lastOffset[ok]; seen && r.Offset <= last {
		l.violations = append(l.violations, fmt.Sprintf("%s handled %s offset %d after %d in one session", id, tp, r.Offset, last))
	}
	l.lastOffset[ok] = r.Offset
}

func (l *ledger) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.seen)
}

// result returns the ids never handled among want, the number of
// duplicate deliveries, and which agent first handled each duplicate.
func (l *ledger) result(want int) (missing []int, dups int, dupFirst map[string]int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	dupFirst = map[string]int{}
	for i := range want {
		if l.seen[strconv.Itoa(i)] == 0 {
			missing = append(missing, i)
		}
	}
	for k, n := range l.seen {
		if n > 1 {
			dups += n - 1
			dupFirst[l.first[k]] += n - 1
		}
	}
	return missing, dups, dupFirst
}

// dupDeliveries describes every record handled more than once: each of
// its deliveries (agent, cluster, partition@offset, generation, session,
// time), by record id.
func (l *ledger) dupDeliveries() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, k := range slices.Sorted(maps.Keys(l.seen)) {
		if l.seen[k] < 2 {
			continue
		}
		var ds []string
		for _, d := range l.deliveries[k] {
			ds = append(ds, d.String())
		}
		out = append(out, fmt.Sprintf("record %s handled %d times: %s", k, l.seen[k], strings.Join(ds, "; ")))
	}
	return out
}

func (l *ledger) check(t *testing.T) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, v := range l.violations {
		t.Error("invariant:", v)
	}
}

func (l *ledger) firstHandler(id string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.first[id]
}

func (l *ledger) generationOf(id string) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.gen[id]
}

// deliveredFrom returns how many partitions of topic delivered a record.
func (l *ledger) deliveredFrom(topic string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for tp := range l.lastGen {
		if tp.Topic == topic {
			n++
		}
	}
	return n
}

// tally returns the ids in [0, n) of tag never handled, and the number of
// duplicate deliveries among them.
func (l *ledger) tally(tag string, n int) (missing []int, dups int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i := range n {
		switch c := l.seen[tag+strconv.Itoa(i)]; {
		case c == 0:
			missing = append(missing, i)
		case c > 1:
			dups += c - 1
		}
	}
	return missing, dups
}

// handledAll waits until every id in [0, n) of tag was handled.
func (l *ledger) handledAll(t testing.TB, timeout time.Duration, tag string, n int) {
	t.Helper()
	wait.For(t, timeout, fmt.Sprintf("records %s0..%s%d handled", tag, tag, n-1), func() error {
		if missing, _ := l.tally(tag, n); len(missing) > 0 {
			return fmt.Errorf("%d not handled, first %d", len(missing), missing[0])
		}
		return nil
	})
}

// generations returns, per partition of topic, the generations its
// records were delivered under.
func (l *ledger) generations(topic string) map[int32]map[int64]bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[int32]map[int64]bool{}
	for gk := range l.genHolder {
		tp, gen, _ := strings.Cut(gk, "@")
		if !strings.HasPrefix(tp, topic+"/") {
			continue
		}
		p, _ := strconv.ParseInt(strings.TrimPrefix(tp, topic+"/"), 10, 32)
		g, _ := strconv.ParseInt(gen, 10, 64)
		if out[int32(p)] == nil {
			out[int32(p)] = map[int64]bool{}
		}
		out[int32(p)][g] = true
	}
	return out
}

func (l *ledger) timesHandled(id string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.seen[id]
}

func (l *ledger) duplicates() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, c := range l.seen {
		n += max(0, c-1)
	}
	return n
}

// handledOn returns how many deliveries came from cluster.
func (l *ledger) handledOn(cluster string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, ds := range l.deliveries {
		for _, d := range ds {
			if d.cluster == cluster {
				n++
			}
		}
	}
	return n
}

// firstHandled returns when record id was first handled.
func (l *ledger) firstHandled(id string) (time.Time, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	at, ok := l.firstAt[id]
	return at, ok
}

// dupsFirstHandled returns the records handled more than once, with when
// each was first handled.
func (l *ledger) dupsFirstHandled() map[string]time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[string]time.Time{}
	for id, n := range l.seen {
		if n > 1 {
			out[id] = l.firstAt[id]
		}
	}
	return out
}

//go:build integration

package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// The suite reads kswitch's state the way an operator's tooling would: the
// documented etcd keys and their JSON, decoded here into the suite's own
// types rather than kswitch's, so that a change of the format shows up as a
// failure here.

const fleetPrefix = "/kswitch/orders/"

// activeState is the value of state/active.
type activeState struct {
	Cluster string `json:"cluster"`
	Epoch   int64  `json:"epoch"`
	Phase   string `json:"phase"`
	From    string `json:"from"`
	Reason  string `json:"reason"`
	// Topics are the logical topics placed elsewhere than Cluster (a
	// topic pin), or moving on their own.
	Topics map[string]topicActive `json:"topics"`
}

// topicActive is where one logical topic is consumed when it is not where
// the fleet is (state/active's topics).
type topicActive struct {
	Cluster string `json:"cluster"`
	Phase   string `json:"phase"`
	From    string `json:"from"`
	Epoch   int64  `json:"epoch"`
	Reason  string `json:"reason"`
}

// committedOffset is the value of offsets/<cluster>/<topic>/<partition>.
type committedOffset struct {
	Offset     int64  `json:"offset"`
	Agent      string `json:"agent"`
	Generation int64  `json:"generation"`
}

// switchEvent is the value of history/<epoch>.
type switchEvent struct {
	Epoch      int64              `json:"epoch"`
	From       string             `json:"from"`
	To         string             `json:"to"`
	Reason     string             `json:"reason"`
	Started    time.Time          `json:"started"`
	Finished   time.Time          `json:"finished"`
	Phases     map[string]float64 `json:"phases_seconds"`
	Partitions []partitionSwitch  `json:"partitions"`
	// Topics are the logical topics a topic switch moved, alone; empty
	// for a switch of the fleet.
	Topics []string `json:"topics"`
	// Late (failbacks) counts the primary's unmirrored tail: records
	// written before the failover, not on the standby by then, consumed
	// after the primary returned; LateBySeconds bounds how late.
	Late          int64   `json:"late"`
	LateBySeconds float64 `json:"late_by_seconds"`
	// LateCounted: the tail was counted. The leader writes a failback's
	// entry first without the count, and again with it.
	LateCounted bool `json:"late_counted"`
}

// partitionSwitch is how a switch moved one partition's position.
type partitionSwitch struct {
	Topic string `json:"topic"` // logical: the name on A
	// Origin is the cluster whose producers write the physical topic;
	// FromTopic and ToTopic are its names on the clusters left and
	// joined.
	Origin     string `json:"origin"`
	FromTopic  string `json:"from_topic"`
	ToTopic    string `json:"to_topic"`
	Partition  int32  `json:"partition"`
	FromOffset int64  `json:"from_offset"`
	ToOffset   int64  `json:"to_offset"`
	Method     string `json:"method"`
	Rewound    int64  `json:"rewound"`
	// Lagged counts the records consumed that the target lacked at the
	// switch; Late those of the unmirrored tail (failbacks).
	Lagged int64  `json:"lagged"`
	Late   int64  `json:"late"`
	Detail string `json:"detail"`
	// ToEnd is the target partition's end at the translation.
	ToEnd int64 `json:"to_end"`
}

// event is one change under the fleet's prefix as the suite's watch saw it.
type event struct {
	At      time.Time
	Key     string // without the fleet prefix
	Value   []byte
	Deleted bool
}

// timeline records every change under the fleet's prefix, with the time
// the suite saw it: the clock the suite's timings are measured on.
type timeline struct {
	client *clientv3.Client
	mu     sync.Mutex
	events []event
	latest map[string][]byte
}

func startTimeline(t *testing.T, endpoints []string) *timeline {
	t.Helper()
	cl, err := clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: 5 * time.Second})
	if err != nil {
		fatal(t, err)
	}
	tl := &timeline{client: cl, latest: map[string][]byte{}}
	ctx, cancel := context.WithCancel(context.Background())
	gctx, gcancel := context.WithTimeout(ctx, 5*time.Second)
	resp, err := cl.Get(gctx, fleetPrefix, clientv3.WithPrefix())
	gcancel()
	if err != nil {
		cancel()
		cl.Close()
		fatal(t, err)
	}
	now := time.Now()
	for _, kv := range resp.Kvs {
		tl.add(event{At: now, Key: strings.TrimPrefix(string(kv.Key), fleetPrefix), Value: kv.Value})
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		rev := resp.Header.Revision + 1
		for ctx.Err() == nil {
			for wr := range cl.Watch(clientv3.WithRequireLeader(ctx), fleetPrefix, clientv3.WithPrefix(), clientv3.WithRev(rev)) {
				now := time.Now()
				for _, ev := range wr.Events {
					tl.add(event{At: now, Key: strings.TrimPrefix(string(ev.Kv.Key), fleetPrefix), Value: ev.Kv.Value,
						Deleted: ev.Type == clientv3.EventTypeDelete})
					rev = ev.Kv.ModRevision + 1
				}
			}
			// The watch broke (an etcd member died, leader lost): watch
			// again from the next revision, losing nothing.
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		cl.Close()
	})
	return tl
}

func (tl *timeline) add(ev event) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	tl.events = append(tl.events, ev)
	if ev.Deleted {
		delete(tl.latest, ev.Key)
	} else {
		tl.latest[ev.Key] = ev.Value
	}
}

// first returns the first event at or after since that match accepts.
func (tl *timeline) first(since time.Time, match func(event) bool) (event, bool) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	for _, ev := range tl.events {
		if !ev.At.Before(since) && match(ev) {
			return ev, true
		}
	}
	return event{}, false
}

// active returns the current state/active.
func (tl *timeline) active() (activeState, bool) {
	tl.mu.Lock()
	val, ok := tl.latest["state/active"]
	tl.mu.Unlock()
	var a activeState
	if !ok || json.Unmarshal(val, &a) != nil {
		return a, false
	}
	return a, true
}

// waitActive waits until state/active is cluster in phase active and
// returns when the suite saw that value first after since.
func (tl *timeline) waitActive(t *testing.T, since time.Time, cluster string, timeout time.Duration) time.Time {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		if ev, ok := tl.first(since, func(ev event) bool {
			a, ok := parseActive(ev)
			return ok && a.Cluster == cluster && a.Phase == "active"
		}); ok {
			return ev.At
		}
		if time.Now().After(deadline) {
			a, _ := tl.active()
			fatalf(t, "the fleet is not active on %s %v after %v: state/active is %+v", cluster, timeout, since.Format("15:04:05.000"), a)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func parseActive(ev event) (activeState, bool) {
	var a activeState
	if ev.Key != "state/active" || ev.Deleted || json.Unmarshal(ev.Value, &a) != nil {
		return a, false
	}
	return a, true
}

// offsets returns the committed offsets of cluster/topic, by partition.
func (tl *timeline) offsets(cluster, topic string) map[int32]committedOffset {
	prefix := "offsets/" + cluster + "/" + topic + "/"
	tl.mu.Lock()
	defer tl.mu.Unlock()
	out := map[int32]committedOffset{}
	for k, v := range tl.latest {
		rest, ok := strings.CutPrefix(k, prefix)
		if !ok {
			continue
		}
		p, err := strconv.ParseInt(rest, 10, 32)
		var c committedOffset
		if err != nil || json.Unmarshal(v, &c) != nil {
			continue
		}
		out[int32(p)] = c
	}
	return out
}

// caughtUp returns nil when the fleet's committed offsets on cluster/topic
// equal ends for every partition.
func (tl *timeline) caughtUp(cluster, topic string, ends map[int32]int64) error {
	got := tl.offsets(cluster, topic)
	for p, end := range ends {
		if got[p].Offset != end {
			return fmt.Errorf("committed on %s %s: %v, want the ends %v", cluster, topic, offsetsOf(got), ends)
		}
	}
	return nil
}

func offsetsOf(m map[int32]committedOffset) map[int32]int64 {
	out := map[int32]int64{}
	for p, c := range m {
		out[p] = c.Offset
	}
	return out
}

// history returns the switch events, oldest first.
func (tl *timeline) history() ([]switchEvent, error) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	var out []switchEvent
	for k, v := range tl.latest {
		if !strings.HasPrefix(k, "history/") {
			continue
		}
		var ev switchEvent
		if err := json.Unmarshal(v, &ev); err != nil {
			return nil, fmt.Errorf("%s: %w", k, err)
		}
		out = append(out, ev)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Epoch < out[j].Epoch })
	return out, nil
}

// doubleCommits returns the partitions that two agents committed in the
// same assignment generation, which the fencing must make impossible (the
// leader's own writes of translated offsets are not agents' commits).
func (tl *timeline) doubleCommits() []string {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	type pg struct {
		key        string
		generation int64
	}
	by := map[pg]map[string]bool{}
	for _, ev := range tl.events {
		if !strings.HasPrefix(ev.Key, "offsets/") || ev.Deleted {
			continue
		}
		var c committedOffset
		if json.Unmarshal(ev.Value, &c) != nil || strings.HasPrefix(c.Agent, "leader:") {
			continue
		}
		k := pg{ev.Key, c.Generation}
		if by[k] == nil {
			by[k] = map[string]bool{}
		}
		by[k][c.Agent] = true
	}
	var out []string
	for k, agents := range by {
		if len(agents) > 1 {
			out = append(out, fmt.Sprintf("%s in generation %d by %v", k.key, k.generation, sortedKeys(agents)))
		}
	}
	sort.Strings(out)
	return out
}

// owners returns the number of partitions each agent owns in the current
// state/assignment.
func (tl *timeline) owners() map[string]int {
	tl.mu.Lock()
	val := tl.latest["state/assignment"]
	tl.mu.Unlock()
	var a struct {
		Owned map[string][]json.RawMessage `json:"owned"`
	}
	out := map[string]int{}
	if json.Unmarshal(val, &a) == nil {
		for id, tps := range a.Owned {
			out[id] = len(tps)
		}
	}
	return out
}

// handOvers returns, per partition of cluster/topic, the offsets at which
// the partition was taken from an owner that died: the last offset it
// committed before a commit by another agent or in another assignment
// generation, when its registration (agents/<id>, on its etcd session)
// was deleted in between — it was killed, or its session expired on an
// overloaded machine. The next owner consumes from there, so what the dead
// one delivered after its last commit is delivered again (at least once).
// A partition handed over in a rebalance by a live owner, which commits
// what it delivered before letting go, is no such point.
func (tl *timeline) handOvers(cluster, topic string) map[int32]map[int64]bool {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	type commit struct {
		committedOffset
		at int // index in tl.events
	}
	last := map[int32]commit{}
	died := map[string][]int{} // agent → indices of the deletions of its registration
	out := map[int32]map[int64]bool{}
	for i, ev := range tl.events {
		if id, ok := strings.CutPrefix(ev.Key, "agents/"); ok && ev.Deleted {
			died[id] = append(died[id], i)
			continue
		}
		p, c, ok := offsetEvent(ev, cluster, topic)
		if !ok {
			continue
		}
		prev, seen := last[p]
		last[p] = commit{c, i}
		if !seen || (prev.Agent == c.Agent && prev.Generation == c.Generation) {
			continue
		}
		if slices.ContainsFunc(died[prev.Agent], func(d int) bool { return d > prev.at && d < i }) {
			if out[p] == nil {
				out[p] = map[int64]bool{}
			}
			out[p][prev.Offset] = true
		}
	}
	return out
}

package offsets

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/keys"
)

// DefaultMaxTxnOps is etcd's default limit on the operations of one
// transaction (the server's --max-txn-ops).
const DefaultMaxTxnOps = 128

// listPageSize is how many keys List reads per request.
const listPageSize = 1000

// ErrLeaseLost is matched (errors.Is) by a commit refused because the
// agent's registration is no longer on the fence's lease: its session ended
// (expired or revoked). The agent must stop consuming; its partitions are or
// will be given to others.
var ErrLeaseLost = errors.New("offsets: registration lease lost")

// ErrStaleGeneration is matched (errors.Is) by a commit refused because
// state/assignment changed since the revision the agent applied. The agent
// must apply the current assignment and commit again with its new fence,
// for the partitions it may still commit there.
var ErrStaleGeneration = errors.New("offsets: assignment generation is stale")

// Fence is what a commit is checked against, in the same transaction as its
// writes. It describes the agent and the assignment it acts on.
type Fence struct {
	// AgentKey is the agent's registration key, keys.Fleet.Agent(id).
	AgentKey string
	// Lease is the agent's session lease; the registration must be on it.
	Lease clientv3.LeaseID
	// AssignmentKey is keys.Fleet.Assignment().
	AssignmentKey string
	// AssignmentRev is the ModRevision of the state/assignment value the
	// agent has applied. Any later write of the key, even of the same
	// generation, makes the fence stale.
	AssignmentRev int64
	// Agent is the agent id, written with each commit and named in errors.
	Agent string
	// Generation is the generation of that assignment, written with each
	// commit and named in errors.
	Generation int64
}

func (f Fence) validate() error {
	switch {
	case f.AgentKey == "":
		return errors.New("offsets: fence has no agent key")
	case f.Lease == clientv3.NoLease:
		// A missing key compares as lease 0: a zero lease would
		// pass the fence after the registration is gone.
		return fmt.Errorf("offsets: fence of %s has no lease", f.Agent)
	case f.AssignmentKey == "":
		return errors.New("offsets: fence has no assignment key")
	case f.AssignmentRev <= 0:
		// A missing key compares as mod revision 0.
		return fmt.Errorf("offsets: fence of %s has assignment revision %d, want > 0", f.Agent, f.AssignmentRev)
	case f.Agent == "":
		return errors.New("offsets: fence has no agent id")
	case f.Generation <= 0:
		return fmt.Errorf("offsets: fence of %s has generation %d, want > 0", f.Agent, f.Generation)
	}
	return nil
}

// FenceError is the error of a commit refused by its fence. It matches
// ErrLeaseLost when LeaseLost is set and ErrStaleGeneration when Stale is
// set; when both failed, the message is about the lease, which is the
// stronger verdict (the agent must stop altogether).
type FenceError struct {
	Agent      string
	Generation int64
	// Partitions are those of the refused transaction.
	Partitions []TopicPartition
	// Committed is how many of the call's commits earlier transactions
	// had already written (see Store.Commit on batches).
	Committed int

	// LeaseLost: the registration is gone or on another lease.
	LeaseLost bool
	Lease     clientv3.LeaseID
	// CurrentLease is the registration's lease now; NoLease if the
	// registration is gone.
	CurrentLease clientv3.LeaseID

	// Stale: state/assignment changed since AssignmentRev.
	Stale         bool
	AssignmentRev int64
	// CurrentAssignmentRev is the assignment's mod revision now; 0 if it
	// was deleted.
	CurrentAssignmentRev int64
}

func (e *FenceError) Error() string {
	var b strings.Builder
	if e.LeaseLost {
		fmt.Fprintf(&b, "offsets: commit by %s: registration lease %x is gone", e.Agent, int64(e.Lease))
		if e.CurrentLease != clientv3.NoLease {
			fmt.Fprintf(&b, " (the registration is now on lease %x)", int64(e.CurrentLease))
		}
		b.WriteString(": the agent's session ended; it must stop consuming")
	} else {
		fmt.Fprintf(&b, "offsets: commit %s by %s: generation %d is stale", describePartitions(e.Partitions), e.Agent, e.Generation)
		if e.CurrentAssignmentRev == 0 {
			b.WriteString(" (assignment deleted)")
		} else {
			fmt.Fprintf(&b, " (assignment changed at revision %d)", e.CurrentAssignmentRev)
		}
	}
	if e.Committed > 0 {
		fmt.Fprintf(&b, "; %d earlier commits of the same call were written", e.Committed)
	}
	return b.String()
}

// Is matches ErrLeaseLost and ErrStaleGeneration per the failed compares.
func (e *FenceError) Is(target error) bool {
	return (target == ErrLeaseLost && e.LeaseLost) || (target == ErrStaleGeneration && e.Stale)
}

func describePartitions(tps []TopicPartition) string {
	switch len(tps) {
	case 0:
		return "(none)"
	case 1:
		return tps[0].String()
	default:
		return fmt.Sprintf("%s and %d more", tps[0], len(tps)-1)
	}
}

// Store reads and writes committed offsets in etcd. It is safe for
// concurrent use; it owns no goroutines and needs no Close.
type Store struct {
	c   *clientv3.Client
	k   keys.Fleet
	now func() time.Time
	// maxOps is the largest number of puts per transaction; lowered
	// when the server refuses a transaction as too large.
	maxOps atomic.Int64
	// written and writtenBytes count the positions Commit wrote and
	// their bytes (keys and values).
	written, writtenBytes atomic.Int64
}

// Written returns how many positions Commit has written and their bytes
// in etcd (keys and values), over the store's life: what a committer's
// etcd budget is charged.
func (s *Store) Written() (positions, bytes int64) {
	return s.written.Load(), s.writtenBytes.Load()
}

// NewStore returns the offset store of fleet k on client c. A transaction
// carries at most DefaultMaxTxnOps commits (etcd's default --max-txn-ops);
// against a server with a lower limit the store halves its transactions
// until they are accepted, and remembers that.
func NewStore(c *clientv3.Client, k keys.Fleet) *Store {
	s := &Store{c: c, k: k, now: time.Now}
	s.maxOps.Store(DefaultMaxTxnOps)
	return s
}

// Commit writes commits, fenced by f: the writes apply only if, in the
// same transaction, the registration f.AgentKey is on lease f.Lease and
// f.AssignmentKey still has mod revision f.AssignmentRev. Otherwise nothing
// of that transaction is written and the error is a *FenceError matching
// ErrLeaseLost or ErrStaleGeneration.
//
// The caller checks which partitions it may commit: only those it owns or
// is revoking in the fenced generation (state.Assignment.MayCommit).
// The store checks the fence, not the assignment's content: the fence
// proves the assignment has not changed since the caller checked it.
//
// There is no compare on the previous offset: the owner is the only writer,
// and an offset lower than the stored one is committed as given. When a
// partition appears more than once in commits, the last one wins, as if
// committed one after the other.
//
// Batches. One transaction carries at most the server's --max-txn-ops
// commits (DefaultMaxTxnOps, or less after a refusal); a larger batch is split
// into several transactions, each fenced the same way, written in order.
// If a fence fails mid-way the earlier transactions stay committed
// (FenceError.Committed says how many commits): that is safe, because each
// was written while the fence held, exactly as if the caller had made
// several calls.
//
// An empty batch writes nothing and checks nothing. Invalid commits (bad
// names, negative offset, too many fingerprints) are refused before
// anything is written. A ctx error is returned unchanged.
func (s *Store) Commit(ctx context.Context, f Fence, commits []Commit) error {
	if err := f.validate(); err != nil {
		return err
	}
	if len(commits) == 0 {
		return nil
	}
	type entry struct {
		tp  TopicPartition
		key string
		val string
	}
	now := s.now()
	entries := make([]entry, 0, len(commits))
	index := make(map[string]int, len(commits))
	for _, c := range commits {
		if err := c.validate(); err != nil {
			return fmt.Errorf("offsets: commit %s/%s/%d by %s: %w", c.Cluster, c.Topic, c.Partition, f.Agent, err)
		}
		val, err := encodeValue(c, f.Agent, f.Generation, now)
		if err != nil {
			return fmt.Errorf("offsets: commit %s/%s/%d by %s: %w", c.Cluster, c.Topic, c.Partition, f.Agent, err)
		}
		e := entry{tp: c.TopicPartition(), key: s.k.Offset(c.Cluster, c.Topic, c.Partition), val: string(val)}
		// etcd refuses a transaction that puts one key twice.
		if i, dup := index[e.key]; dup {
			entries[i] = e
			continue
		}
		index[e.key] = len(entries)
		entries = append(entries, e)
	}

	cmps := []clientv3.Cmp{
		clientv3.Compare(clientv3.LeaseValue(f.AgentKey), "=", f.Lease),
		clientv3.Compare(clientv3.ModRevision(f.AssignmentKey), "=", f.AssignmentRev),
	}
	elseOps := []clientv3.Op{clientv3.OpGet(f.AgentKey), clientv3.OpGet(f.AssignmentKey)}
	for done := 0; done < len(entries); {
		n := min(int(s.maxOps.Load()), len(entries)-done)
		chunk := entries[done : done+n]
		puts := make([]clientv3.Op, len(chunk))
		for i, e := range chunk {
			puts[i] = clientv3.OpPut(e.key, e.val)
		}
		resp, err := s.c.Txn(ctx).If(cmps...).Then(puts...).Else(elseOps...).Commit()
		if errors.Is(err, rpctypes.ErrTooManyOps) && n > 1 {
			s.lowerMaxOps(int64(n / 2))
			continue
		}
		if err != nil {
			if ctxErr := ctx.Err(); ctxErr != nil && errors.Is(err, ctxErr) {
				return err
			}
			return fmt.Errorf("offsets: commit %s by %s (%d of %d written before): %w",
				describePartitions(tpsOf(chunk, func(e entry) TopicPartition { return e.tp })),
				f.Agent, done, len(entries), err)
		}
		if !resp.Succeeded {
			return fenceError(f, resp, tpsOf(chunk, func(e entry) TopicPartition { return e.tp }), done)
		}
		size := 0
		for _, e := range chunk {
			size += len(e.key) + len(e.val)
		}
		s.written.Add(int64(n))
		s.writtenBytes.Add(int64(size))
		done += n
	}
	return nil
}

func tpsOf[T any](xs []T, tp func(T) TopicPartition) []TopicPartition {
	out := make([]TopicPartition, len(xs))
	for i, x := range xs {
		out[i] = tp(x)
	}
	return out
}

// lowerMaxOps sets the transaction size to n if that is lower than it is.
func (s *Store) lowerMaxOps(n int64) {
	for {
		cur := s.maxOps.Load()
		if n >= cur || s.maxOps.CompareAndSwap(cur, n) {
			return
		}
	}
}

// fenceError reads the Else branch of a failed fenced transaction: the
// registration and the assignment as they were when the compares failed.
func fenceError(f Fence, resp *clientv3.TxnResponse, tps []TopicPartition, committed int) error {
	e := &FenceError{
		Agent:         f.Agent,
		Generation:    f.Generation,
		Partitions:    tps,
		Committed:     committed,
		Lease:         f.Lease,
		AssignmentRev: f.AssignmentRev,
	}
	if len(resp.Responses) != 2 {
		return fmt.Errorf("offsets: commit by %s: fence failed and etcd answered %d reads, want 2", f.Agent, len(resp.Responses))
	}
	if kvs := resp.Responses[0].GetResponseRange().GetKvs(); len(kvs) > 0 {
		e.CurrentLease = clientv3.LeaseID(kvs[0].Lease)
	}
	if kvs := resp.Responses[1].GetResponseRange().GetKvs(); len(kvs) > 0 {
		e.CurrentAssignmentRev = kvs[0].ModRevision
	}
	e.LeaseLost = e.CurrentLease != f.Lease
	e.Stale = e.CurrentAssignmentRev != f.AssignmentRev
	if !e.LeaseLost && !e.Stale {
		// The reads run in the same transaction as the compares, so
		// this cannot happen unless etcd's semantics change.
		return fmt.Errorf("offsets: commit %s by %s: fence failed but lease %x and assignment revision %d both match",
			describePartitions(tps), f.Agent, int64(f.Lease), f.AssignmentRev)
	}
	return e
}

// Load returns the committed position of one partition, and false if there
// is none. A value that cannot be read is a *MalformedError naming the key
// (matching ErrMalformed); callers log it and treat the partition as having
// no committed offset.
func (s *Store) Load(ctx context.Context, cluster, topic string, partition int32) (Position, bool, error) {
	if err := validName(cluster, topic, partition); err != nil {
		return Position{}, false, fmt.Errorf("offsets: load %s/%s/%d: %w", cluster, topic, partition, err)
	}
	key := s.k.Offset(cluster, topic, partition)
	resp, err := s.c.Get(ctx, key)
	if err != nil {
		return Position{}, false, loadErr(ctx, key, err)
	}
	if len(resp.Kvs) == 0 {
		return Position{}, false, nil
	}
	kv := resp.Kvs[0]
	p, err := decodeValue(key, kv.ModRevision, cluster, topic, partition, kv.Value)
	if err != nil {
		return Position{}, false, err
	}
	return p, true, nil
}

// List returns the committed positions of every partition of cluster,
// sorted by topic then partition, and separately the keys under the
// cluster's prefix that could not be read (values or keys that are
// malformed), which are left out of the positions. The error is for the
// request itself; it is nil when only some entries were malformed.
//
// Large clusters are read in pages, all at the revision of the first page,
// so the result is one consistent snapshot.
func (s *Store) List(ctx context.Context, cluster string) ([]Position, []*MalformedError, error) {
	if err := keys.ValidName(cluster); err != nil {
		return nil, nil, fmt.Errorf("offsets: list cluster %q: %w", cluster, err)
	}
	prefix := s.k.ClusterOffsets(cluster)
	var (
		out []Position
		bad []*MalformedError
		rev int64
	)
	end := clientv3.GetPrefixRangeEnd(prefix)
	from := prefix
	for {
		opts := []clientv3.OpOption{clientv3.WithRange(end), clientv3.WithLimit(listPageSize)}
		if rev > 0 {
			opts = append(opts, clientv3.WithRev(rev))
		}
		resp, err := s.c.Get(ctx, from, opts...)
		if err != nil {
			return nil, nil, loadErr(ctx, prefix, err)
		}
		if rev == 0 {
			rev = resp.Header.Revision
		}
		for _, kv := range resp.Kvs {
			p, err := s.decodeKV(cluster, prefix, string(kv.Key), kv.ModRevision, kv.Value)
			if err != nil {
				bad = append(bad, err)
				continue
			}
			out = append(out, p)
		}
		if !resp.More || len(resp.Kvs) == 0 {
			break
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
	slices.SortFunc(out, func(a, b Position) int { return a.TopicPartition().Compare(b.TopicPartition()) })
	return out, bad, nil
}

// LoadMany returns the committed positions of tps on cluster, for an agent
// starting many partitions at once. Partitions without a committed offset
// are absent from the map; malformed values are absent too and returned
// separately (see List). It reads every partition of each topic named in
// tps, one prefix read per topic, all in one etcd transaction (several if
// there are more topics than a transaction may carry).
func (s *Store) LoadMany(ctx context.Context, cluster string, tps []TopicPartition) (map[TopicPartition]Position, []*MalformedError, error) {
	want := make(map[TopicPartition]bool, len(tps))
	var topics []string
	for _, tp := range tps {
		if err := validName(cluster, tp.Topic, tp.Partition); err != nil {
			return nil, nil, fmt.Errorf("offsets: load %s/%s: %w", cluster, tp, err)
		}
		if !want[tp] {
			want[tp] = true
			topics = append(topics, tp.Topic)
		}
	}
	slices.Sort(topics)
	topics = slices.Compact(topics)

	out := make(map[TopicPartition]Position, len(want))
	var bad []*MalformedError
	prefix := s.k.ClusterOffsets(cluster)
	for len(topics) > 0 {
		n := min(int(s.maxOps.Load()), len(topics))
		ops := make([]clientv3.Op, n)
		for i, t := range topics[:n] {
			ops[i] = clientv3.OpGet(s.k.TopicOffsets(cluster, t), clientv3.WithPrefix())
		}
		resp, err := s.c.Txn(ctx).Then(ops...).Commit()
		if errors.Is(err, rpctypes.ErrTooManyOps) && n > 1 {
			s.lowerMaxOps(int64(n / 2))
			continue
		}
		if err != nil {
			return nil, nil, loadErr(ctx, prefix, err)
		}
		for _, r := range resp.Responses {
			for _, kv := range r.GetResponseRange().GetKvs() {
				p, err := s.decodeKV(cluster, prefix, string(kv.Key), kv.ModRevision, kv.Value)
				if err != nil {
					// Report only what the caller asked about.
					if tp, ok := s.parseKey(cluster, prefix, string(kv.Key)); !ok || want[tp] {
						bad = append(bad, err)
					}
					continue
				}
				if tp := p.TopicPartition(); want[tp] {
					out[tp] = p
				}
			}
		}
		topics = topics[n:]
	}
	return out, bad, nil
}

func loadErr(ctx context.Context, key string, err error) error {
	if ctxErr := ctx.Err(); ctxErr != nil && errors.Is(err, ctxErr) {
		return err
	}
	return fmt.Errorf("offsets: read %s: %w", key, err)
}

func validName(cluster, topic string, partition int32) error {
	if err := keys.ValidName(cluster); err != nil {
		return fmt.Errorf("cluster %q %w", cluster, err)
	}
	if err := keys.ValidName(topic); err != nil {
		return fmt.Errorf("topic %q %w", topic, err)
	}
	if partition < 0 {
		return fmt.Errorf("partition %d is negative", partition)
	}
	return nil
}

// decodeKV parses one key and value under prefix = keys.Fleet.ClusterOffsets(cluster).
func (s *Store) decodeKV(cluster, prefix, key string, rev int64, val []byte) (Position, *MalformedError) {
	tp, ok := s.parseKey(cluster, prefix, key)
	if !ok {
		return Position{}, &MalformedError{Key: key, Revision: rev, Err: errors.New("key is not <cluster>/<topic>/<partition>")}
	}
	p, err := decodeValue(key, rev, cluster, tp.Topic, tp.Partition, val)
	if err != nil {
		var me *MalformedError
		errors.As(err, &me)
		return Position{}, me
	}
	return p, nil
}

// parseKey returns the partition of an offset key of cluster. The key must
// be exactly what keys.Fleet.Offset builds for it (so "orders/03" or a
// nested "a/b/1" is refused).
func (s *Store) parseKey(cluster, prefix, key string) (TopicPartition, bool) {
	rest, ok := strings.CutPrefix(key, prefix)
	if !ok {
		return TopicPartition{}, false
	}
	i := strings.LastIndexByte(rest, '/')
	if i < 0 {
		return TopicPartition{}, false
	}
	topic := rest[:i]
	p, err := strconv.ParseInt(rest[i+1:], 10, 32)
	if err != nil || validName(cluster, topic, int32(p)) != nil || s.k.Offset(cluster, topic, int32(p)) != key {
		return TopicPartition{}, false
	}
	return TopicPartition{Topic: topic, Partition: int32(p)}, true
}

// PutOps returns the etcd operations that write commits as written by
// writer in generation, for a caller that fences them itself: the leader
// writes translated positions during a cluster switch inside its own
// fenced transactions (election.Term.Txn), while no agent consumes the
// target cluster. The commits are validated like Commit's.
func (s *Store) PutOps(writer string, generation int64, commits []Commit) ([]clientv3.Op, error) {
	now := s.now()
	ops := make([]clientv3.Op, 0, len(commits))
	for _, c := range commits {
		if err := c.validate(); err != nil {
			return nil, fmt.Errorf("offsets: write %s/%s/%d by %s: %w", c.Cluster, c.Topic, c.Partition, writer, err)
		}
		val, err := encodeValue(c, writer, generation, now)
		if err != nil {
			return nil, fmt.Errorf("offsets: write %s/%s/%d by %s: %w", c.Cluster, c.Topic, c.Partition, writer, err)
		}
		ops = append(ops, clientv3.OpPut(s.k.Offset(c.Cluster, c.Topic, c.Partition), string(val)))
	}
	return ops, nil
}

package offsets

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/keys"
)

// fenceEnv is one agent registered on a lease, and an assignment.
type fenceEnv struct {
	cli   *clientv3.Client
	k     keys.Fleet
	store *Store
	fence Fence
}

func testCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

var testNow = time.Date(2026, 1, 2, 3, 4, 5, 678_000_000, time.UTC)

// storeOption sets what a test changes in a Store.
type storeOption func(*Store)

// withMaxTxnOps starts the store at n commits per transaction.
func withMaxTxnOps(n int) storeOption { return func(s *Store) { s.maxOps.Store(int64(n)) } }

func newFenceEnv(t *testing.T, opts ...storeOption) *fenceEnv {
	t.Helper()
	ctx := testCtx(t)
	cli := testenv.EtcdClientT(t, testenv.StartEtcdT(t))
	k := keys.New("f1")
	lease, err := cli.Grant(ctx, 30)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, k.Agent("agent-2"), `{"id":"agent-2"}`, clientv3.WithLease(lease.ID)); err != nil {
		t.Fatal(err)
	}
	resp, err := cli.Put(ctx, k.Assignment(), `{"generation":12}`)
	if err != nil {
		t.Fatal(err)
	}
	store := NewStore(cli, k)
	store.now = func() time.Time { return testNow }
	for _, o := range opts {
		o(store)
	}
	return &fenceEnv{
		cli:   cli,
		k:     k,
		store: store,
		fence: Fence{
			AgentKey:      k.Agent("agent-2"),
			Lease:         lease.ID,
			AssignmentKey: k.Assignment(),
			AssignmentRev: resp.Header.Revision,
			Agent:         "agent-2",
			Generation:    12,
		},
	}
}

func TestCommitLoadListRoundTrip(t *testing.T) {
	env := newFenceEnv(t)
	ctx := testCtx(t)
	ts := time.UnixMilli(1_767_225_600_123)
	fps := []Fingerprint{1, 2, 0xffff_ffff_ffff_ffff}
	commits := []Commit{
		{Cluster: "A", Topic: "orders", Partition: 3, Offset: 1042, Timestamp: ts.Add(123 * time.Microsecond), Fingerprints: fps},
		{Cluster: "A", Topic: "orders", Partition: 10, Offset: 7},
		{Cluster: "A", Topic: "audit", Partition: 0, Offset: 0},
		{Cluster: "B", Topic: "orders", Partition: 3, Offset: 99},
	}
	if err := env.store.Commit(ctx, env.fence, commits); err != nil {
		t.Fatal(err)
	}

	p, ok, err := env.store.Load(ctx, "A", "orders", 3)
	if err != nil || !ok {
		t.Fatalf("Load = %v, %v, %v", p, ok, err)
	}
	if p.Offset != 1042 || !p.Timestamp.Equal(ts) || !slices.Equal(p.Fingerprints, fps) ||
		p.Agent != "agent-2" || p.Generation != 12 || !p.CommittedAt.Equal(testNow) || p.Revision <= env.fence.AssignmentRev {
		t.Fatalf("Load = %+v", p)
	}
	if p.Cluster != "A" || p.Topic != "orders" || p.Partition != 3 {
		t.Fatalf("Load names %s/%s/%d", p.Cluster, p.Topic, p.Partition)
	}
	p, ok, err = env.store.Load(ctx, "A", "orders", 10)
	if err != nil || !ok || p.Offset != 7 || !p.Timestamp.IsZero() || len(p.Fingerprints) != 0 {
		t.Fatalf("Load without records = %+v, %v, %v", p, ok, err)
	}
	if _, ok, err := env.store.Load(ctx, "A", "orders", 4); ok || err != nil {
		t.Fatalf("Load of an uncommitted partition = %v, %v", ok, err)
	}

	// The stored JSON is the documented one.
	raw, err := env.cli.Get(ctx, env.k.Offset("A", "orders", 3))
	if err != nil {
		t.Fatal(err)
	}
	want := `{"offset":1042,"timestamp_ms":1767225600123,"fingerprints":["0000000000000001","0000000000000002","ffffffffffffffff"],"agent":"agent-2","generation":12,"committed_at":"2026-01-02T03:04:05.678Z"}`
	if got := string(raw.Kvs[0].Value); got != want {
		t.Errorf("stored value\n got %s\nwant %s", got, want)
	}

	list, bad, err := env.store.List(ctx, "A")
	if err != nil || len(bad) != 0 {
		t.Fatalf("List = %v, %v", bad, err)
	}
	var got []string
	for _, p := range list {
		got = append(got, fmt.Sprintf("%s/%s/%d@%d", p.Cluster, p.Topic, p.Partition, p.Offset))
	}
	if w := []string{"A/audit/0@0", "A/orders/3@1042", "A/orders/10@7"}; !slices.Equal(got, w) {
		t.Fatalf("List(A) = %v, want %v", got, w)
	}
	if list[1].Timestamp.UnixMilli() != ts.UnixMilli() || !slices.Equal(list[1].Fingerprints, fps) {
		t.Fatalf("List lost detail: %+v", list[1])
	}

	many, bad, err := env.store.LoadMany(ctx, "A", []TopicPartition{
		{Topic: "orders", Partition: 3}, {Topic: "orders", Partition: 4}, {Topic: "audit", Partition: 0}, {Topic: "orders", Partition: 3},
	})
	if err != nil || len(bad) != 0 {
		t.Fatalf("LoadMany = %v, %v", bad, err)
	}
	if len(many) != 2 || many[TopicPartition{Topic: "orders", Partition: 3}].Offset != 1042 ||
		many[TopicPartition{Topic: "audit", Partition: 0}].Agent != "agent-2" {
		t.Fatalf("LoadMany = %+v", many)
	}
}

func TestContextErrorsUnchanged(t *testing.T) {
	env := newFenceEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := env.store.Commit(ctx, env.fence, manyCommits(1, 0)); err != context.Canceled {
		t.Errorf("Commit = %v, want context.Canceled unchanged", err)
	}
	if _, _, err := env.store.Load(ctx, "A", "orders", 0); err != context.Canceled {
		t.Errorf("Load = %v, want context.Canceled unchanged", err)
	}
	if _, _, err := env.store.List(ctx, "A"); err != context.Canceled {
		t.Errorf("List = %v, want context.Canceled unchanged", err)
	}
	if _, _, err := env.store.LoadMany(ctx, "A", []TopicPartition{{Topic: "orders"}}); err != context.Canceled {
		t.Errorf("LoadMany = %v, want context.Canceled unchanged", err)
	}
}

func TestCommitSamePartitionTwiceLastWins(t *testing.T) {
	env := newFenceEnv(t)
	ctx := testCtx(t)
	err := env.store.Commit(ctx, env.fence, []Commit{
		{Cluster: "A", Topic: "orders", Partition: 1, Offset: 10},
		{Cluster: "A", Topic: "orders", Partition: 2, Offset: 5},
		{Cluster: "A", Topic: "orders", Partition: 1, Offset: 8},
	})
	if err != nil {
		t.Fatal(err)
	}
	if p, _, _ := env.store.Load(ctx, "A", "orders", 1); p.Offset != 8 {
		t.Fatalf("offset = %d, want the last one, 8", p.Offset)
	}
}

// loadOffset returns the committed offset of A/orders/p, or -1.
func loadOffset(t *testing.T, s *Store, p int32) int64 {
	t.Helper()
	pos, ok, err := s.Load(testCtx(t), "A", "orders", p)
	if err != nil {
		t.Fatal(err)
	}
	if !ok {
		return -1
	}
	return pos.Offset
}

func TestCommitFencedLeaseLost(t *testing.T) {
	env := newFenceEnv(t)
	ctx := testCtx(t)
	c := []Commit{{Cluster: "A", Topic: "orders", Partition: 3, Offset: 10}}
	if err := env.store.Commit(ctx, env.fence, c); err != nil {
		t.Fatal(err)
	}
	if _, err := env.cli.Revoke(ctx, env.fence.Lease); err != nil {
		t.Fatal(err)
	}
	c[0].Offset = 20
	err := env.store.Commit(ctx, env.fence, c)
	if !errors.Is(err, ErrLeaseLost) || errors.Is(err, ErrStaleGeneration) {
		t.Fatalf("Commit after revoke = %v, want ErrLeaseLost only", err)
	}
	want := fmt.Sprintf("offsets: commit by agent-2: registration lease %x is gone: the agent's session ended; it must stop consuming", int64(env.fence.Lease))
	if err.Error() != want {
		t.Errorf("error\n got %q\nwant %q", err, want)
	}
	var fe *FenceError
	if !errors.As(err, &fe) || fe.CurrentLease != clientv3.NoLease {
		t.Errorf("FenceError = %+v", fe)
	}
	if got := loadOffset(t, env.store, 3); got != 10 {
		t.Fatalf("offset after refused commit = %d, want 10", got)
	}

	// The agent re-registered on a new lease: the old fence still fails.
	lease, err := env.cli.Grant(ctx, 30)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := env.cli.Put(ctx, env.fence.AgentKey, "{}", clientv3.WithLease(lease.ID)); err != nil {
		t.Fatal(err)
	}
	err = env.store.Commit(ctx, env.fence, c)
	if !errors.Is(err, ErrLeaseLost) || !strings.Contains(err.Error(), fmt.Sprintf("now on lease %x", int64(lease.ID))) {
		t.Fatalf("Commit with the old lease = %v", err)
	}
	if got := loadOffset(t, env.store, 3); got != 10 {
		t.Fatalf("offset after refused commit = %d, want 10", got)
	}
}

func TestCommitFencedStaleGeneration(t *testing.T) {
	env := newFenceEnv(t)
	ctx := testCtx(t)
	c := []Commit{{Cluster: "A", Topic: "orders", Partition: 3, Offset: 10}}
	if err := env.store.Commit(ctx, env.fence, c); err != nil {
		t.Fatal(err)
	}
	resp, err := env.cli.Put(ctx, env.k.Assignment(), `{"generation":13}`)
	if err != nil {
		t.Fatal(err)
	}
	c[0].Offset = 20
	c = append(c, Commit{Cluster: "A", Topic: "orders", Partition: 4, Offset: 1})
	err = env.store.Commit(ctx, env.fence, c)
	if !errors.Is(err, ErrStaleGeneration) || errors.Is(err, ErrLeaseLost) {
		t.Fatalf("Commit after a new assignment = %v, want ErrStaleGeneration only", err)
	}
	want := fmt.Sprintf("offsets: commit orders/3 and 1 more by agent-2: generation 12 is stale (assignment changed at revision %d)", resp.Header.Revision)
	if err.Error() != want {
		t.Errorf("error\n got %q\nwant %q", err, want)
	}
	if got := loadOffset(t, env.store, 3); got != 10 {
		t.Fatalf("offset after refused commit = %d, want 10", got)
	}
	if got := loadOffset(t, env.store, 4); got != -1 {
		t.Fatalf("partition 4 written by a refused commit: %d", got)
	}

	// With the new revision the commit goes through.
	f := env.fence
	f.AssignmentRev, f.Generation = resp.Header.Revision, 13
	if err := env.store.Commit(ctx, f, c); err != nil {
		t.Fatal(err)
	}
	if got := loadOffset(t, env.store, 3); got != 20 {
		t.Fatalf("offset = %d, want 20", got)
	}

	// Deleted assignment and a lost lease at once: the lease wins.
	if _, err := env.cli.Delete(ctx, env.k.Assignment()); err != nil {
		t.Fatal(err)
	}
	err = env.store.Commit(ctx, f, c)
	if !errors.Is(err, ErrStaleGeneration) || !strings.Contains(err.Error(), "(assignment deleted)") {
		t.Fatalf("Commit after the assignment was deleted = %v", err)
	}
	if _, err := env.cli.Revoke(ctx, f.Lease); err != nil {
		t.Fatal(err)
	}
	err = env.store.Commit(ctx, f, c)
	if !errors.Is(err, ErrStaleGeneration) || !errors.Is(err, ErrLeaseLost) || !strings.Contains(err.Error(), "registration lease") {
		t.Fatalf("Commit with both fences failed = %v", err)
	}
}

// TestWrittenCountsWhatEtcdHolds: Written counts the positions and the
// bytes (keys and values) etcd stored, across the transactions of a large
// batch, and nothing of a commit the fence refused.
func TestWrittenCountsWhatEtcdHolds(t *testing.T) {
	env := newFenceEnv(t)
	ctx := testCtx(t)
	const n = DefaultMaxTxnOps + 7
	if err := env.store.Commit(ctx, env.fence, manyCommits(n, 100)); err != nil {
		t.Fatal(err)
	}
	resp, err := env.cli.Get(ctx, env.k.Offsets(), clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	size := 0
	for _, kv := range resp.Kvs {
		size += len(kv.Key) + len(kv.Value)
	}
	if got, bytes := env.store.Written(); got != n || bytes != int64(size) || len(resp.Kvs) != n {
		t.Fatalf("Written() = %d positions, %d bytes; etcd holds %d keys of %d bytes", got, bytes, len(resp.Kvs), size)
	}
	if _, err := env.cli.Put(ctx, env.k.Assignment(), `{"generation":13}`); err != nil {
		t.Fatal(err)
	}
	if err := env.store.Commit(ctx, env.fence, manyCommits(3, 900)); !errors.Is(err, ErrStaleGeneration) {
		t.Fatalf("Commit under a stale generation = %v", err)
	}
	if got, bytes := env.store.Written(); got != n || bytes != int64(size) {
		t.Errorf("a refused commit was counted: Written() = %d positions, %d bytes, want %d, %d", got, bytes, n, size)
	}
}

func manyCommits(n int, offset int64) []Commit {
	cs := make([]Commit, n)
	for i := range cs {
		cs[i] = Commit{Cluster: "A", Topic: "orders", Partition: int32(i), Offset: offset + int64(i) + 1, Fingerprints: []Fingerprint{Fingerprint(i)}}
	}
	return cs
}

func TestCommitLargeBatch(t *testing.T) {
	env := newFenceEnv(t)
	ctx := testCtx(t)
	// Also more than one page of List.
	const n = listPageSize + DefaultMaxTxnOps + 5
	if err := env.store.Commit(ctx, env.fence, manyCommits(n, 100)); err != nil {
		t.Fatal(err)
	}
	list, bad, err := env.store.List(ctx, "A")
	if err != nil || len(bad) != 0 || len(list) != n {
		t.Fatalf("List = %d positions, %v, %v; want %d", len(list), bad, err, n)
	}
	for i, p := range list {
		if p.Partition != int32(i) || p.Offset != 101+int64(i) {
			t.Fatalf("List[%d] = %s/%d@%d", i, p.Topic, p.Partition, p.Offset)
		}
	}
	tps := make([]TopicPartition, n)
	for i := range tps {
		tps[i] = TopicPartition{Topic: "orders", Partition: int32(i)}
	}
	many, bad, err := env.store.LoadMany(ctx, "A", tps)
	if err != nil || len(bad) != 0 || len(many) != n {
		t.Fatalf("LoadMany = %d positions, %v, %v", len(many), bad, err)
	}
}

// TestCommitAdaptsToServerTxnLimit: told the server takes more operations
// per transaction than it does, the store halves its transactions until
// they pass.
func TestCommitAdaptsToServerTxnLimit(t *testing.T) {
	env := newFenceEnv(t, withMaxTxnOps(1000))
	ctx := testCtx(t)
	if err := env.store.Commit(ctx, env.fence, manyCommits(600, 0)); err != nil {
		t.Fatal(err)
	}
	if got := env.store.maxOps.Load(); got > DefaultMaxTxnOps {
		t.Fatalf("transaction size after refusals = %d, want <= %d", got, DefaultMaxTxnOps)
	}
	if got := loadOffset(t, env.store, 599); got != 600 {
		t.Fatalf("last partition = %d", got)
	}
}

// TestCommitFenceFailsMidBatch: when the fence fails between the
// transactions of one call, the earlier ones stay written, the later ones
// are not, and the error says how many were.
func TestCommitFenceFailsMidBatch(t *testing.T) {
	env := newFenceEnv(t, withMaxTxnOps(2))
	ctx := testCtx(t)
	// Revoke the lease as soon as the first transaction lands; the call
	// has 200 more to go, so the revoke lands in the middle.
	wctx, wcancel := context.WithCancel(ctx)
	defer wcancel()
	wch := env.cli.Watch(wctx, env.k.Offsets(), clientv3.WithPrefix())
	errc := make(chan error, 1)
	go func() {
		if _, ok := <-wch; !ok {
			errc <- errors.New("watch closed")
			return
		}
		_, err := env.cli.Revoke(ctx, env.fence.Lease)
		errc <- err
	}()
	const n = 400
	err := env.store.Commit(ctx, env.fence, manyCommits(n, 0))
	if rerr := <-errc; rerr != nil {
		t.Fatal(rerr)
	}
	var fe *FenceError
	if !errors.As(err, &fe) || !fe.LeaseLost || fe.Committed == 0 || fe.Committed >= n || len(fe.Partitions) != 2 {
		t.Fatalf("Commit = %v (%+v), want a lease failure after some transactions", err, fe)
	}
	if !strings.Contains(err.Error(), fmt.Sprintf("; %d earlier commits of the same call were written", fe.Committed)) {
		t.Errorf("error does not say what was written: %v", err)
	}
	list, _, lerr := env.store.List(ctx, "A")
	if lerr != nil {
		t.Fatal(lerr)
	}
	if len(list) != fe.Committed {
		t.Fatalf("%d partitions written, error says %d", len(list), fe.Committed)
	}
	for i, p := range list {
		if p.Partition != int32(i) {
			t.Fatalf("written partitions are not the first %d: %d at %d", fe.Committed, p.Partition, i)
		}
	}
	t.Logf("fence failed after %d of %d commits: %v", fe.Committed, n, err)
}

func TestCommitRefusesInvalid(t *testing.T) {
	env := newFenceEnv(t)
	ctx := testCtx(t)
	for _, tc := range []struct {
		name string
		f    func(*Fence)
		c    Commit
	}{
		{"no lease", func(f *Fence) { f.Lease = clientv3.NoLease }, Commit{Cluster: "A", Topic: "t", Offset: 1}},
		{"no assignment revision", func(f *Fence) { f.AssignmentRev = 0 }, Commit{Cluster: "A", Topic: "t", Offset: 1}},
		{"no agent key", func(f *Fence) { f.AgentKey = "" }, Commit{Cluster: "A", Topic: "t", Offset: 1}},
		{"negative offset", nil, Commit{Cluster: "A", Topic: "t", Offset: -1}},
		{"negative partition", nil, Commit{Cluster: "A", Topic: "t", Partition: -1}},
		{"slash in topic", nil, Commit{Cluster: "A", Topic: "a/b", Offset: 1}},
		{"no cluster", nil, Commit{Topic: "t", Offset: 1}},
		{"too many fingerprints", nil, Commit{Cluster: "A", Topic: "t", Offset: 100, Fingerprints: make([]Fingerprint, MaxFingerprints+1)}},
		{"fingerprints before offset 0", nil, Commit{Cluster: "A", Topic: "t", Offset: 0, Fingerprints: []Fingerprint{1}}},
	} {
		f := env.fence
		if tc.f != nil {
			tc.f(&f)
		}
		good := Commit{Cluster: "A", Topic: "good", Offset: 1}
		if err := env.store.Commit(ctx, f, []Commit{good, tc.c}); err == nil {
			t.Errorf("%s: Commit succeeded", tc.name)
		}
	}
	if _, ok, err := env.store.Load(ctx, "A", "good", 0); ok || err != nil {
		t.Fatalf("a refused batch wrote its valid commit: %v, %v", ok, err)
	}
}

func TestMalformedValues(t *testing.T) {
	env := newFenceEnv(t)
	ctx := testCtx(t)
	if err := env.store.Commit(ctx, env.fence, []Commit{
		{Cluster: "A", Topic: "orders", Partition: 0, Offset: 5},
		{Cluster: "A", Topic: "orders", Partition: 2, Offset: 6},
	}); err != nil {
		t.Fatal(err)
	}
	bad := map[string]string{
		env.k.Offset("A", "orders", 1):  `{"offset":`,
		env.k.Offset("A", "orders", 3):  `{"offset":-4,"agent":"x"}`,
		env.k.Offset("A", "orders", 4):  `{"agent":"x"}`,
		env.k.Offset("A", "orders", 5):  `{"offset":100,"fingerprints":["1","2"]}`,
		env.k.Offset("A", "orders", 6):  `{"offset":100,"fingerprints":["0000000000000001","0000000000000001","0000000000000001","0000000000000001","0000000000000001","0000000000000001","0000000000000001","0000000000000001","0000000000000001"]}`,
		env.k.Offset("A", "orders", 7):  `{"offset":1}` + strings.Repeat(" ", MaxValueSize),
		env.k.Offsets() + "A/orders/08": `{"offset":1}`,
		env.k.Offsets() + "A/orders":    `{"offset":1}`,
		env.k.Offsets() + "A/x/y/1":     `{"offset":1}`,
	}
	for k, v := range bad {
		if _, err := env.cli.Put(ctx, k, v); err != nil {
			t.Fatal(err)
		}
	}

	for _, p := range []int32{1, 3, 4, 5, 6, 7} {
		key := env.k.Offset("A", "orders", p)
		_, ok, err := env.store.Load(ctx, "A", "orders", p)
		var me *MalformedError
		if ok || !errors.Is(err, ErrMalformed) || !errors.As(err, &me) || me.Key != key || !strings.Contains(err.Error(), key) {
			t.Errorf("Load(orders/%d) = %v, %v; want a MalformedError naming %s", p, ok, err, key)
		}
	}
	t.Logf("example: %v", func() error { _, _, err := env.store.Load(ctx, "A", "orders", 3); return err }())

	list, malformed, err := env.store.List(ctx, "A")
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 2 || list[0].Partition != 0 || list[1].Partition != 2 {
		t.Fatalf("List = %+v, want partitions 0 and 2", list)
	}
	var badKeys []string
	for _, me := range malformed {
		badKeys = append(badKeys, me.Key)
	}
	slices.Sort(badKeys)
	var wantKeys []string
	for k := range bad {
		wantKeys = append(wantKeys, k)
	}
	slices.Sort(wantKeys)
	if !slices.Equal(badKeys, wantKeys) {
		t.Fatalf("List reported malformed\n %v\nwant\n %v", badKeys, wantKeys)
	}

	// LoadMany reports the malformed values of the partitions asked for,
	// and keys under the asked topics' prefixes that are no partition key.
	many, malformed, err := env.store.LoadMany(ctx, "A", []TopicPartition{{Topic: "orders", Partition: 0}, {Topic: "orders", Partition: 1}})
	if err != nil || len(many) != 1 || many[TopicPartition{Topic: "orders", Partition: 0}].Offset != 5 {
		t.Fatalf("LoadMany = %v, %v", many, err)
	}
	badKeys = badKeys[:0]
	for _, me := range malformed {
		badKeys = append(badKeys, me.Key)
	}
	slices.Sort(badKeys)
	if want := []string{env.k.Offsets() + "A/orders/08", env.k.Offset("A", "orders", 1)}; !slices.Equal(badKeys, want) {
		t.Fatalf("LoadMany reported malformed %v, want %v", badKeys, want)
	}
}

func TestPrefixesMatchKeys(t *testing.T) {
	k := keys.New("f1")
	key := k.Offset("A", "orders", 12)
	if !strings.HasPrefix(key, k.TopicOffsets("A", "orders")) || !strings.HasPrefix(key, k.ClusterOffsets("A")) {
		t.Fatalf("%s does not start with %s", key, k.TopicOffsets("A", "orders"))
	}
	if strings.HasPrefix(k.Offset("A", "orders2", 1), k.TopicOffsets("A", "orders")) ||
		strings.HasPrefix(k.Offset("AB", "orders", 1), k.ClusterOffsets("A")) {
		t.Fatal("prefix matches a longer name")
	}
	s := NewStore(nil, k)
	tp, ok := s.parseKey("A", k.ClusterOffsets("A"), key)
	if !ok || tp != (TopicPartition{Topic: "orders", Partition: 12}) {
		t.Fatalf("parseKey = %v, %v", tp, ok)
	}
}

package offsets

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/keys"
)

// BenchmarkCommitCeiling: how many positions a second one etcd member
// takes from committers writing as fast as they can, each batch of 128
// positions with 8 fingerprints in one fenced transaction, as agents
// commit: for 1, 4 and 16 committers (agents) at once, 5 s each. This is
// the ceiling the fleets sharing an etcd cluster divide (their
// source.commit_budget_kib), on this machine's embedded member.
func BenchmarkCommitCeiling(b *testing.B) {
	for _, committers := range []int{1, 4, 16} {
		b.Run(fmt.Sprintf("committers=%d", committers), func(b *testing.B) {
			for range b.N {
				cli := testenv.EtcdClientT(b, testenv.StartEtcdT(b))
				k := keys.New("bench")
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				resp, err := cli.Put(ctx, k.Assignment(), `{"generation":1}`)
				if err != nil {
					b.Fatal(err)
				}
				store := NewStore(cli, k)
				fences := make([]Fence, committers)
				for i := range fences {
					id := fmt.Sprintf("agent-%02d", i)
					lease, err := cli.Grant(ctx, 60)
					if err != nil {
						b.Fatal(err)
					}
					if _, err := cli.Put(ctx, k.Agent(id), "{}", clientv3.WithLease(lease.ID)); err != nil {
						b.Fatal(err)
					}
					fences[i] = Fence{AgentKey: k.Agent(id), Lease: lease.ID, AssignmentKey: k.Assignment(), AssignmentRev: resp.Header.Revision, Agent: id, Generation: 1}
				}
				fps := make([]Fingerprint, 8)
				for i := range fps {
					fps[i] = Fingerprint(0x9e3779b97f4a7c15 * uint64(i+1))
				}
				const span = 5 * time.Second
				var (
					wg     sync.WaitGroup
					failed atomic.Int64
				)
				began := time.Now()
				for i, f := range fences {
					wg.Go(func() {
						batch := make([]Commit, DefaultMaxTxnOps)
						for off := int64(1); time.Since(began) < span; off++ {
							for p := range batch {
								batch[p] = Commit{Cluster: "A", Topic: fmt.Sprintf("t%03d", i), Partition: int32(p), Offset: off * 100, Timestamp: time.Now(), Fingerprints: fps}
							}
							if err := store.Commit(ctx, f, batch); err != nil {
								failed.Add(1)
								return
							}
						}
					})
				}
				wg.Wait()
				took := time.Since(began)
				if n := failed.Load(); n > 0 {
					b.Fatalf("%d committers failed", n)
				}
				positions, bytes := store.Written()
				b.ReportMetric(float64(positions)/took.Seconds(), "positions/s")
				b.ReportMetric(float64(bytes)/took.Seconds()/1e6, "MB/s")
				fmt.Printf("etcd ceiling %2d committers: %.0f positions/s, %.1f MB/s, %.0f B a position, in transactions of %d\n",
					committers, float64(positions)/took.Seconds(), float64(bytes)/took.Seconds()/1e6, float64(bytes)/float64(positions), DefaultMaxTxnOps)
			}
		})
	}
}

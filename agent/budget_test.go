package agent_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/offsets"
)

// commitLog records the position writes a watcher of offsets/ sees, with
// when it saw them.
type commitLog struct {
	mu     sync.Mutex
	writes []positionWrite
	cancel context.CancelFunc
	done   chan struct{}
}

type positionWrite struct {
	at    time.Time
	key   string
	bytes int
}

func watchCommits(t *testing.T, cli *clientv3.Client) *commitLog {
	ctx, cancel := context.WithCancel(context.Background())
	l := &commitLog{cancel: cancel, done: make(chan struct{})}
	ch := cli.Watch(clientv3.WithRequireLeader(ctx), fleetKeys.Offsets(), clientv3.WithPrefix())
	go func() {
		defer close(l.done)
		for resp := range ch {
			now := time.Now()
			l.mu.Lock()
			for _, ev := range resp.Events {
				if ev.Type == clientv3.EventTypePut {
					l.writes = append(l.writes, positionWrite{at: now, key: string(ev.Kv.Key), bytes: len(ev.Kv.Key) + len(ev.Kv.Value)})
				}
			}
			l.mu.Unlock()
		}
	}()
	t.Cleanup(l.stop)
	return l
}

func (l *commitLog) stop() {
	l.cancel()
	<-l.done
}

// between returns the bytes written in [from, to) and the partitions they
// were for.
func (l *commitLog) between(from, to time.Time) (bytes int, partitions map[string]bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	partitions = map[string]bool{}
	for _, w := range l.writes {
		if !w.at.Before(from) && w.at.Before(to) {
			bytes += w.bytes
			partitions[w.key] = true
		}
	}
	return bytes, partitions
}

// TestCommitBudgetBoundsEtcdWritesAndLosesNothing: 240 busy partitions
// committed every 100 ms would write about 700 kB/s to etcd; with
// source.commit_budget_kib 24 the fleet writes at most that (and not much
// less: the budget is used), every partition is still committed within a
// round of the budget, every position reaches etcd once the flow stops,
// and an agent that leaves commits its final positions at once, beyond
// the budget: nothing is handled twice and nothing is lost.
func TestCommitBudgetBoundsEtcdWritesAndLosesNothing(t *testing.T) {
	// Not parallel: it measures the rate of positions written against
	// the budget, which other tests' load would lower.
	const budgetKiB = 24
	f := startScaleFleet(t, 240, 3, scaleOptions{configure: func(c *config.Config) {
		c.Source.CommitInterval = 100 * time.Millisecond
		c.Source.CommitBudgetKiB = budgetKiB
	}})
	f.consuming(t, 60*time.Second, "A", f.agents...)
	cli := testenv.EtcdClientT(t, f.d.etcd)
	commits := watchCommits(t, cli)

	// Every partition takes records all along: 3000 records/s over 240
	// partitions is more than one a commit interval each.
	began := time.Now()
	f.flow(t, "flow", 3000, 7*time.Second)
	from, to := began.Add(2*time.Second), time.Now()
	bytes, parts := commits.between(from, to)
	rate := float64(bytes) / to.Sub(from).Seconds()
	budget := float64(budgetKiB * 1024)
	t.Logf("while 240 partitions were busy: %.0f B/s of positions to etcd (budget %.0f B/s), %d partitions committed in %v",
		rate, budget, len(parts), to.Sub(from).Round(time.Millisecond))
	if rate > 1.2*budget {
		t.Errorf("the fleet wrote %.0f B/s of positions, more than the budget of %.0f B/s", rate, budget)
	}
	if rate < 0.5*budget {
		t.Errorf("the fleet wrote %.0f B/s of positions, under half the budget of %.0f B/s: it commits less than it may", rate, budget)
	}
	// A round of 240 positions of about 300 bytes at 24 KiB/s is 3 s.
	if len(parts) != 240 {
		t.Errorf("%d of 240 partitions committed in %v: the budget starves some", len(parts), to.Sub(from).Round(time.Millisecond))
	}

	f.handledAll(t, 60*time.Second)
	waitAllCommitted(t, f, cli, 20*time.Second)

	// A burst in every partition, then an agent leaves at once: its
	// share commits 27 positions a second, not its 80, but its final
	// commits do not wait for the budget.
	f.produce(t, "leave", 40)
	f.handledAll(t, 60*time.Second)
	leaving := f.agents[len(f.agents)-1]
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	if err := leaving.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	cancel()
	rest := f.agents[:len(f.agents)-1]
	f.consuming(t, 60*time.Second, "A", rest...)
	f.produce(t, "after", 40)
	f.handledAll(t, 60*time.Second)
	if dups := f.l.duplicates(); dups != 0 {
		shown := f.l.dupDeliveries()
		t.Errorf("%d records handled twice after a clean leave under the budget, e.g. %v", dups, shown[:min(5, len(shown))])
	}
}

// waitAllCommitted waits until etcd holds, for every partition of A, the
// position at its end: nothing consumed stays uncommitted.
func waitAllCommitted(t *testing.T, f *scaleFleet, cli *clientv3.Client, timeout time.Duration) {
	t.Helper()
	client, err := sarama.NewClient(f.d.a.Brokers(), sarama.NewConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	ends := map[string]int64{}
	for _, topic := range slices.Sorted(maps.Keys(f.topicParts)) {
		for p := range f.topicParts[topic] {
			end, err := client.GetOffset(topic, p, sarama.OffsetNewest)
			if err != nil {
				t.Fatal(err)
			}
			ends[fmt.Sprintf("%s/%d", topic, p)] = end
		}
	}
	store := offsets.NewStore(cli, fleetKeys)
	wait.For(t, timeout, "every position committed", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		ps, _, err := store.List(ctx, "A")
		if err != nil {
			return err
		}
		at := map[string]int64{}
		for _, p := range ps {
			at[fmt.Sprintf("%s/%d", p.Topic, p.Partition)] = p.Offset
		}
		behind, first := 0, ""
		for tp, end := range ends {
			if at[tp] != end {
				if behind++; first == "" {
					first = fmt.Sprintf("%s at %d of %d", tp, at[tp], end)
				}
			}
		}
		if behind > 0 {
			return fmt.Errorf("%d positions behind, e.g. %s", behind, first)
		}
		return nil
	})
}

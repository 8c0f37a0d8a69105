package coordinator

import (
	"context"
	"fmt"
	"reflect"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// TestASwitchOfManyPartitionsIsRecorded: a failover of 8000 partitions
// lists more translations than etcd takes in one request (1.5 MiB by
// default; the embedded member keeps etcd's default). Its history entry is
// written all the same, the partitions in chunks, and read back whole; a
// small switch keeps its partitions in the event, as before.
func TestASwitchOfManyPartitionsIsRecorded(t *testing.T) {
	cli := testenv.EtcdClientT(t, testenv.StartEtcdT(t))
	k := keys.New("history")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	term := leadT(t, ctx, cli, k)

	event := func(epoch int64, n int) state.SwitchEvent {
		ev := state.SwitchEvent{Epoch: epoch, From: "A", To: "B", Reason: "failover: A unreachable", Started: time.Now().UTC(), Finished: time.Now().UTC(),
			Phases: map[string]float64{"revoke": 0.1, "translate": 0.3, "activate": 0.05}, Leader: term.ID, Token: term.Rev, Automatic: true}
		for i := range n {
			topic := fmt.Sprintf("t%03d", i/20)
			method := "fingerprint"
			if i%100 == 7 {
				method = "timestamp"
			}
			ev.Partitions = append(ev.Partitions, state.PartitionSwitch{Topic: topic, Origin: "A", FromTopic: topic, ToTopic: "A." + topic, Partition: int32(i % 20),
				FromOffset: int64(1000 + i), ToOffset: int64(1100 + i), Method: method, Rewound: 0, Lagged: int64(i % 3), ToEnd: int64(1200 + i),
				Detail: "the last 8 records committed found on the target by fingerprint"})
		}
		return ev
	}
	for _, c := range []struct {
		n      int
		chunks int
	}{{12, 0}, {8000, 8}} {
		want := event(int64(c.n), c.n)
		if err := writeHistory(ctx, term, k, want); err != nil {
			t.Fatalf("%d partitions: %v", c.n, err)
		}
		resp, err := cli.Get(ctx, k.HistoryEvent(want.Epoch))
		if err != nil || len(resp.Kvs) != 1 {
			t.Fatalf("%d partitions: history/%d not written: %v", c.n, want.Epoch, err)
		}
		got, err := state.ParseSwitchEvent(resp.Kvs[0].Value)
		if err != nil {
			t.Fatal(err)
		}
		if got.PartitionChunks != c.chunks {
			t.Errorf("%d partitions: %d chunks, want %d (event of %d bytes)", c.n, got.PartitionChunks, c.chunks, len(resp.Kvs[0].Value))
		}
		if c.chunks > 0 && (len(got.Partitions) != 0 || got.PartitionCount != c.n || got.Methods["fingerprint"] != 7920 || got.Methods["timestamp"] != 80) {
			t.Errorf("%d partitions: the event holds %d partitions, counts %d, methods %v", c.n, len(got.Partitions), got.PartitionCount, got.Methods)
		}
		if err := state.LoadPartitions(ctx, cli, k, &got); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got.Partitions, want.Partitions) {
			t.Errorf("%d partitions: read back %d, not the %d written", c.n, len(got.Partitions), len(want.Partitions))
		}
		// Switch events alone are under SwitchHistory: the chunks are not.
		all, err := cli.Get(ctx, k.SwitchHistory(), clientv3.WithPrefix(), clientv3.WithKeysOnly())
		if err != nil {
			t.Fatal(err)
		}
		for _, kv := range all.Kvs {
			if _, err := state.ParseSwitchEvent(mustGet(t, ctx, cli, string(kv.Key))); err != nil {
				t.Errorf("%s under history/0: %v", kv.Key, err)
			}
		}
	}

	// A stranger's count of chunks is refused before anything is
	// allocated for it.
	if _, err := state.ParseSwitchEvent([]byte(`{"epoch":9,"to":"B","partition_chunks":1000000000,"partition_count":1000000000}`)); err == nil {
		t.Error("an event claiming a billion chunks was accepted")
	}

	// A chunk missing (deleted by hand) is an error naming what is missing,
	// not a switch of fewer partitions.
	if _, err := cli.Delete(ctx, k.HistoryPartitionChunk(8000, 3)); err != nil {
		t.Fatal(err)
	}
	ev, err := state.ParseSwitchEvent(mustGet(t, ctx, cli, k.HistoryEvent(8000)))
	if err != nil {
		t.Fatal(err)
	}
	if err := state.LoadPartitions(ctx, cli, k, &ev); err == nil || len(ev.Partitions) != 0 {
		t.Errorf("a chunk deleted: read %d partitions, error %v; want an error", len(ev.Partitions), err)
	}
}

func mustGet(t *testing.T, ctx context.Context, cli *clientv3.Client, key string) []byte {
	t.Helper()
	resp, err := cli.Get(ctx, key)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("get %s: %v", key, err)
	}
	return resp.Kvs[0].Value
}

// leadT elects a leader for the fleet k and returns its term, which lasts
// until the test ends.
func leadT(t *testing.T, ctx context.Context, cli *clientv3.Client, k keys.Fleet) election.Term {
	t.Helper()
	s, err := concurrency.NewSession(cli, concurrency.WithTTL(5))
	if err != nil {
		t.Fatal(err)
	}
	c, err := election.NewCandidate(election.Config{Prefix: k.Election(), ID: "leader"})
	if err != nil {
		t.Fatal(err)
	}
	lctx, stop := context.WithCancel(ctx)
	terms, done := make(chan election.Term, 1), make(chan error, 1)
	go func() {
		done <- c.Campaign(lctx, s, func(tctx context.Context, term election.Term) {
			terms <- term
			<-tctx.Done()
		})
	}()
	t.Cleanup(func() {
		stop()
		<-done
		s.Close()
	})
	select {
	case term := <-terms:
		return term
	case err := <-done:
		t.Fatalf("not elected: %v", err)
	case <-ctx.Done():
		t.Fatal("not elected in time")
	}
	return election.Term{}
}

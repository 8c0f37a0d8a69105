package routing

import (
	"fmt"
	"testing"
	"time"

	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
)

// TestChannelRedefinedDuringAnOutageKeepsSourceOrder: the channel's
// definition changes (its compression, which the producer applies per
// batch: records of both codecs go through one producer) while its
// cluster is down and records wait, as an operator's routes change can
// land during an outage. Once the cluster is back, every source partition
// still reaches the channel in order: the records produced under the old
// definition do not come after newer ones produced under the new. A
// chaos run (seed 51: C stopped 15 s, the routes in force deleted meanwhile)
// put 58 records after later ones of their partition, none counted.
func TestChannelRedefinedDuringAnOutageKeepsSourceOrder(t *testing.T) {
	t.Parallel()
	for _, fault := range []string{"stop", "fail"} {
		t.Run(fault, func(t *testing.T) {
			w := newWorld(t, map[string][]string{"C": {"c"}}, "A", "C").withEtcd()
			w.cfg.Routing = Config{
				Rules:    []Rule{{Name: "all", Channels: []string{"c"}}},
				Channels: map[string]Channel{"c": {Cluster: "C", Topic: "c", Partitioner: PartitionerManual, Compression: "lz4"}},
			}
			r := w.start(nil)
			f := feed(r, 3, 2*time.Millisecond, nil)
			t.Cleanup(func() { f.stop() })
			wait.For(t, 10*time.Second, "records flowing", func() error {
				if n := w.acks.count("orders/"); n < 150 {
					return fmt.Errorf("%d acknowledged", n)
				}
				return nil
			})
			c := w.kafkas["C"]
			if fault == "stop" {
				c.Stop()
			} else {
				c.Fail()
			}
			waitFailing(t, r, "c")
			// The channel redefined while its records wait: no
			// compression, batches after the lz4 ones.
			w.waitVersion(w.put(keys.New(fleet).Channel("c"), "cluster: C\ntopic: c\npartitioner: manual-same-partition\n"))
			if fault == "stop" {
				if err := c.Restart(); err != nil {
					t.Fatal(err)
				}
			} else {
				c.Recover()
			}
			late, counted := w.orderAfterRecovery(r, f, fault)
			if late > 0 {
				t.Errorf("%d records reached the channel after a later one of their partition (%v counted by the router)", late, counted)
			}
		})
	}
}

package fleet

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
)

// TestSinkClustersChangeAtRunTime: the routing sink follows the dynamic
// configuration. A sink cluster moved to new brokers gets the records
// routed after the change there; a channel naming a cluster that does not
// exist yet is refused until the cluster is added in etcd, and then
// receives the records.
func TestSinkClustersChangeAtRunTime(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	w.cfg.Source.CommitInterval = 200 * time.Millisecond
	m := w.start(t)
	defer m.Stop(t.Context())
	cli := testenv.EtcdClientT(t, w.etcd)
	k := keys.New(fleet)
	put := func(key, val string) {
		t.Helper()
		if _, err := cli.Put(t.Context(), key, val); err != nil {
			t.Fatal(err)
		}
	}
	inForce := func(n int64) {
		t.Helper()
		wait.For(t, 15*time.Second, fmt.Sprintf("configuration version %d", n), func() error {
			if v := m.Agent().Status().Config.Version; v != n {
				return fmt.Errorf("version %d", v)
			}
			return nil
		})
	}
	const n = 100
	w.produce(t, n)
	w.waitDelivered(t, n)

	// C rebuilt behind new brokers.
	c2 := testenv.StartKafkaT(t, "C2", devstack.KafkaOptions{Topics: map[string]int32{"delivered": partitions}})
	put(k.ConfigCluster("C"), fmt.Sprintf("brokers: [%s]\nrole: sink\n", strings.Join(c2.Brokers(), ", ")))
	inForce(1)
	w.produce(t, n)
	wait.For(t, 20*time.Second, "the records after the move on C2", func() error {
		if got := records(t, c2, "delivered"); got != n {
			return fmt.Errorf("%d of %d on C2", got, n)
		}
		return nil
	})
	if got := w.delivered(t); got != n {
		t.Errorf("old C holds %d records, want %d: records after the move went to the old brokers", got, n)
	}

	// A channel on D, a cluster nobody configured yet: refused...
	d := testenv.StartKafkaT(t, "D", devstack.KafkaOptions{Topics: map[string]int32{"far": partitions}})
	put(k.Channel("far"), "cluster: D\ntopic: far\n")
	put(k.Routes(), "default: [far]\n")
	wait.For(t, 15*time.Second, "the routes naming D refused", func() error {
		if r := m.Router().Status().LastRefusal; r == nil || !r.Current || !strings.Contains(r.Reason, "D") {
			return fmt.Errorf("last refusal %+v", r)
		}
		return nil
	})
	// ...until D is added in etcd: the router compiles them again.
	put(k.ConfigCluster("D"), fmt.Sprintf("brokers: [%s]\nrole: sink\n", strings.Join(d.Brokers(), ", ")))
	inForce(2)
	wait.For(t, 15*time.Second, "routing to far in force", func() error {
		if v := m.Router().Version(); !slices.Contains(v.ChannelNames(), "far") {
			return fmt.Errorf("channels in force %v", v.ChannelNames())
		}
		return nil
	})
	w.produce(t, n)
	wait.For(t, 20*time.Second, "the records on D", func() error {
		if got := records(t, d, "far"); got != n {
			return fmt.Errorf("%d of %d on D", got, n)
		}
		return nil
	})
	if got := records(t, c2, "delivered"); got != n {
		t.Errorf("C2 holds %d records, want %d: the default route is far now", got, n)
	}
}

package coordinator

import (
	"maps"
	"testing"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/keys"
)

// TestAcksCountOnlyOnTheRegistrationsLease: an acknowledgement counts
// only when written on the lease of the named agent's registration and
// within the generations agents accept; the plan's view (upTo) also drops
// what is above the generation last published.
func TestAcksCountOnlyOnTheRegistrationsLease(t *testing.T) {
	k := keys.New("orders")
	leases := map[string]clientv3.LeaseID{"agent-1": 1, "agent-2": 2, "agent-3": 3}
	refused := 0
	ak := newAcks(k, func(id string) (clientv3.LeaseID, bool) { l, ok := leases[id]; return l, ok }, func() { refused++ }, zap.NewNop())
	kv := func(id, val string, lease int64) *mvccpb.KeyValue {
		return &mvccpb.KeyValue{Key: []byte(k.Ack(id)), Value: []byte(val), Lease: lease}
	}
	ak.Reset([]*mvccpb.KeyValue{
		kv("agent-1", "7", 1),                   // counts
		kv("agent-2", "7", 99),                  // another lease: a stranger's
		kv("agent-3", "4611686018427387904", 3), // over 2^53: no agent acks it
		kv("ghost", "7", 5),                     // not registered
		kv("agent-4", "x", 4),                   // malformed
	}, 0)
	if got, want := ak.snapshot(), map[string]int64{"agent-1": 7}; !maps.Equal(got, want) {
		t.Errorf("snapshot %v, want %v", got, want)
	}
	if refused != 3 { // agent-3's and agent-4's at once, agent-2's at the snapshot
		t.Errorf("%d refused, want 3", refused)
	}
	ak.snapshot()
	if refused != 3 {
		t.Errorf("agent-2's ack counted as refused again at the next snapshot (%d)", refused)
	}
	ak.Apply([]*clientv3.Event{{Type: clientv3.EventTypePut, Kv: kv("agent-2", "9", 2)}})
	if got, want := ak.snapshot(), map[string]int64{"agent-1": 7, "agent-2": 9}; !maps.Equal(got, want) {
		t.Errorf("snapshot after agent-2 acked on its lease %v, want %v", got, want)
	}
	if got, want := ak.upTo(8), map[string]int64{"agent-1": 7}; !maps.Equal(got, want) {
		t.Errorf("upTo(8) %v, want %v: an ack above the last published generation says nothing", got, want)
	}
	if m := maxAck(ak); m != 9 {
		t.Errorf("maxAck %d, want 9", m)
	}
}

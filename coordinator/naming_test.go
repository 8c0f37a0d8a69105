package coordinator

import (
	"testing"

	"github.com/kswitch/kswitch/config"
)

func namingOf(policy string) Naming {
	return NewNaming(config.Config{Clusters: map[string]config.Cluster{
		"A": {Role: config.RolePrimary},
		"B": {Role: config.RoleStandby, ReplicationPolicy: policy},
		"C": {Role: config.RoleSink},
	}})
}

// TestNamingBothWays: under the prefix policy a logical topic is its
// local topic plus the other source cluster's copy, on either cluster, and
// a stream keeps its origin across clusters.
func TestNamingBothWays(t *testing.T) {
	n := namingOf("")
	for _, tc := range []struct {
		cluster, topic string
		want           Stream
		elsewhere      string // the same stream's topic on the other cluster
	}{
		{"A", "orders", Stream{"orders", "A"}, "A.orders"},
		{"A", "B.orders", Stream{"orders", "B"}, "orders"},
		{"B", "A.orders", Stream{"orders", "A"}, "orders"},
		{"B", "orders", Stream{"orders", "B"}, "B.orders"},
		{"A", "B.", Stream{"B.", "A"}, "A.B."}, // no logical name after the alias: local
		{"B", "X.orders", Stream{"X.orders", "B"}, "B.X.orders"},
	} {
		s := n.Stream(tc.cluster, tc.topic)
		if s != tc.want {
			t.Errorf("Stream(%s, %s) = %+v, want %+v", tc.cluster, tc.topic, s, tc.want)
		}
		other := map[string]string{"A": "B", "B": "A"}[tc.cluster]
		if got := n.TopicOn(other, s); got != tc.elsewhere {
			t.Errorf("TopicOn(%s, %+v) = %s, want %s", other, s, got, tc.elsewhere)
		}
		if got := n.TopicOn(tc.cluster, s); got != tc.topic {
			t.Errorf("TopicOn(%s, %+v) = %s, want it back as %s", tc.cluster, s, got, tc.topic)
		}
		// A switch away from the stream's origin translates forward,
		// one towards it backward, along the flow into the other side.
		into, forward := n.Flow(tc.cluster, other, s)
		if wantFwd := s.Origin == tc.cluster; forward != wantFwd || (forward && into != other) || (!forward && into != tc.cluster) {
			t.Errorf("Flow(%s → %s, %+v) = into %s forward %v", tc.cluster, other, s, into, forward)
		}
	}
	if !n.FromStandby(Stream{"orders", "B"}) || n.FromStandby(Stream{"orders", "A"}) {
		t.Error("FromStandby: only B's streams are written on the standby")
	}
}

// TestNamingIdentityIsOneWay: under the identity policy every topic is
// the primary's, on both clusters.
func TestNamingIdentityIsOneWay(t *testing.T) {
	n := namingOf("identity")
	for _, c := range []string{"A", "B"} {
		if s := n.Stream(c, "orders"); s != (Stream{"orders", "A"}) {
			t.Errorf("Stream(%s, orders) = %+v, want the primary's", c, s)
		}
		if s := n.Stream(c, "B.orders"); s != (Stream{"B.orders", "A"}) {
			t.Errorf("Stream(%s, B.orders) = %+v, want a topic of that name", c, s)
		}
	}
	if got := n.TopicOn("B", Stream{"orders", "A"}); got != "orders" {
		t.Errorf("TopicOn(B, orders) = %s", got)
	}
}

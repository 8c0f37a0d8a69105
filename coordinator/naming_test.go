package coordinator

import (
	"testing"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/translate"
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
		r, dir, ok := n.Flow(tc.cluster, other, s)
		wantDir, wantTo := translate.Backward, tc.cluster
		if s.Origin == tc.cluster {
			wantDir, wantTo = translate.Forward, other
		}
		if !ok || dir != wantDir || r.To != wantTo {
			t.Errorf("Flow(%s → %s, %+v) = flow into %s, %v, %v; want the flow into %s, %v", tc.cluster, other, s, r.To, dir, ok, wantTo, wantDir)
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

// threeDC returns the naming of A (primary), B and D (standbys) with the
// given flows, all under the prefix policy.
func threeDC(flows ...[2]string) Naming {
	cfg := config.Config{Clusters: map[string]config.Cluster{
		"A": {Role: config.RolePrimary},
		"B": {Role: config.RoleStandby, Priority: 1},
		"D": {Role: config.RoleStandby, Priority: 2},
	}}
	for _, f := range flows {
		cfg.Replication = append(cfg.Replication, config.Flow{From: f[0], To: f[1]})
	}
	return NewNaming(cfg)
}

// TestNamingAlongAChain: in a chain A → B → D, D holds A's orders as
// B.A.orders, and a switch between A and D has no flow to translate
// with; B's own orders reach D as B.orders and A as B.orders.
func TestNamingAlongAChain(t *testing.T) {
	n := threeDC([2]string{"A", "B"}, [2]string{"B", "D"}, [2]string{"B", "A"}, [2]string{"D", "B"})
	for _, tc := range []struct {
		cluster, topic string
		want           Stream
	}{
		{"D", "B.A.orders", Stream{"orders", "A"}},
		{"D", "B.orders", Stream{"orders", "B"}},
		{"D", "orders", Stream{"orders", "D"}},
		{"B", "D.orders", Stream{"orders", "D"}},
		{"A", "B.D.orders", Stream{"orders", "D"}},
		{"D", "A.orders", Stream{"A.orders", "D"}}, // no flow A → D: a local topic of that name
	} {
		if s := n.Stream(tc.cluster, tc.topic); s != tc.want {
			t.Errorf("Stream(%s, %s) = %+v, want %+v", tc.cluster, tc.topic, s, tc.want)
		}
		if !n.Copy(tc.cluster, tc.topic) {
			t.Errorf("Copy(%s, %s) = false, want its stream's only copy there", tc.cluster, tc.topic)
		}
	}
	a := Stream{"orders", "A"}
	if got := n.TopicOn("D", a); got != "B.A.orders" {
		t.Errorf("TopicOn(D, A's orders) = %s, want B.A.orders", got)
	}
	if _, _, ok := n.Flow("A", "D", a); ok {
		t.Error("Flow(A → D) found a flow; the chain has none between its ends")
	}
	if r, dir, ok := n.Flow("D", "B", a); !ok || dir != translate.Backward || r.From != "B" || r.To != "D" {
		t.Errorf("Flow(D → B, A's orders) = %+v, %v, %v; want backward along B → D", r, dir, ok)
	}
	if !n.FromStandby(Stream{"orders", "D"}) || n.FromStandby(a) {
		t.Error("FromStandby: D's streams are written on a standby, A's are not")
	}
}

// TestNamingPicksOneCopyInAStar: a star that also copies B into D holds
// A's orders on D twice (A.orders, B.A.orders); the direct copy is the
// stream's, the other is not consumed.
func TestNamingPicksOneCopyInAStar(t *testing.T) {
	n := threeDC([2]string{"A", "B"}, [2]string{"A", "D"}, [2]string{"B", "D"}, [2]string{"B", "A"}, [2]string{"D", "A"})
	a := Stream{"orders", "A"}
	if got := n.TopicOn("D", a); got != "A.orders" {
		t.Errorf("TopicOn(D, A's orders) = %s, want A.orders", got)
	}
	if s := n.Stream("D", "B.A.orders"); s != a || n.Copy("D", "B.A.orders") {
		t.Errorf("Stream(D, B.A.orders) = %+v, Copy %v; want A's orders, not its copy on D", s, n.Copy("D", "B.A.orders"))
	}
	if !n.Copy("D", "A.orders") {
		t.Error("Copy(D, A.orders) = false")
	}
	// D's own orders reach B only through A.
	if got := n.TopicOn("B", Stream{"orders", "D"}); got != "A.D.orders" {
		t.Errorf("TopicOn(B, D's orders) = %s, want A.D.orders", got)
	}
	if r, dir, ok := n.Flow("D", "A", a); !ok || dir != translate.Backward || r.From != "A" || r.To != "D" {
		t.Errorf("Flow(D → A, A's orders) = %+v, %v, %v; want backward along A → D", r, dir, ok)
	}
}

// TestNamingIdentityChain: with identity copies A → B → D every copy keeps
// its name, and every topic on B and D is A's; a switch between A and D
// has no flow between them.
func TestNamingIdentityChain(t *testing.T) {
	n := NewNaming(config.Config{
		Clusters: map[string]config.Cluster{
			"A": {Role: config.RolePrimary},
			"B": {Role: config.RoleStandby, Priority: 1},
			"D": {Role: config.RoleStandby, Priority: 2},
		},
		Replication: []config.Flow{{From: "A", To: "B", Policy: "identity"}, {From: "B", To: "D", Policy: "identity"}},
	})
	a := Stream{"orders", "A"}
	for _, c := range []string{"A", "B", "D"} {
		if s := n.Stream(c, "orders"); s != a {
			t.Errorf("Stream(%s, orders) = %+v, want A's", c, s)
		}
		if got := n.TopicOn(c, a); got != "orders" {
			t.Errorf("TopicOn(%s, A's orders) = %s, want orders", c, got)
		}
	}
	if r, dir, ok := n.Flow("B", "D", a); !ok || dir != translate.Forward || r.From != "B" {
		t.Errorf("Flow(B → D) = %+v, %v, %v; want forward along B → D", r, dir, ok)
	}
	if _, _, ok := n.Flow("D", "A", a); ok {
		t.Error("Flow(D → A) found a flow; the chain has none between its ends")
	}
}

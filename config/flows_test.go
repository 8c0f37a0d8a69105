package config

import (
	"slices"
	"strings"
	"testing"
)

const threeDCPath = "../examples/three-dc.yaml"

// TestThreeDataCentresExample loads the star of the three-centre example:
// the order of failover is the primary, then the standbys by priority,
// and every flow is resolved with MirrorMaker 2's defaults.
func TestThreeDataCentresExample(t *testing.T) {
	c, err := Load(threeDCPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if got := c.Sources(); !slices.Equal(got, []string{"A", "B", "D"}) {
		t.Errorf("Sources() = %v, want [A B D]", got)
	}
	if name, _, _ := c.Standby(); name != "B" {
		t.Errorf("Standby() = %q, want B, the first by priority", name)
	}
	r, ok := c.Flow("A", "D")
	want := Replication{From: "A", To: "D", Policy: "prefix", SourceAlias: "A", OffsetSyncsTopic: "mm2-offset-syncs.A.internal",
		OffsetSyncsCluster: "D", CheckpointsTopic: "A.checkpoints.internal"}
	if !ok || r != want {
		t.Errorf("Flow(A, D) = %+v, %v, want %+v", r, ok, want)
	}
	if _, ok := c.Flow("B", "D"); ok {
		t.Error("Flow(B, D) exists; the star has none")
	}
	if n := len(c.Flows()); n != 4 {
		t.Errorf("%d flows, want 4", n)
	}
}

// TestStandbyOrderFollowsPriorityNotNames: priorities order the standbys,
// whatever their names.
func TestStandbyOrderFollowsPriorityNotNames(t *testing.T) {
	c := threeDC(t, func(c *Config) {
		editCluster(c, "B", func(b *Cluster) { b.Priority = 2 })
		editCluster(c, "D", func(d *Cluster) { d.Priority = 1 })
	})
	if got := c.Sources(); !slices.Equal(got, []string{"A", "D", "B"}) {
		t.Errorf("Sources() = %v, want [A D B]", got)
	}
}

// TestChainOfFlows: A -> B -> D validates; D is reached through B.
func TestChainOfFlows(t *testing.T) {
	threeDC(t, func(c *Config) {
		c.Replication = []Flow{{From: "A", To: "B"}, {From: "B", To: "D"}, {From: "B", To: "A"}}
	})
}

// TestBadFlowsAreRefused: each mistake in the list is named with its
// place and what to do, and nothing of the file is taken.
func TestBadFlowsAreRefused(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mutate func(*Config)
		want   string
	}{
		{"equal priorities", func(c *Config) { editCluster(c, "D", func(d *Cluster) { d.Priority = 1 }) },
			"clusters.D.priority: 1 is also the priority of B; the order of failover must be clear"},
		{"a priority on the primary", func(c *Config) { editCluster(c, "A", func(a *Cluster) { a.Priority = 1 }) },
			"clusters.A.priority: set on a primary; only standbys have a place in the order of failover"},
		{"a flow from a sink", func(c *Config) {
			c.Clusters["S"] = Cluster{Brokers: []string{"s:1"}, Role: RoleSink}
			c.Replication = append(c.Replication, Flow{From: "S", To: "A"})
		}, "replication[4].from: S is a sink; flows join source clusters (A, B, D)"},
		{"an unknown cluster", func(c *Config) { c.Replication[1].To = "E" }, `replication[1].to: "E" is not a cluster of clusters: (A, B, D)`},
		{"a flow into itself", func(c *Config) { c.Replication[1].To = "A" }, "replication[1]: a flow from A into itself"},
		{"a flow listed twice", func(c *Config) { c.Replication[1].To = "B" }, "replication[1]: the flow A → B is also replication[0]; list each flow once"},
		{"a standby nothing reaches", func(c *Config) { c.Replication = slices.Delete(c.Replication, 1, 2) },
			"replication: no flow brings A's topics to the standby D, directly or through another standby"},
		{"one alias for two flows into A", func(c *Config) { c.Replication[3].SourceAlias = "B" },
			`replication[3].source_alias: "B" is also the alias of the flow from B into A`},
		{"identity beside another flow in", func(c *Config) { c.Replication[2].Policy = "identity" },
			"replication[2].policy: identity copies keep their names, so they must be the only flow into A, which has 2"},
		{"identity copied back", func(c *Config) {
			c.Replication = []Flow{{From: "A", To: "B", Policy: "identity"}, {From: "A", To: "D"}, {From: "B", To: "A"}}
		}, "replication[0].policy: identity copies A would come back to A (replication[2] copies B into A)"},
		{"an identity chain back", func(c *Config) {
			c.Replication = []Flow{{From: "A", To: "B", Policy: "identity"}, {From: "B", To: "D", Policy: "identity"}, {From: "D", To: "A", Policy: "identity"}}
		}, "identity copies A would come back to A (a chain of identity flows from B ends in A)"},
		{"a bad policy", func(c *Config) { c.Replication[0].Policy = "mirror" }, `replication[0].policy: "mirror" is not a replication policy`},
		{"cluster fields beside the list", func(c *Config) { editCluster(c, "B", func(b *Cluster) { b.SourceAlias = "A" }) },
			"clusters.B: replication_policy, source_alias, offset_syncs_on, offset_syncs_topic and checkpoints_topic describe the flows of a fleet without a replication list"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := threeDC(t, nil)
			tc.mutate(&c)
			err := c.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Validate() = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// threeDC returns the three-centre example, changed by mutate and
// validated.
func threeDC(t *testing.T, mutate func(*Config)) Config {
	t.Helper()
	c, err := Load(threeDCPath)
	if err != nil {
		t.Fatal(err)
	}
	if mutate != nil {
		mutate(&c)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	return c
}

func editCluster(c *Config, name string, f func(*Cluster)) {
	cl := c.Clusters[name]
	f(&cl)
	c.Clusters[name] = cl
}

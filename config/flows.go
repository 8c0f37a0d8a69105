package config

import (
	"fmt"
	"maps"
	"slices"
	"strings"
)

// validateFlows checks the replication list: each flow joins two source
// clusters, once; the names of the copies on a cluster cannot collide;
// identity copies are one way and their target's only flow in; every
// standby gets the primary's topics, directly or through other standbys;
// and the clusters' own replication fields, which describe the flows of a
// fleet without the list, are empty.
func (c *Config) validateFlows(p *problems) {
	pairs := map[[2]string]int{}
	into := map[string][]Replication{}
	for i, f := range c.Replication {
		path := fmt.Sprintf("replication[%d]", i)
		known := c.flowEnd(p, path+".from", f.From) && c.flowEnd(p, path+".to", f.To)
		validateFlowFields(p, path, "policy", "<to>", f)
		switch j, dup := pairs[[2]string{f.From, f.To}]; {
		case !known:
			continue
		case f.From == f.To:
			p.add(path, "a flow from %s into itself; a flow copies one source cluster into another", f.From)
			continue
		case dup:
			p.add(path, "the flow %s → %s is also replication[%d]; list each flow once", f.From, f.To, j)
			continue
		}
		pairs[[2]string{f.From, f.To}] = i
		into[f.To] = append(into[f.To], f.resolve())
	}
	for _, to := range slices.Sorted(maps.Keys(into)) {
		c.validateFlowsInto(p, to, into[to], pairs)
	}
	c.validateReach(p, into)
	for _, name := range slices.Sorted(maps.Keys(c.Clusters)) {
		cl := c.Clusters[name]
		if c.IsSource(name) && cl.flowInto("", "", cl.ReplicationPolicy) != (Flow{}) {
			p.add("clusters."+name, "replication_policy, source_alias, offset_syncs_on, offset_syncs_topic and checkpoints_topic describe the flows of a fleet without a replication list; with one, write them in the flow's entry")
		}
	}
}

// flowEnd checks that name, a flow's end at path, is a source cluster.
func (c *Config) flowEnd(p *problems, path, name string) bool {
	cl, ok := c.Clusters[name]
	switch {
	case name == "":
		p.add(path, "required: the name of a source cluster (%s)", strings.Join(c.Sources(), ", "))
	case !ok:
		p.add(path, "%q is not a cluster of clusters: (%s)", name, strings.Join(c.Sources(), ", "))
	case !c.IsSource(name):
		p.add(path, "%s is a %s; flows join source clusters (%s)", name, cl.Role, strings.Join(c.Sources(), ", "))
	default:
		return true
	}
	return false
}

// validateFlowsInto checks the flows into one cluster: an identity flow is
// its only flow in and has no flow against it (identity copies keep their
// names, so they could not be told from the target's own topics, and
// copied back they would loop); prefix flows' aliases differ.
func (c *Config) validateFlowsInto(p *problems, to string, flows []Replication, pairs map[[2]string]int) {
	aliases := map[string]string{}
	for _, r := range flows {
		path := fmt.Sprintf("replication[%d]", pairs[[2]string{r.From, r.To}])
		if r.Policy == "identity" {
			if len(flows) > 1 {
				p.add(path+".policy", "identity copies keep their names, so they must be the only flow into %s, which has %d; use prefix", to, len(flows))
			}
			if loop := c.identityLoop(r, pairs); loop != "" {
				p.add(path+".policy", "identity copies %s would come back to %s (%s); remove that flow or use prefix", r.From, r.From, loop)
			}
			continue
		}
		if other, dup := aliases[r.SourceAlias]; dup {
			p.add(path+".source_alias", "%q is also the alias of the flow from %s into %s: their copies would have the same names; give each source its own alias", r.SourceAlias, other, to)
		}
		aliases[r.SourceAlias] = r.From
	}
}

// identityLoop returns the flow that brings the records of identity flow
// r back to r.From, "" when there is none: one from r.To to r.From, or a
// chain of identity flows from r.To that ends in r.From.
func (c *Config) identityLoop(r Replication, pairs map[[2]string]int) string {
	if i, back := pairs[[2]string{r.To, r.From}]; back {
		return fmt.Sprintf("replication[%d] copies %s into %s", i, r.To, r.From)
	}
	at := r.To
	for range len(c.Replication) {
		next := ""
		for _, f := range c.Replication {
			if f.From == at && f.Policy == "identity" {
				next = f.To
			}
		}
		switch next {
		case "":
			return ""
		case r.From:
			return fmt.Sprintf("a chain of identity flows from %s ends in %s", r.To, r.From)
		}
		at = next
	}
	return ""
}

// validateReach checks that every standby gets the primary's topics,
// directly or through other standbys: a standby without them would be
// failed over to with nothing to consume.
func (c *Config) validateReach(p *problems, into map[string][]Replication) {
	srcs := c.Sources()
	if len(srcs) == 0 || c.Clusters[srcs[0]].Role != RolePrimary {
		return
	}
	reached := map[string]bool{srcs[0]: true}
	for changed := true; changed; {
		changed = false
		for to, flows := range into {
			for _, r := range flows {
				if reached[r.From] && !reached[to] {
					reached[to], changed = true, true
				}
			}
		}
	}
	for _, s := range srcs[1:] {
		if !reached[s] {
			p.add("replication", "no flow brings %s's topics to the standby %s, directly or through another standby: add one, or make %s a sink", srcs[0], s, s)
		}
	}
}

package config

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/kswitch/kswitch/keys"
)

// The accepted values of the routing enums; the first of each is the
// default an empty value means.
var (
	RoutingModes        = []string{"first", "all"}
	RoutingRefused      = []string{"reference", "block"}
	RoutingPartitioners = []string{"hash", "random", "roundrobin", "manual-same-partition"}
	RoutingCompressions = []string{"none", "gzip", "snappy", "lz4", "zstd"}
	RoutingAcks         = []string{"all", "leader", "none"}
)

// KeepKey is the Key of a channel that keeps the record's own key.
const KeepKey = "keep"

// Check checks the structure of a routing layer against clusters: the
// enums, the names, that every channel a rule, the default route or the
// dead-letter names is defined, that every channel's cluster is one of
// clusters and its topic a Kafka topic name. It does not compile the
// expressions (the routing package does). Each error names its path
// relative to the section ("rules[1].channels[0]: ..."); nil when there is
// none.
//
// An empty Routing is valid: it routes nothing.
func (r Routing) Check(clusters map[string]Cluster) []error {
	var p routingProblems
	if r.Mode != "" {
		p.oneOf("mode", r.Mode, RoutingModes...)
	}
	if r.Refused != "" {
		p.oneOf("refused", r.Refused, RoutingRefused...)
	}
	for _, name := range slices.Sorted(maps.Keys(r.Channels)) {
		checkChannel(&p, "channels."+name, name, r.Channels[name], clusters)
	}
	defined := func(path, ch string) {
		if _, ok := r.Channels[ch]; !ok {
			p.add(path, "channel %q is not defined; define it under channels (or in etcd with 'kswitch routes apply')", ch)
		}
	}
	seen := map[string]int{}
	for i, rule := range r.Rules {
		path := fmt.Sprintf("rules[%d]", i)
		switch err := keys.ValidName(rule.Name); {
		case rule.Name == "":
			p.add(path+".name", "required: name the rule (it labels metrics and dead-letter headers)")
		case err != nil:
			p.add(path+".name", "%q %v", rule.Name, err)
		default:
			if j, dup := seen[rule.Name]; dup {
				p.add(path+".name", "%q is also the name of rules[%d]; rule names must be unique", rule.Name, j)
			} else {
				seen[rule.Name] = i
			}
		}
		switch {
		case rule.Drop && len(rule.Channels) > 0:
			p.add(path, "rule %q has both drop and channels; keep one", rule.Name)
		case !rule.Drop && len(rule.Channels) == 0:
			p.add(path, "rule %q has no channels; list the channels of the records it matches, or set drop: true", rule.Name)
		}
		for j, ch := range rule.Channels {
			defined(fmt.Sprintf("%s.channels[%d]", path, j), ch)
		}
	}
	for i, ch := range r.Default {
		defined(fmt.Sprintf("default[%d]", i), ch)
	}
	if r.DeadLetter != "" {
		defined("dead_letter", r.DeadLetter)
	}
	return p
}

// CheckChannel checks one channel definition named name against clusters,
// as Check does for each channel.
func CheckChannel(name string, ch RoutingChannel, clusters map[string]Cluster) []error {
	var p routingProblems
	checkChannel(&p, "", name, ch, clusters)
	return p
}

func checkChannel(p *routingProblems, path, name string, ch RoutingChannel, clusters map[string]Cluster) {
	at := func(field string) string {
		if path == "" {
			return field
		}
		return path + "." + field
	}
	if err := keys.ValidName(name); err != nil {
		p.add(orTop(path), "channel name %q %v; it is part of etcd keys (channels/<name>, signals/channel/<name>)", name, err)
	}
	switch _, ok := clusters[ch.Cluster]; {
	case ch.Cluster == "":
		p.add(at("cluster"), "required: name the cluster of the channel (one of %s)", clusterNames(clusters))
	case !ok:
		p.add(at("cluster"), "%q is not a configured cluster (configured: %s); add it under clusters (role sink for a destination only)", ch.Cluster, clusterNames(clusters))
	}
	switch {
	case ch.Topic == "":
		p.add(at("topic"), "required: name the destination topic")
	case !validTopicName(ch.Topic):
		p.add(at("topic"), "%q is not a Kafka topic name (letters, digits, '.', '_' and '-', at most 249)", ch.Topic)
	}
	if ch.Partitioner != "" {
		p.oneOf(at("partitioner"), ch.Partitioner, RoutingPartitioners...)
	}
	if ch.Compression != "" {
		p.oneOf(at("compression"), ch.Compression, RoutingCompressions...)
	}
	if ch.Acks != "" {
		p.oneOf(at("acks"), ch.Acks, RoutingAcks...)
	}
	if strings.TrimSpace(ch.Key) == "" && ch.Key != "" {
		p.add(at("key"), "blank; leave it empty (or write keep) to keep the record's key, or write an expression")
	}
}

func clusterNames(clusters map[string]Cluster) string {
	if len(clusters) == 0 {
		return "none"
	}
	return strings.Join(slices.Sorted(maps.Keys(clusters)), ", ")
}

// routingProblems collects routing errors with paths relative to the
// section; Validate prefixes them with "config: routing.".
type routingProblems []error

func (p *routingProblems) add(path, format string, args ...any) {
	*p = append(*p, fmt.Errorf("%s: %s", path, fmt.Sprintf(format, args...)))
}

func (p *routingProblems) oneOf(path, v string, allowed ...string) {
	if !slices.Contains(allowed, v) {
		p.add(path, "%q is not one of %s", v, strings.Join(allowed, ", "))
	}
}

// validateRouting checks the static routing layer. Expressions are
// compiled by the routing package when the agent starts.
func (c *Config) validateRouting(p *problems) {
	c.Routing.normalize()
	for _, err := range c.Routing.Check(c.Clusters) {
		*p = append(*p, fmt.Errorf("config: routing.%w", err))
	}
}

package config

import (
	"errors"
	"fmt"
	"maps"
	"net"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kswitch/kswitch/keys"
)

// MinSessionTTL is etcd's minimum lease TTL; a shorter TTL is silently
// raised by the server, so it is refused here instead.
const MinSessionTTL = 2 * time.Second

var (
	clusterNameRE  = regexp.MustCompile(`^[A-Za-z0-9._-]+$`)
	topicNameRE    = regexp.MustCompile(`^[A-Za-z0-9._-]+$`)
	kafkaVersionRE = regexp.MustCompile(`^(0\.\d+\.\d+\.\d+|[1-9]\d*\.\d+\.\d+)$`)
)

// Validate fills the defaults that can only be known at run time or per
// entry — agent.id (<hostname>-<pid>) and each cluster's version and
// client_id when empty — and then checks the whole configuration: every
// field and the timing relations between them. It returns every problem
// found, joined, each naming the field path and how to fix it. Call it
// after Apply, on the final values.
//
// The MirrorMaker 2 fields of a cluster (replication_policy, source_alias,
// offset_syncs_*, checkpoints_topic) matter only on the standby; on another
// cluster their values are checked but otherwise accepted and ignored, as
// Validate has no way to warn.
func (c *Config) Validate() error {
	if c.Agent.ID == "" {
		c.Agent.ID = defaultAgentID()
	}
	c.fillClusterDefaults()

	var p problems
	if c.Fleet == "" {
		p.add("fleet", "required: name the fleet, e.g. fleet: orders (its etcd keys live under /kswitch/<fleet>/)")
	} else if err := keys.ValidName(c.Fleet); err != nil {
		p.add("fleet", "%q %v; it is part of the etcd prefix /kswitch/<fleet>/", c.Fleet, err)
	}
	p.oneOf("log.format", c.Log.Format, "json", "console")
	p.oneOf("log.level", c.Log.Level, "debug", "info", "warn", "error")

	if err := keys.ValidName(c.Agent.ID); err != nil {
		p.add("agent.id", "%q %v; it is part of etcd keys", c.Agent.ID, err)
	}
	p.listenAddr("agent.http", c.Agent.HTTP)
	p.listenAddr("agent.gossip", c.Agent.Gossip)
	if c.Agent.GossipAdvertise != "" {
		p.hostPort("agent.gossip_advertise", c.Agent.GossipAdvertise)
	}
	p.oneOf("agent.death_detection", c.Agent.DeathDetection, "gossip", "lease")
	p.oneOf("agent.gossip_encryption", c.Agent.GossipEncryption, "auto", "off")
	if c.Agent.GossipEncryption == "off" && c.Agent.GossipKeyFile != "" {
		p.add("agent.gossip_encryption", "off, but agent.gossip_key_file is set: remove one of them")
	}
	if m := c.Agent.MemoryLimitMiB; m != 0 && (m < c.Source.MaxInFlightMiB+64 || m > 1<<20) {
		p.add("agent.memory_limit_mib", "%d leaves no room: the limit must be 0 (none) or between source.max_in_flight_mib + 64 = %d and 1048576 MiB (default 96)",
			m, c.Source.MaxInFlightMiB+64)
	}

	c.validateEtcd(&p)
	c.validateSecurity(&p)
	c.validateClusters(&p)
	c.validateSource(&p)

	c.validateFailover(&p)
	c.validateRouting(&p)
	return p.err()
}

func (c *Config) validateFailover(p *problems) {
	f := c.Failover
	p.positive("failover.probe_interval", f.ProbeInterval)
	if f.ProbeInterval > 0 && f.FailureWindow <= f.ProbeInterval {
		p.add("failover.failure_window", "%s must be longer than failover.probe_interval (%s) so that more than one probe decides",
			f.FailureWindow, f.ProbeInterval)
	}
	if p.positive("failover.probe_timeout", f.ProbeTimeout) && f.FailureWindow > 0 && f.ProbeTimeout > f.FailureWindow {
		p.add("failover.probe_timeout", "%q must not exceed failover.failure_window (%s): a probe that cannot time out inside the window cannot decide it; lower it or lengthen the window",
			f.ProbeTimeout, f.FailureWindow)
	}
	if f.HardFailureWindow < 0 || f.HardFailureWindow > f.FailureWindow {
		p.add("failover.hard_failure_window", "%s must be between 0 (hard failures wait for failover.failure_window too) and failover.failure_window (%s)",
			f.HardFailureWindow, f.FailureWindow)
	}
	if f.TimestampMargin < 0 {
		p.add("failover.timestamp_margin", "%q must not be negative; use 0s for no rewind", f.TimestampMargin)
	}
	p.oneOf("failover.failback", f.Failback, "auto", "manual")
	p.positive("failover.failback_stable", f.FailbackStable)
	if f.MaxFailedSwitches < 1 {
		p.add("failover.max_failed_switches", "%d must be at least 1 (the number of failed switches that trips the breaker)", f.MaxFailedSwitches)
	}
	p.positive("failover.breaker_window", f.BreakerWindow)
	p.positive("failover.breaker_cooldown", f.BreakerCooldown)
}

func (c *Config) validateEtcd(p *problems) {
	e := c.Etcd
	if len(e.Endpoints) == 0 {
		p.add("etcd.endpoints", "required: list at least one endpoint, e.g. [127.0.0.1:2379]")
	}
	for i, ep := range e.Endpoints {
		path := fmt.Sprintf("etcd.endpoints[%d]", i)
		if scheme, rest, ok := strings.Cut(ep, "://"); ok {
			u, err := url.Parse(ep)
			switch {
			case scheme != "http" && scheme != "https":
				p.add(path, "%q: the scheme must be http or https", ep)
			case err != nil || (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.User != nil:
				p.add(path, "%q: write host:port or http(s)://host:port, nothing more", ep)
			default:
				p.hostPort(path, strings.TrimSuffix(rest, "/"))
			}
			continue
		}
		p.hostPort(path, ep)
	}

	switch {
	case e.SessionTTL < MinSessionTTL:
		p.add("etcd.session_ttl", "%q is below etcd's minimum lease TTL of %s", e.SessionTTL, MinSessionTTL)
	case e.SessionTTL%time.Second != 0:
		p.add("etcd.session_ttl", "%q is not a whole number of seconds, which etcd lease TTLs are (e.g. %s)",
			e.SessionTTL, e.SessionTTL.Truncate(time.Second))
	}
	p.positive("etcd.dial_timeout", e.DialTimeout)
	if p.positive("etcd.request_timeout", e.RequestTimeout) && e.RequestTimeout >= e.SessionTTL {
		p.add("etcd.request_timeout", "%q must be shorter than etcd.session_ttl (%s), so that a failed request can be retried before the session expires",
			e.RequestTimeout, e.SessionTTL)
	}
}

func (c *Config) validateClusters(p *problems) {
	if len(c.Clusters) == 0 {
		p.add("clusters", "required: define at least one cluster, e.g. A: {brokers: [127.0.0.1:9092], role: primary}")
		return
	}
	names := slices.Sorted(maps.Keys(c.Clusters))
	byRole := map[Role]string{}
	var standbys []string
	folded := map[string]string{}
	for _, name := range names {
		cl := c.Clusters[name]
		path := "clusters." + name
		if !clusterNameRE.MatchString(name) {
			p.add(path, "cluster name %q may contain only letters, digits, '-', '_' and '.'", name)
		}
		if other, dup := folded[strings.ToLower(name)]; dup {
			p.add(path, "name differs from cluster %s only in case, which environment variables cannot tell apart; rename one", other)
		} else {
			folded[strings.ToLower(name)] = name
		}

		if len(cl.Brokers) == 0 {
			p.add(path+".brokers", "required: list at least one host:port")
		}
		for i, b := range cl.Brokers {
			p.hostPort(fmt.Sprintf("%s.brokers[%d]", path, i), b)
		}

		switch cl.Role {
		case RolePrimary:
			if other, dup := byRole[cl.Role]; dup {
				p.add(path+".role", "%q is also the role of cluster %s; exactly one cluster may be primary (set the other to standby or sink)", cl.Role, other)
			} else {
				byRole[cl.Role] = name
			}
		case RoleStandby:
			standbys = append(standbys, name)
		case RoleSink:
		case "":
			p.add(path+".role", "required: primary, standby or sink")
		default:
			p.add(path+".role", "%q is not a role; use primary, standby or sink", cl.Role)
		}

		validateCluster(p, path, cl)
	}
	if _, ok := byRole[RolePrimary]; !ok {
		p.add("clusters", "no cluster has role primary; set role: primary on the cluster consumed from normally")
	}
	c.validateOrder(p, byRole[RolePrimary], standbys)
}

// validateCluster checks one cluster's connection and delivery fields.
func validateCluster(p *problems, path string, cl Cluster) {
	if !kafkaVersionRE.MatchString(cl.Version) {
		p.add(path+".version", "%q is not a Kafka version; write e.g. %q (or 0.x.y.z before 1.0)", cl.Version, DefaultKafkaVersion)
	}
	if strings.ContainsFunc(cl.ClientID, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
		p.add(path+".client_id", "%q must not contain control characters", cl.ClientID)
	}
	if cl.Proxy != "" {
		if _, _, _, err := cl.Proxy.SOCKS5(); err != nil {
			p.add(path+".proxy", "%v", err)
		}
	}
	validateReplication(p, path, cl)
	switch cl.Delivery {
	case AtLeastOnce, ExactlyOnce:
	default:
		p.add(path+".delivery", "%q is not a delivery mode; use %s (the default) or %s", cl.Delivery, AtLeastOnce, ExactlyOnce)
	}
	if cl.TransactionInterval < 10*time.Millisecond || cl.TransactionInterval > time.Minute {
		p.add(path+".transaction_interval", "%s is outside 10ms-1m: it is how often an exactly_once transaction commits (records wait that long to be visible)", cl.TransactionInterval)
	}
	if cl.ExactlyOnce() && !transactional(cl.Version) {
		p.add(path+".delivery", "exactly_once needs Kafka transactions (0.11 or later); the cluster's version is %s", cl.Version)
	}
}

// validateOrder checks the standbys' order and MirrorMaker 2's flows
// between the source clusters: the replication list when there is one
// (required with more than one standby), else the clusters' own fields.
func (c *Config) validateOrder(p *problems, primary string, standbys []string) {
	c.validatePriorities(p, standbys)
	if len(c.Replication) > 0 {
		c.validateFlows(p)
		return
	}
	if len(standbys) > 1 {
		p.add("replication", "required with more than one standby (%s): list MirrorMaker 2's flows between the source clusters, each as from, to and its naming and topics", strings.Join(standbys, ", "))
		return
	}
	var standby string
	if len(standbys) == 1 {
		standby = standbys[0]
	}
	c.validateFlowBack(p, primary, standby)
}

// validatePriorities checks the standbys' order: with more than one, each
// states a priority of its own.
func (c *Config) validatePriorities(p *problems, standbys []string) {
	seen := map[int]string{}
	for _, name := range standbys {
		prio, path := c.Clusters[name].Priority, "clusters."+name+".priority"
		switch {
		case prio < 0:
			p.add(path, "%d is negative; priorities are 1, 2, … in order of failover", prio)
		case len(standbys) > 1 && prio == 0:
			p.add(path, "required with more than one standby (%s): 1 for the first a failover goes to, 2 for the next, …", strings.Join(standbys, ", "))
		case len(standbys) > 1 && seen[prio] != "":
			p.add(path, "%d is also the priority of %s; the order of failover must be clear: give each standby its own", prio, seen[prio])
		}
		seen[prio] = name
	}
	for _, name := range slices.Sorted(maps.Keys(c.Clusters)) {
		if cl := c.Clusters[name]; cl.Role != RoleStandby && cl.Priority != 0 {
			p.add("clusters."+name+".priority", "set on a %s; only standbys have a place in the order of failover (the primary comes first)", cl.Role)
		}
	}
}

// validateFlowBack checks the primary's replication fields, which describe
// the flow standby → primary: its policy is the standby's, and it exists
// only with the prefix policy.
func (c *Config) validateFlowBack(p *problems, primary, standby string) {
	if primary == "" {
		return
	}
	pc, path := c.Clusters[primary], "clusters."+primary
	if pc.ReplicationPolicy != "" && pc.ReplicationPolicy != "prefix" {
		p.add(path+".replication_policy", "%q on the primary: its replication fields describe MirrorMaker 2's copies of the standby's topics on it (B.orders), which exist only with the prefix policy; set the policy on the standby, and leave this empty or prefix", pc.ReplicationPolicy)
		return
	}
	if standby == "" || c.Clusters[standby].ReplicationPolicy != "identity" {
		return
	}
	if pc.ReplicationPolicy != "" || pc.SourceAlias != "" || pc.OffsetSyncsTopic != "" || pc.OffsetSyncsOn != "" || pc.CheckpointsTopic != "" {
		p.add(path, "replication fields on the primary describe a flow back from the standby, but clusters.%s.replication_policy is identity, which is one way (identity copies both ways would loop); remove them, or use the prefix policy", standby)
	}
}

// validateReplication checks the MirrorMaker 2 fields of a cluster. They
// matter on the standby and the primary, but are checked on every
// cluster: they are accepted (not refused) on a sink, as Validate cannot
// warn, and a bad value is wrong wherever it is.
func validateReplication(p *problems, path string, cl Cluster) {
	validateFlowFields(p, path, "replication_policy", "<name>", cl.flowInto("", "", cl.ReplicationPolicy))
}

// validateFlowFields checks a flow's naming and topics; policyField is the
// name of its policy's field under path, target how the default
// offset-syncs topic names the flow's target.
func validateFlowFields(p *problems, path, policyField, target string, f Flow) {
	switch f.Policy {
	case "", "prefix", "identity":
	default:
		p.add(path+"."+policyField, "%q is not a replication policy; use prefix (MirrorMaker 2's default: orders is replicated as <source_alias>.orders) or identity (IdentityReplicationPolicy: the same name), or leave it empty for prefix", f.Policy)
	}
	switch f.OffsetSyncsOn {
	case "", "source", "target":
	default:
		p.add(path+".offset_syncs_on", "%q is not one of source, target (where MirrorMaker 2's offset-syncs.topic.location puts the topic); leave it empty for source", f.OffsetSyncsOn)
	}
	if f.SourceAlias != "" && !validTopicName(f.SourceAlias) {
		p.add(path+".source_alias", "%q is not usable in Kafka topic names (letters, digits, '.', '_' and '-'); write MirrorMaker 2's alias of the cluster copied from, or leave it empty for its name", f.SourceAlias)
	}
	for _, t := range []struct{ field, value, def string }{
		{"offset_syncs_topic", f.OffsetSyncsTopic, "mm2-offset-syncs." + target + ".internal"},
		{"checkpoints_topic", f.CheckpointsTopic, "<source_alias>.checkpoints.internal"},
	} {
		if t.value != "" && !validTopicName(t.value) {
			p.add(path+"."+t.field, "%q is not a Kafka topic name (letters, digits, '.', '_' and '-', at most 249); leave it empty for the default %s", t.value, t.def)
		}
	}
}

// validTopicName reports whether s is a legal Kafka topic name.
func validTopicName(s string) bool {
	return topicNameRE.MatchString(s) && len(s) <= 249 && s != "." && s != ".."
}

func (c *Config) validateSource(p *problems) {
	s := c.Source
	if len(s.Topics) == 0 && s.TopicRegex == "" {
		p.add("source.topics", "required: list the topics to consume, or set source.topic_regex")
	}
	seen := map[string]bool{}
	for i, t := range s.Topics {
		path := fmt.Sprintf("source.topics[%d]", i)
		switch {
		case !validTopicName(t):
			p.add(path, "%q is not a Kafka topic name (letters, digits, '.', '_' and '-', at most 249)", t)
		case seen[t]:
			p.add(path, "%q is listed twice", t)
		}
		seen[t] = true
	}
	if s.TopicRegex != "" {
		if _, err := regexp.Compile(s.TopicRegex); err != nil {
			p.add("source.topic_regex", "%q does not compile: %v", s.TopicRegex, err)
		}
	}
	if s.Group == "" {
		p.add("source.group", "required: name the Kafka consumer group the offsets are mirrored to")
	}
	p.oneOf("source.initial_offset", s.InitialOffset, "oldest", "newest")
	p.positive("source.refresh_interval", s.RefreshInterval)
	p.positive("source.commit_interval", s.CommitInterval)
	if s.MaxInFlightMiB < 1 || s.MaxInFlightMiB > 1<<16 {
		p.add("source.max_in_flight_mib", "%d must be between 1 and 65536 (MiB of records handed on and not yet acknowledged; default 32)", s.MaxInFlightMiB)
	}
	if s.CommitBudgetKiB < 0 || s.CommitBudgetKiB > 1<<20 {
		p.add("source.commit_budget_kib", "%d must be between 0 (no bound) and 1048576 (KiB per second the fleet commits to etcd; default 512)", s.CommitBudgetKiB)
	}
}

// defaultAgentID is <hostname>-<pid>: unique on a host, and readable in
// etcd and logs.
func defaultAgentID() string {
	host, err := os.Hostname()
	if err != nil || keys.ValidName(host) != nil {
		host = "kswitch"
	}
	return fmt.Sprintf("%s-%d", host, os.Getpid())
}

// problems collects validation errors.
type problems []error

func (p *problems) add(path, format string, args ...any) {
	*p = append(*p, fmt.Errorf("config: %s: %s", path, fmt.Sprintf(format, args...)))
}

func (p problems) err() error { return errors.Join(p...) }

func (p *problems) oneOf(path, v string, allowed ...string) {
	if !slices.Contains(allowed, v) {
		p.add(path, "%q is not one of %s", v, strings.Join(allowed, ", "))
	}
}

// positive checks d > 0 and reports whether it is.
func (p *problems) positive(path string, d time.Duration) bool {
	if d <= 0 {
		p.add(path, "%q must be positive", d)
		return false
	}
	return true
}

// hostPort checks an address to connect to: a host and a port in 1-65535.
func (p *problems) hostPort(path, addr string) {
	host, port, err := net.SplitHostPort(addr)
	switch {
	case err != nil:
		p.add(path, "%q is not host:port (e.g. 127.0.0.1:9092)", addr)
	case host == "":
		p.add(path, "%q has no host", addr)
	case !validPort(port, false):
		p.add(path, "%q: port must be a number from 1 to 65535", addr)
	}
}

// listenAddr checks an address to listen on: the host may be empty (all
// interfaces) and port 0 asks for any free port.
func (p *problems) listenAddr(path, addr string) {
	_, port, err := net.SplitHostPort(addr)
	switch {
	case err != nil:
		p.add(path, "%q is not host:port (e.g. 127.0.0.1:0)", addr)
	case !validPort(port, true):
		p.add(path, "%q: port must be a number from 0 to 65535", addr)
	}
}

func validPort(s string, zeroOK bool) bool {
	n, err := strconv.ParseUint(s, 10, 16)
	return err == nil && (n > 0 || zeroOK)
}

// transactional reports whether Kafka version v (kafkaVersionRE) has
// transactions: 0.11 or later.
func transactional(v string) bool {
	rest, old := strings.CutPrefix(v, "0.")
	if !old {
		return true
	}
	minor, _, _ := strings.Cut(rest, ".")
	n, err := strconv.Atoi(minor)
	return err == nil && n >= 11
}

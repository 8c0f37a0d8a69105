// Package config is the kswitch agent's configuration: the YAML file, its
// defaults, the environment and command-line overrides, and validation.
//
// The life of a configuration is
//
//	c, err := config.Load(path)         // file over Default(); strict, not validated
//	err = overrides.Apply(&c, os.Environ()) // env, then explicitly set flags
//	err = c.Validate()                  // fills agent.id, reports every problem
//
// so the precedence of a value is flag > environment > file > default, and
// validation sees the final values only. Every leaf of the file (a string, a
// list of strings or a duration) has one environment variable,
// KSWITCH_<PATH> (the dotted YAML path upper-cased, '.' → '_'), and one flag,
// --<path>; both are derived from the yaml tags of Config, so a new field
// gets them by being declared. Cluster fields are set per cluster by
// KSWITCH_CLUSTERS_<NAME>_<FIELD> and --cluster NAME.field=value.
//
// Durations are Go duration strings ("5s", "500ms") everywhere; a bare number
// is refused because its unit would be a guess.
package config

import (
	"maps"
	"slices"
	"time"
)

// Role is what kswitch does with a Kafka cluster.
type Role string

const (
	// RolePrimary is the cluster consumed from while it is healthy.
	RolePrimary Role = "primary"
	// RoleStandby is the replica consumed from while the primary is down.
	RoleStandby Role = "standby"
	// RoleSink is a cluster that is only a routing destination.
	RoleSink Role = "sink"
)

// Defaults that have no home in Default() because they apply per cluster.
const (
	// DefaultKafkaVersion is the Kafka protocol version assumed for a cluster
	// that does not state one.
	DefaultKafkaVersion = "3.6.0"
	// DefaultClientID is the Kafka client.id of a cluster that does not state
	// one.
	DefaultClientID = "kswitch"
)

// Config is the whole agent configuration. The yaml tags are the file's
// schema and also name the environment variables and flags; the help tags
// are the one-line flag help (the default is appended from Default()).
//
// A Config shares its map and slices when copied; use Clone before handing
// one to code that may modify it.
type Config struct {
	// Fleet names the group of agents that share work; their etcd keys live
	// under /kswitch/<fleet>/. Required; no '/' or whitespace.
	Fleet    string             `yaml:"fleet" help:"fleet name; etcd keys live under /kswitch/<fleet>/ (required)"`
	Log      Log                `yaml:"log"`
	Agent    Agent              `yaml:"agent"`
	Etcd     Etcd               `yaml:"etcd"`
	Clusters map[string]Cluster `yaml:"clusters"`
	// Replication lists MirrorMaker 2's flows between the source
	// clusters, each once (replication.go). Required with more than one
	// standby; with one, the clusters' own replication fields describe
	// the flow into the standby and the flow back, and this stays empty.
	Replication []Flow   `yaml:"replication,omitempty" leaf:"-"`
	Source      Source   `yaml:"source"`
	Failover    Failover `yaml:"failover"`
	Routing     Routing  `yaml:"routing"`
}

// Log configures the agent's logger.
type Log struct {
	// Format is "json" (for log collectors) or "console" (for humans).
	Format string `yaml:"format" help:"log format: json or console"`
	// Level is the minimum level logged: debug, info, warn or error.
	Level string `yaml:"level" help:"log level: debug, info, warn or error"`
}

// Agent configures this agent's identity and listeners.
type Agent struct {
	// ID identifies the agent in etcd keys and gossip; it must be unique in
	// the fleet and stable across a restart only if the agent should find
	// its own registration again. Empty means <hostname>-<pid>, filled by
	// Validate.
	ID string `yaml:"id" help:"agent id, unique in the fleet (default <hostname>-<pid>)"`
	// HTTP is the host:port of the health, status and metrics listener.
	// Port 0 picks a free port.
	HTTP string `yaml:"http" help:"health/status/metrics listen address host:port"`
	// Gossip is the host:port memberlist binds to. Port 0 picks a free port.
	Gossip string `yaml:"gossip" help:"memberlist bind address host:port (port 0 = any free port)"`
	// GossipAdvertise is the host:port other agents use to reach this one,
	// for NAT or containers. Empty means the address actually bound for
	// Gossip.
	GossipAdvertise string `yaml:"gossip_advertise" help:"host:port other agents use to reach this agent's gossip (default: the bound gossip address)"`
	// GossipKeyFile is a file of memberlist encryption keys, base64, one
	// per line (16, 24 or 32 bytes: AES-128, -192 or -256). The first
	// encrypts what this agent sends; every one is tried on what it
	// receives, so keys rotate without a split: add the new key second on
	// every agent, then make it first everywhere, then remove the old one.
	// Empty: the fleet's key in etcd (GossipEncryption).
	GossipKeyFile string `yaml:"gossip_key_file" help:"file of base64 gossip encryption keys, one per line, the first used to send (empty: the fleet's key kept in etcd)"`
	// GossipEncryption is "auto" (the default): gossip is encrypted and
	// authenticated with the keys of GossipKeyFile when it is set, else
	// with the fleet's key kept in etcd (keys.Fleet.GossipKey), which the
	// first agent creates; packets without the key are dropped. "off"
	// sends and accepts plain gossip: anyone who reaches the gossip port
	// can then forge views and deaths (docs/SECURITY.md, "Gossip").
	GossipEncryption string `yaml:"gossip_encryption" help:"auto (encrypt gossip with gossip_key_file, else with the fleet's key kept in etcd) or off (plain gossip)"`
	// HTTPTLS turns the HTTP listener into HTTPS, optionally requiring
	// client certificates.
	HTTPTLS ServerTLS `yaml:"http_tls"`
	// DeathDetection is how the leader frees a dead agent's partitions:
	// "gossip" (memberlist declares it dead and the leader revokes its
	// session lease at once) or "lease" (only when its lease expires,
	// etcd.session_ttl after its last renewal). "lease" exists to measure
	// what gossip saves (make bench) and for networks where gossip is
	// unreliable.
	DeathDetection string `yaml:"death_detection" help:"gossip (a gossip-declared death revokes the agent's lease at once) or lease (wait for the lease to expire)"`
	// MemoryLimitMiB is the soft limit of the agent process's Go memory
	// (runtime/debug.SetMemoryLimit): the garbage collector works harder
	// as the heap nears it, so a busy agent's resident set stays about
	// this size plus the binary's pages, instead of twice its live heap.
	// The live heap is what source.max_in_flight_mib and the Kafka
	// clients' buffers hold, so it must leave room for them (at least
	// source.max_in_flight_mib + 64). 0: no limit. GOMEMLIMIT in the
	// environment, when set, wins. Only `kswitch agent` applies it: the
	// limit belongs to the process, not to an embedded agent.
	MemoryLimitMiB int `yaml:"memory_limit_mib" help:"soft limit of the agent process's Go memory in MiB, at least source.max_in_flight_mib + 64 (0: none; GOMEMLIMIT wins)"`
	// Pprof serves Go's runtime profiles (net/http/pprof) under
	// /debug/pprof/ on the HTTP listener, for finding where an agent's
	// CPU and memory go (go tool pprof http://host:port/debug/pprof/heap).
	// Off by default: a CPU profile costs CPU while it runs, and the
	// profiles name the code's functions to whoever reaches the listener
	// (agent.http_tls with client certificates keeps strangers out).
	Pprof bool `yaml:"pprof" help:"serve Go's runtime profiles under /debug/pprof/ on the HTTP listener (default off)"`
}

// Etcd configures the connection to etcd, the fleet's source of truth.
type Etcd struct {
	// Endpoints are host:port or http(s)://host:port. At least one.
	Endpoints []string `yaml:"endpoints" help:"etcd endpoints, host:port or http(s)://host:port (required)"`
	// SessionTTL is the TTL of the agent's lease: how long after an agent
	// stops renewing it before its registration, its partitions and (for
	// the leader) its leadership are released. Whole seconds, at least 2s.
	SessionTTL time.Duration `yaml:"session_ttl" help:"etcd session (lease) TTL, whole seconds, at least 2s"`
	// DialTimeout bounds establishing the connection.
	DialTimeout time.Duration `yaml:"dial_timeout" help:"etcd dial timeout"`
	// RequestTimeout bounds each etcd request; it must be shorter than
	// SessionTTL so a request can fail and be retried before the lease
	// expires.
	RequestTimeout time.Duration `yaml:"request_timeout" help:"timeout of each etcd request; must be below etcd.session_ttl"`
	// TLS secures the connection; an https:// endpoint turns it on too.
	TLS TLS `yaml:"tls"`
	// Username and Password (or PasswordFile) authenticate the agent to
	// etcd when etcd's auth is enabled. With a client certificate and no
	// username, etcd takes the user from the certificate's common name.
	Username string `yaml:"username" help:"etcd user (etcd auth); empty: none, or the client certificate's common name"`
	// Password is the etcd user's password; prefer PasswordFile.
	Password Secret `yaml:"password" help:"etcd password (prefer etcd.password_file)"`
	// PasswordFile is a file holding the password (a trailing newline is
	// dropped), such as a mounted secret. Exclusive with Password.
	PasswordFile string `yaml:"password_file" help:"file holding the etcd password; trailing newline dropped"`
}

// Cluster is one Kafka cluster, addressed by its name in Config.Clusters.
type Cluster struct {
	// Brokers are the bootstrap brokers, host:port. At least one.
	Brokers []string `yaml:"brokers" help:"bootstrap brokers host:port (required)"`
	// Role is primary, standby or sink.
	Role Role `yaml:"role" help:"primary, standby or sink (required)"`
	// Priority orders the standbys, lower first: a failover goes to the
	// most preferred standby a quorum of agents reaches, and a failback
	// returns to the most preferred healthy cluster (the primary before
	// every standby). Required, and distinct, when there is more than one
	// standby; with one it may stay 0.
	Priority int `yaml:"priority" help:"a standby's place in the order of failover, lower first (required with more than one standby)"`
	// Version is the Kafka protocol version the client speaks
	// (sarama's KafkaVersion syntax, e.g. "3.9.0").
	Version string `yaml:"version" help:"Kafka protocol version"`
	// ClientID is the Kafka client.id, visible in broker logs and quotas.
	ClientID string `yaml:"client_id" help:"Kafka client.id"`
	// TLS secures the connections to the brokers.
	TLS TLS `yaml:"tls"`
	// SASL authenticates to the brokers.
	SASL SASL `yaml:"sasl"`
	// Proxy is a SOCKS5 proxy (socks5://host:port, or with credentials
	// socks5://user:password@host:port) that every connection to the
	// cluster's brokers goes through: the bootstrap brokers and the
	// addresses they advertise, for a cluster reached through a bastion.
	// Empty: direct connections.
	Proxy ProxyURL `yaml:"proxy" help:"SOCKS5 proxy for every connection to the brokers: socks5://host:port or socks5://user:password@host:port (default: none)"`

	// The fields below describe how MirrorMaker 2 (or a replicator that
	// follows its conventions) fills this cluster with copies of the other
	// source cluster's topics. On the standby they describe the flow
	// primary → standby. On the primary they describe the flow back,
	// standby → primary, which a real data-centre outage needs: producers
	// that moved to the standby write its own topics, and MirrorMaker 2
	// copies them to the primary (B's orders as B.orders on A). The
	// policy is the standby's for both flows; the flow back exists only
	// with the prefix policy (identity replication both ways would loop).

	// ReplicationPolicy names the copies on this cluster: "prefix"
	// (MirrorMaker 2's default: topic orders of source alias A is A.orders)
	// or "identity" (IdentityReplicationPolicy: the same name, one way
	// only). Set it on the standby; on the primary it may only repeat
	// prefix.
	ReplicationPolicy string `yaml:"replication_policy" help:"topic naming of the copies on this cluster: prefix (A.orders) or identity (orders, one-way only); set on the standby"`
	// SourceAlias is the alias MirrorMaker 2 gives the cluster this one is
	// filled from, used by the prefix policy and in the internal topic
	// names. Default: that cluster's name in this file (on the standby
	// the primary's, on the primary the standby's).
	SourceAlias string `yaml:"source_alias" help:"MirrorMaker 2's alias of the cluster copied into this one (default: its name here)"`
	// OffsetSyncsTopic is MirrorMaker 2's offset-syncs topic of the flow
	// into this cluster. Default mm2-offset-syncs.<this cluster's
	// name>.internal on the source of the flow, or
	// mm2-offset-syncs.<source alias>.internal with OffsetSyncsOn target
	// (MirrorMaker 2 names it after the cluster at the other end).
	OffsetSyncsTopic string `yaml:"offset_syncs_topic" help:"MirrorMaker 2 offset-syncs topic of the flow into this cluster (default mm2-offset-syncs.<name>.internal, or mm2-offset-syncs.<source_alias>.internal with offset_syncs_on target)"`
	// OffsetSyncsOn is the cluster that holds the offset-syncs topic of
	// the flow into this one: "source" (MirrorMaker 2's default) or
	// "target" (offset-syncs.topic.location=target, readable when the
	// source is down).
	OffsetSyncsOn string `yaml:"offset_syncs_on" help:"where the offset-syncs topic of the flow into this cluster lives: source or target"`
	// CheckpointsTopic is MirrorMaker 2's checkpoints topic on this cluster.
	// Default <source alias>.checkpoints.internal.
	CheckpointsTopic string `yaml:"checkpoints_topic" help:"MirrorMaker 2 checkpoints topic (default <source_alias>.checkpoints.internal)"`

	// Delivery is how records reach the channels on this cluster:
	// at_least_once (the default: a record may be produced again after an
	// agent crashes) or exactly_once (each source partition's records are
	// produced in Kafka transactions that also write the partition's
	// position to PositionsTopic on this cluster; a new owner resumes
	// after the last committed transaction). Readers of the channels must
	// read with isolation.level=read_committed.
	Delivery string `yaml:"delivery" help:"at_least_once (default) or exactly_once: channels on this cluster get each record once, in Kafka transactions that also write the source position; readers must use read_committed"`
	// TransactionInterval is, with exactly_once, how often each source
	// partition's open transaction is committed: the delay before its
	// records are visible to read_committed readers and acknowledged.
	TransactionInterval time.Duration `yaml:"transaction_interval" help:"exactly_once: how often each source partition's transaction is committed (default 50ms)"`
}

// Delivery modes of a cluster's channels (Cluster.Delivery).
const (
	AtLeastOnce = "at_least_once"
	ExactlyOnce = "exactly_once"
)

// DefaultTransactionInterval is Cluster.TransactionInterval's default.
const DefaultTransactionInterval = 50 * time.Millisecond

// PositionsTopic is the compacted topic, on each exactly_once cluster,
// that holds the source positions committed with its transactions. Its
// name starts with "__" so that MirrorMaker 2's default topic filter
// does not copy it.
const PositionsTopic = "__kswitch.positions"

// ExactlyOnce reports whether the channels on c get exactly-once delivery.
func (c Cluster) ExactlyOnce() bool { return c.Delivery == ExactlyOnce }

// Source configures what the fleet consumes.
type Source struct {
	// Topics are consumed by name. Topics and/or TopicRegex is required.
	Topics []string `yaml:"topics" help:"topics to consume (this and/or source.topic_regex is required)"`
	// TopicRegex selects further topics by a Go (RE2) regular expression,
	// unanchored as with regexp.MatchString: write ^…$ to match whole names.
	TopicRegex string `yaml:"topic_regex" help:"Go regexp of further topics to consume, unanchored"`
	// Group is the Kafka consumer group the committed offsets are mirrored
	// to, so Kafka tooling (lag monitors) sees the fleet's progress.
	Group string `yaml:"group" help:"Kafka consumer group the offsets are mirrored to (required)"`
	// InitialOffset is where a partition with no committed offset starts:
	// "oldest" or "newest".
	InitialOffset string `yaml:"initial_offset" help:"start of a partition with no committed offset: oldest or newest"`
	// RefreshInterval is how often the leader re-reads topic metadata to
	// find new topics and partitions and re-created topics (one Metadata
	// request; every agent's probe sends the same one twice a second).
	RefreshInterval time.Duration `yaml:"refresh_interval" help:"interval of topic and partition discovery"`
	// CommitInterval is how often consumed positions are committed.
	CommitInterval time.Duration `yaml:"commit_interval" help:"interval of offset commits"`
	// MaxInFlightMiB bounds the bytes (keys, values and headers) of the
	// records an agent has handed to its handler and that are not yet
	// acknowledged, over all its partitions: the memory the relay holds
	// beyond sarama's own fetch buffers. A partition waits for room.
	MaxInFlightMiB int `yaml:"max_in_flight_mib" help:"MiB of records handed to the handler and not yet acknowledged, per agent"`
	// CommitBudgetKiB bounds the KiB per second the whole fleet writes to
	// etcd for its periodic commits (each busy partition's position, about
	// 300 bytes, every CommitInterval), so that etcd's write rate and
	// history do not grow with the partition count. Each agent takes the
	// share of the partitions it owns; when its busy partitions need more,
	// it commits the longest-uncommitted first and the others wait: a
	// partition's commits then come every busy partitions × bytes ÷ share
	// instead of every CommitInterval (more records are delivered again
	// after a crash, none is lost). Final commits of released partitions
	// are never delayed. Set the same value on every agent. 0: no bound.
	CommitBudgetKiB int `yaml:"commit_budget_kib" help:"KiB/s of positions the whole fleet commits to etcd; agents share it by owned partitions and commit their longest-uncommitted partitions first when over it (0: no bound)"`
}

// Failover configures the cluster health verdict.
type Failover struct {
	// ProbeInterval is how often every agent probes every cluster.
	ProbeInterval time.Duration `yaml:"probe_interval" help:"interval of cluster health probes"`
	// FailureWindow is how long a quorum of agents must fail to reach a
	// cluster before it is declared down; longer than ProbeInterval so that
	// more than one probe decides.
	FailureWindow time.Duration `yaml:"failure_window" help:"how long a cluster must be unreachable before it is declared down; must exceed failover.probe_interval"`
	// HardFailureWindow is the failure window of a hard failure: every
	// live agent's probe found every broker of the cluster refusing
	// connections (nothing listens: the brokers are down, not slow). 0
	// gives hard failures the FailureWindow too. Slow, hung or partial
	// failures always wait for FailureWindow.
	HardFailureWindow time.Duration `yaml:"hard_failure_window" help:"how long every agent must have seen the cluster refuse connections before it is declared down; 0: failover.failure_window"`
	// ProbeTimeout bounds each probe request (metadata, fetch).
	ProbeTimeout time.Duration `yaml:"probe_timeout" help:"timeout of each probe request"`
	// TimestampMargin is how far before the last consumed record's
	// timestamp the timestamp translation starts, to absorb clock and
	// ordering skew between the clusters. Larger: more duplicates; smaller:
	// risk of loss.
	TimestampMargin time.Duration `yaml:"timestamp_margin" help:"rewind of the timestamp offset translation"`
	// Failback is "auto" (return to the primary once it is healthy and
	// caught up) or "manual" (stay until an operator switches).
	Failback string `yaml:"failback" help:"auto or manual"`
	// FailbackStable is how long the primary must stay healthy before an
	// automatic failback.
	FailbackStable time.Duration `yaml:"failback_stable" help:"how long the primary must be healthy before failback"`
	// MaxFailedSwitches trips the circuit breaker: after this many switches
	// that failed or flapped within BreakerWindow, automatic switching
	// stops for BreakerCooldown.
	MaxFailedSwitches int `yaml:"max_failed_switches" help:"failed or flapping switches that trip the circuit breaker"`
	// BreakerWindow is the window in which failed switches are counted.
	BreakerWindow time.Duration `yaml:"breaker_window" help:"window in which failed switches are counted"`
	// BreakerCooldown is how long automatic switching stays off.
	BreakerCooldown time.Duration `yaml:"breaker_cooldown" help:"how long automatic switching stays off once the breaker trips"`
}

// Routing is the static layer of the routing sink: the rules that choose,
// for each consumed record, the channels it is produced to, and the
// channels. At run time etcd's dynamic layer (keys.Fleet.Routes() and
// keys.Fleet.Channel(name), written by 'kswitch routes apply') overrides it:
// the routes key, when present, replaces mode, rules, default and
// dead_letter as a whole; each channels/<name> key adds a channel or
// replaces the one of the same name.
//
// Rules and Channels are lists and maps of structures, which have no
// environment or flag syntax: they come from the file or from etcd only
// (their fields are tagged leaf:"-"). Mode, Default and DeadLetter are
// ordinary leaves.
type Routing struct {
	// Mode is how rules are evaluated: "first" (the first matching rule
	// decides) or "all" (every matching rule adds its channels).
	Mode string `yaml:"mode" help:"rule evaluation: first (the first matching rule decides) or all (every matching rule adds its channels)"`
	// Default are the channels of the records no rule matches. Empty: such
	// records are dropped (acknowledged without a produce, and counted).
	Default []string `yaml:"default" help:"channels of the records no rule matches; empty drops them (counted)"`
	// DeadLetter is the channel of the records whose rules or key
	// expression fail to evaluate, or whose produce is refused for good
	// (too large, invalid). Empty: such a record is not acknowledged and
	// its partition stops and reports instead of skipping it.
	DeadLetter string `yaml:"dead_letter" help:"channel of records that fail evaluation or are refused by the destination; empty stops the partition instead"`
	// Refused is what becomes of a record that the dead-letter channel
	// refuses for good too (larger than it accepts): "reference" (the
	// default) sends the dead-letter channel a reference instead (the
	// source coordinates, size, reason and headers, and the value cut to
	// 16 KiB) and moves on; "block" stops the record's partition until an
	// operator makes room (readiness names it).
	Refused string `yaml:"refused" help:"a record the dead-letter channel refuses too: reference (send a reference to it, cut to fit, and move on) or block (stop its partition)"`
	// Rules are evaluated in order. File or etcd only.
	Rules []RoutingRule `yaml:"rules" leaf:"-"`
	// Channels are the destinations, by name. File or etcd only.
	Channels map[string]RoutingChannel `yaml:"channels" leaf:"-"`
}

// Configured reports whether the routing section names any rule, channel
// or default route.
func (r Routing) Configured() bool {
	return len(r.Rules) > 0 || len(r.Channels) > 0 || len(r.Default) > 0 || r.DeadLetter != ""
}

// RoutingRule is one routing rule: records its Match expression accepts
// go to Channels, or nowhere when Drop is set.
type RoutingRule struct {
	// Name identifies the rule in metrics, logs and dead-letter headers.
	Name string `yaml:"name"`
	// Match is an expression (github.com/expr-lang/expr) over the record
	// that yields a bool; empty matches every record.
	Match string `yaml:"match"`
	// Channels receive the matching records.
	Channels []string `yaml:"channels"`
	// Drop sends the matching records nowhere (they are acknowledged).
	Drop bool `yaml:"drop"`
}

// RoutingChannel is one destination: a topic on a cluster of Clusters.
type RoutingChannel struct {
	// Name is the channel's name: its key in Routing.Channels, or the last
	// element of its etcd key. It is not part of the YAML.
	Name string `yaml:"-"`
	// Cluster names a cluster of Config.Clusters (any role).
	Cluster string `yaml:"cluster"`
	// Topic is the destination topic on Cluster.
	Topic string `yaml:"topic"`
	// Key is "keep" (the record's own key; the default when empty) or an
	// expression whose value becomes the key (nil: no key).
	Key string `yaml:"key"`
	// Partitioner is hash (murmur2 of the key, as the Java client; the
	// default), random, roundrobin or manual-same-partition (the source
	// partition number).
	Partitioner string `yaml:"partitioner"`
	// Compression is none (the default), gzip, snappy, lz4 or zstd.
	Compression string `yaml:"compression"`
	// Acks is all (the default: idempotent producer), leader or none.
	Acks string `yaml:"acks"`
}

// Default returns a configuration with every default filled in. It has no
// fleet, etcd endpoints, clusters, topics or group, which have no sensible
// default, and no agent id, which Validate derives from the host.
func Default() Config {
	return Config{
		Log: Log{Format: "json", Level: "info"},
		Agent: Agent{
			HTTP:             "127.0.0.1:8080",
			Gossip:           "127.0.0.1:7946",
			DeathDetection:   "gossip",
			MemoryLimitMiB:   96,
			GossipEncryption: "auto",
		},
		Etcd: Etcd{
			SessionTTL:     5 * time.Second,
			DialTimeout:    3 * time.Second,
			RequestTimeout: 2 * time.Second,
		},
		Clusters: map[string]Cluster{},
		Source: Source{
			InitialOffset:   "oldest",
			RefreshInterval: time.Second,
			CommitInterval:  time.Second,
			MaxInFlightMiB:  32,
			CommitBudgetKiB: 512,
		},
		Failover: Failover{
			ProbeInterval:     500 * time.Millisecond,
			FailureWindow:     3 * time.Second,
			HardFailureWindow: 500 * time.Millisecond,
			ProbeTimeout:      time.Second,
			TimestampMargin:   5 * time.Second,
			Failback:          "auto",
			FailbackStable:    30 * time.Second,
			MaxFailedSwitches: 3,
			BreakerWindow:     5 * time.Minute,
			BreakerCooldown:   10 * time.Minute,
		},
		Routing: Routing{Mode: "first"},
	}
}

// defaultCluster is the value a cluster starts from before the file or an
// override sets its fields.
func defaultCluster() Cluster {
	return Cluster{Version: DefaultKafkaVersion, ClientID: DefaultClientID, Delivery: AtLeastOnce, TransactionInterval: DefaultTransactionInterval}
}

// fillClusterDefaults sets the defaults of cluster fields left empty, so that
// clusters built in code, as well as from the file, need only brokers and a
// role.
func (c *Config) fillClusterDefaults() {
	for name, cl := range c.Clusters {
		d := defaultCluster()
		if cl.Version == "" {
			cl.Version = d.Version
		}
		if cl.ClientID == "" {
			cl.ClientID = d.ClientID
		}
		if cl.Delivery == "" {
			cl.Delivery = d.Delivery
		}
		if cl.TransactionInterval == 0 {
			cl.TransactionInterval = d.TransactionInterval
		}
		c.Clusters[name] = cl
	}
}

// Clone returns a deep copy of c, which the caller may modify without
// affecting c.
func (c Config) Clone() Config {
	c.Etcd.Endpoints = slices.Clone(c.Etcd.Endpoints)
	c.Source.Topics = slices.Clone(c.Source.Topics)
	if c.Clusters != nil {
		c.Clusters = maps.Clone(c.Clusters)
		for name, cl := range c.Clusters {
			cl.Brokers = slices.Clone(cl.Brokers)
			c.Clusters[name] = cl
		}
	}
	c.Replication = slices.Clone(c.Replication)
	c.Routing = c.Routing.Clone()
	return c
}

// Clone returns a deep copy of r.
func (r Routing) Clone() Routing {
	r.Default = slices.Clone(r.Default)
	if r.Rules != nil {
		r.Rules = slices.Clone(r.Rules)
		for i := range r.Rules {
			r.Rules[i].Channels = slices.Clone(r.Rules[i].Channels)
		}
	}
	r.Channels = maps.Clone(r.Channels)
	return r
}

// normalize sets each channel's Name to its key in the channels map, and
// makes empty rules and channels nil, so that "rules: []" and no rules are
// the same configuration.
func (r *Routing) normalize() {
	if len(r.Rules) == 0 {
		r.Rules = nil
	}
	if len(r.Channels) == 0 {
		r.Channels = nil
	}
	for name, ch := range r.Channels {
		ch.Name = name
		r.Channels[name] = ch
	}
}

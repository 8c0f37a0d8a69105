package routing

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/expr-lang/expr"
	"github.com/expr-lang/expr/ast"
	"github.com/expr-lang/expr/file"
	"github.com/expr-lang/expr/vm"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/kafka"
)

// Rule is one routing rule; see config.RoutingRule.
type Rule = config.RoutingRule

// Channel is one destination; see config.RoutingChannel.
type Channel = config.RoutingChannel

// Config is a routing layer: mode, rules, default route, dead-letter
// channel and channels; see config.Routing.
type Config = config.Routing

// The modes of rule evaluation.
const (
	ModeFirst = "first"
	ModeAll   = "all"
)

// The partitioners of a channel.
const (
	PartitionerHash       = "hash"
	PartitionerRandom     = "random"
	PartitionerRoundRobin = "roundrobin"
	PartitionerManual     = "manual-same-partition"
)

// Version is a compiled, validated routing configuration. It is immutable
// and safe for concurrent use.
type Version struct {
	// Number is the etcd revision of the last change of the dynamic layer
	// this version includes; 0 for the configuration file alone.
	Number int64
	// Since is when the version came into force (zero until then).
	Since time.Time
	// Source says where it came from: "file", or "file+etcd" when etcd's
	// routes key or a channel key contributed.
	Source string

	spec       Config // the merged layers, defaults filled in
	rules      []*rule
	channels   map[string]*channel
	defaults   []*channel
	deadLetter *channel
	needs      needs
	// decisions holds, when every rule's match reads nothing but where a
	// record comes from (its cluster, topic and partition), the decision
	// of each partition seen: the rules run once per partition, not once
	// per record. Nil otherwise. Keyed by partitionKey, values *decision.
	decisions *sync.Map
	// recent holds the decision last made for each partition number
	// modulo its length, looked up before decisions: a few loads and
	// comparisons of strings that share their bytes, where the map hashes
	// the key.
	recent *[64]atomic.Pointer[keptDecision]
}

type rule struct {
	name     string
	match    *vm.Program // nil: every record
	channels []*channel
	drop     bool
	matches  prometheus.Counter // set by the Router that installs the version
}

// channel is a compiled channel.
type channel struct {
	Channel             // defaults filled in
	key     *vm.Program // nil: keep the record's key
	dest    dest
	pkey    producerKey
	ds      *destState // set by the Router that installs the version
	// pr is the producer last acquired for the channel, tried first by
	// pool.acquireFor.
	pr atomic.Pointer[producer]
}

// dest identifies where a channel's records go. Failures are tracked per
// dest, so a channel redefined to another cluster or topic does not wait
// for the records still bound for its old destination.
type dest struct {
	channel, cluster, topic string
}

func (d dest) String() string { return fmt.Sprintf("%s (%s/%s)", d.channel, d.cluster, d.topic) }

// Spec returns the merged configuration of the version, with every default
// filled in (a copy).
func (v *Version) Spec() Config { return v.spec.Clone() }

// Mode returns "first" or "all".
func (v *Version) Mode() string { return v.spec.Mode }

// RuleNames returns the rules' names in order.
func (v *Version) RuleNames() []string {
	out := make([]string, len(v.rules))
	for i, r := range v.rules {
		out[i] = r.name
	}
	return out
}

// ChannelNames returns the channels' names, sorted.
func (v *Version) ChannelNames() []string { return slices.Sorted(maps.Keys(v.channels)) }

// DeadLetter returns the dead-letter channel's name, or "".
func (v *Version) DeadLetter() string {
	if v.deadLetter == nil {
		return ""
	}
	return v.deadLetter.Name
}

// producers returns the producers of the channels the version can route
// to: those its rules, default route and dead-letter name. A channel
// defined but not named keeps no producer open.
func (v *Version) producers() map[producerKey]bool {
	out := map[producerKey]bool{}
	for _, r := range v.rules {
		for _, ch := range r.channels {
			out[ch.pkey] = true
		}
	}
	for _, ch := range v.defaults {
		out[ch.pkey] = true
	}
	if v.deadLetter != nil {
		out[v.deadLetter.pkey] = true
	}
	return out
}

// Compile validates spec against clusters and compiles it. The error lists
// every problem, one per line, each naming its path ("rules[1].match: ...").
// The returned version has Number 0 and a zero Since; the Router sets them.
func Compile(spec Config, clusters map[string]config.Cluster) (*Version, error) {
	spec = spec.Clone()
	for name, ch := range spec.Channels {
		ch.Name = name
		spec.Channels[name] = ch
	}
	var errs []error
	errs = append(errs, spec.Check(clusters)...)
	spec.Mode = cmp.Or(spec.Mode, ModeFirst)

	v := &Version{Source: "file", channels: map[string]*channel{}}
	clusterNames := slices.Sorted(maps.Keys(clusters))
	var w usage
	for _, name := range slices.Sorted(maps.Keys(spec.Channels)) {
		c, cerrs := compileChannel(name, spec.Channels[name], clusters, clusterNames, &w)
		spec.Channels[name] = c.Channel
		v.channels[name] = c
		errs = append(errs, cerrs...)
	}
	for i, r := range spec.Rules {
		cr := &rule{name: r.Name, drop: r.Drop}
		if strings.TrimSpace(r.Match) != "" {
			p, err := compileExpr(r.Match, expr.AsBool())
			if err == nil {
				err = tryProbes(p, r.Match, clusterNames)
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("rules[%d].match: %s", i, exprError(err)))
			} else {
				cr.match = p
				w.walk(p, true)
			}
		}
		for _, name := range r.Channels {
			if c := v.channels[name]; c != nil && !slices.Contains(cr.channels, c) {
				cr.channels = append(cr.channels, c)
			}
		}
		v.rules = append(v.rules, cr)
	}
	for _, name := range spec.Default {
		if c := v.channels[name]; c != nil && !slices.Contains(v.defaults, c) {
			v.defaults = append(v.defaults, c)
		}
	}
	v.deadLetter = v.channels[spec.DeadLetter]
	if len(errs) > 0 {
		return nil, &InvalidError{Problems: errs}
	}
	v.spec = spec
	v.needs = w.needs
	if !w.perRecord {
		v.decisions = new(sync.Map)
		v.recent = new([64]atomic.Pointer[keptDecision])
	}
	return v, nil
}

// compileChannel fills ch's defaults and compiles its key expression
// (its uses noted in w), and returns the channel with the problems found,
// each naming its path.
func compileChannel(name string, ch Channel, clusters map[string]config.Cluster, clusterNames []string, w *usage) (*channel, []error) {
	var errs []error
	ch.Key = cmp.Or(strings.TrimSpace(ch.Key), config.KeepKey)
	ch.Partitioner = cmp.Or(ch.Partitioner, PartitionerHash)
	ch.Compression = cmp.Or(ch.Compression, "none")
	ch.Acks = cmp.Or(ch.Acks, "all")
	c := &channel{Channel: ch, dest: dest{name, ch.Cluster, ch.Topic}, pkey: producerKey{cluster: ch.Cluster, acks: ch.Acks}}
	if ch.Key != config.KeepKey {
		p, err := compileExpr(ch.Key)
		if err == nil {
			err = tryProbes(p, ch.Key, clusterNames)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("channels.%s.key: %s", name, exprError(err)))
		} else {
			c.key = p
			w.walk(p, false)
		}
	}
	if cl, ok := clusters[ch.Cluster]; ok {
		if _, err := ProducerConfig(cl, ch.Compression, ch.Acks); err != nil {
			errs = append(errs, fmt.Errorf("channels.%s: %v", name, err))
		}
		if cl.ExactlyOnce() && (ch.Acks != "all" || ch.Compression != "none") {
			// One transactional producer carries a source partition's
			// records to every channel of the cluster: its settings
			// are the cluster's, not the channel's.
			errs = append(errs, fmt.Errorf("channels.%s: cluster %s is exactly_once, whose transactions need acks all and, for now, no compression (channel has acks %s, compression %s)",
				name, ch.Cluster, ch.Acks, ch.Compression))
		}
	}
	return c, errs
}

// InvalidError is the error of a version that does not validate.
type InvalidError struct {
	// Problems are the reasons, each naming its path.
	Problems []error
}

func (e *InvalidError) Error() string {
	lines := make([]string, len(e.Problems))
	for i, p := range e.Problems {
		lines[i] = p.Error()
	}
	return strings.Join(lines, "\n")
}

// Unwrap returns the problems.
func (e *InvalidError) Unwrap() []error { return e.Problems }

// exprError renders an expression's compile error on one line.
func exprError(err error) string {
	var fe *file.Error
	if errors.As(err, &fe) {
		return fmt.Sprintf("%s (column %d)", fe.Message, fe.Column+1)
	}
	return err.Error()
}

// usage finds which parts of the environment the expressions read, so
// that a record's environment is built with only those, and whether the
// rules' matches read anything that changes from record to record.
type usage struct {
	needs
	// perRecord is set when a rule's match reads more than the record's
	// cluster, topic and partition (any other name, even a variable of
	// its own, counts), or calls now().
	perRecord bool
	inMatch   bool // walking a rule's match
}

type needs struct {
	key, value, json, headers bool
}

// walk records what p reads; match says p is a rule's match expression.
func (u *usage) walk(p *vm.Program, match bool) {
	n := p.Node()
	u.inMatch = match
	ast.Walk(&n, u)
}

// Visit implements ast.Visitor.
func (u *usage) Visit(n *ast.Node) {
	switch x := (*n).(type) {
	case *ast.BuiltinNode:
		if x.Name == "now" && u.inMatch {
			u.perRecord = true
		}
	case *ast.IdentifierNode:
		switch x.Value {
		case "key", "Key":
			u.key = true
		case "value", "Value":
			u.value = true
		case "json", "JSON":
			u.json = true
		case "headers", "Headers":
			u.headers = true
		}
		switch x.Value {
		case "topic", "partition", "cluster", "physical_topic", "origin", budgetVar, stepFunc:
		default:
			if u.inMatch {
				u.perRecord = true
			}
		}
	}
}

// producerRetryMax is the retries of an idempotent sarama producer
// configured by ProducerConfig: about 20 minutes at one a second. sarama
// keeps a slice of that length per partition (32 KiB), so it is no
// larger.
const producerRetryMax = 1200

// producerBackoff is the wait before an idempotent sarama producer's n-th
// retry: 100 ms doubling to 1 s.
func producerBackoff(n, _ int) time.Duration {
	return min(100*time.Millisecond<<min(n, 4), time.Second)
}

// ProducerConfig returns a sarama producer configuration for a cluster
// with a channel's compression and acks (empty means the defaults, none
// and all): internal/kafka's client settings and timeouts, successes and
// errors returned, and with acks all the idempotent producer
// (RequiredAcks WaitForAll, one open request per broker). Compile checks
// each channel's settings against its cluster with it (acks all needs
// Kafka 0.11). The router does not produce through sarama: this is for
// programs that want a sarama AsyncProducer set as a channel is (the
// benchmarks' baseline loops, integration/tools/relayloop). Its
// partitioner is sarama's murmur2 hash, which places a keyed record where
// the router's hash partitioner does (kafka.HashPartition).
func ProducerConfig(c config.Cluster, compression, acks string) (*sarama.Config, error) {
	sc, err := kafka.Config(c)
	if err != nil {
		return nil, err
	}
	sc.Producer.Return.Successes = true
	sc.Producer.Return.Errors = true
	sc.Producer.Retry.Max = 3
	sc.Producer.Retry.Backoff = 100 * time.Millisecond
	sc.Producer.Timeout = 10 * time.Second
	sc.Producer.Partitioner = sarama.NewMurmur2Partitioner
	switch cmp.Or(acks, "all") {
	case "all":
		sc.Producer.RequiredAcks = sarama.WaitForAll
		sc.Producer.Idempotent = true
		sc.Net.MaxOpenRequests = 1
		// The idempotent producer keeps a partition's order through its
		// own retries, and only through them: a message it gave up on
		// would be sent again behind later ones. So it retries a failing
		// destination for about 20 minutes (every second at most), and
		// gives up sooner only on errors about the record itself, or
		// when it is closed.
		sc.Producer.Retry.Max = producerRetryMax
		sc.Producer.Retry.BackoffFunc = producerBackoff
		if !sc.Version.IsAtLeast(sarama.V0_11_0_0) {
			return nil, fmt.Errorf("acks all uses the idempotent producer, which needs Kafka 0.11 or later (the cluster's version is %s); use acks leader", sc.Version)
		}
	case "leader":
		sc.Producer.RequiredAcks = sarama.WaitForLocal
	case "none":
		sc.Producer.RequiredAcks = sarama.NoResponse
	default:
		return nil, fmt.Errorf("acks %q is not one of %s", acks, strings.Join(config.RoutingAcks, ", "))
	}
	switch cmp.Or(compression, "none") {
	case "none":
		sc.Producer.Compression = sarama.CompressionNone
	case "gzip":
		sc.Producer.Compression = sarama.CompressionGZIP
	case "snappy":
		sc.Producer.Compression = sarama.CompressionSnappy
	case "lz4":
		sc.Producer.Compression = sarama.CompressionLZ4
	case "zstd":
		sc.Producer.Compression = sarama.CompressionZSTD
	default:
		return nil, fmt.Errorf("compression %q is not one of %s", compression, strings.Join(config.RoutingCompressions, ", "))
	}
	if err := sc.Validate(); err != nil {
		return nil, fmt.Errorf("producer configuration: %w", err)
	}
	return sc, nil
}

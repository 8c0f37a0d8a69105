package mirror

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"
)

// FillerHeader is the header key of the filler records that
// Config.TargetPrefill writes. Its value is the target's name.
const FillerHeader = "kswitch-filler"

// Config configures a Mirror. Start copies it and fills in defaults; the
// zero value of each optional field means its default.
type Config struct {
	// Source and Target are the two clusters' bootstrap brokers (host:port).
	// Required.
	Source, Target []string

	// SourceName and TargetName name the clusters in logs and errors.
	// Default "source" and "target".
	SourceName, TargetName string

	// Topics are the source topics to copy, every partition of each. They
	// must exist on the source when Start is called. Required.
	Topics []string

	// RemoteTopic names a source topic's copy on the target, e.g.
	// config.Replication.RemoteTopic ("orders" → "A.orders"). It must map
	// distinct topics to distinct names. Default: the same name.
	RemoteTopic func(string) string

	// Version is the Kafka protocol version spoken to both clusters, at
	// least 0.11 (record batches with headers). Default sarama.V3_6_0_0.
	Version sarama.KafkaVersion

	// OffsetSyncsTopic, when set, is the topic to which the mirror writes a
	// MirrorMaker 2 offset-sync record for every copied record (see the
	// package comment), on the source cluster or, with OffsetSyncsOnTarget,
	// on the target (MirrorMaker 2's offset-syncs.topic.location=target).
	// Default "": no offset-syncs.
	OffsetSyncsTopic    string
	OffsetSyncsOnTarget bool

	// TargetPrefill, when > 0, makes Start write that many filler records
	// (header FillerHeader) into each target partition before copying, so
	// that target offsets differ from source offsets and offset translation
	// tests cannot pass by accident. Default 0.
	TargetPrefill int

	// RetryBackoff is the first wait after a failed round (a cluster
	// unreachable, a request refused); each further failure doubles it up
	// to RetryBackoffMax, and a good round resets it. Defaults 50 ms and
	// 1 s.
	RetryBackoff, RetryBackoffMax time.Duration

	// FetchMaxWait is how long a source broker may hold a fetch when it
	// has no new records: the copy latency of an idle mirror is at most
	// this. Default 100 ms.
	FetchMaxWait time.Duration

	// PartitionRefresh, when > 0, is how often the mirror looks for
	// partitions added to its source topics, as MirrorMaker 2 does every
	// refresh.topics.interval.seconds: it grows the remote topic to the
	// source topic's count (CreatePartitions on the target), writes
	// TargetPrefill filler records to each new partition and copies it
	// from its start. Default 0: partitions added after Start are not
	// copied.
	PartitionRefresh time.Duration

	// Logger receives state changes at info (started, stopped, stalled,
	// resumed) and warn (data that could not be copied exactly), and every
	// copied batch at debug. Default: no logs.
	Logger *zap.Logger
}

const (
	defaultRetryBackoff    = 50 * time.Millisecond
	defaultRetryBackoffMax = time.Second
	defaultFetchMaxWait    = 100 * time.Millisecond

	// requestTimeout bounds every request to a cluster (sarama's
	// Net.ReadTimeout); FetchMaxWait must stay well below it.
	requestTimeout = 5 * time.Second
	dialTimeout    = 3 * time.Second
)

// withDefaults returns a copy of c with defaults filled in and its slices
// copied, so that the caller may reuse its own.
func (c Config) withDefaults() Config {
	c.Source = slices.Clone(c.Source)
	c.Target = slices.Clone(c.Target)
	c.Topics = slices.Clone(c.Topics)
	if c.SourceName == "" {
		c.SourceName = "source"
	}
	if c.TargetName == "" {
		c.TargetName = "target"
	}
	if c.RemoteTopic == nil {
		c.RemoteTopic = func(t string) string { return t }
	}
	if c.Version == (sarama.KafkaVersion{}) {
		c.Version = sarama.V3_6_0_0
	}
	if c.RetryBackoff <= 0 {
		c.RetryBackoff = defaultRetryBackoff
	}
	if c.RetryBackoffMax <= 0 {
		c.RetryBackoffMax = max(defaultRetryBackoffMax, c.RetryBackoff)
	}
	if c.FetchMaxWait <= 0 {
		c.FetchMaxWait = defaultFetchMaxWait
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return c
}

// Validate reports what is wrong with c once defaults are filled in.
func (c Config) Validate() error {
	c = c.withDefaults()
	var errs []error
	if len(c.Source) == 0 {
		errs = append(errs, errors.New("no source brokers"))
	}
	if len(c.Target) == 0 {
		errs = append(errs, errors.New("no target brokers"))
	}
	if len(c.Topics) == 0 {
		errs = append(errs, errors.New("no topics"))
	}
	remote := make(map[string]string, len(c.Topics))
	sameCluster := slices.Equal(slices.Sorted(slices.Values(c.Source)), slices.Sorted(slices.Values(c.Target)))
	for _, t := range c.Topics {
		r := c.RemoteTopic(t)
		switch {
		case t == "":
			errs = append(errs, errors.New("empty topic name"))
		case r == "":
			errs = append(errs, fmt.Errorf("topic %s: RemoteTopic gives an empty name", t))
		case remote[r] != "":
			errs = append(errs, fmt.Errorf("topics %s and %s both map to %s on the target", remote[r], t, r))
		case sameCluster && r == t:
			errs = append(errs, fmt.Errorf("topic %s would be copied onto itself (source and target are the same cluster)", t))
		}
		remote[r] = t
		if t == c.OffsetSyncsTopic || (r == c.OffsetSyncsTopic && c.OffsetSyncsOnTarget) {
			errs = append(errs, fmt.Errorf("topic %s collides with the offset-syncs topic", t))
		}
	}
	if !c.Version.IsAtLeast(sarama.V0_11_0_0) {
		errs = append(errs, fmt.Errorf("version %s: need at least 0.11 (record headers)", c.Version))
	}
	if c.TargetPrefill < 0 {
		errs = append(errs, fmt.Errorf("TargetPrefill %d is negative", c.TargetPrefill))
	}
	if c.RetryBackoffMax < c.RetryBackoff {
		errs = append(errs, fmt.Errorf("RetryBackoffMax %v < RetryBackoff %v", c.RetryBackoffMax, c.RetryBackoff))
	}
	if c.PartitionRefresh < 0 {
		errs = append(errs, fmt.Errorf("PartitionRefresh %v is negative", c.PartitionRefresh))
	}
	if c.FetchMaxWait > requestTimeout/2 {
		errs = append(errs, fmt.Errorf("FetchMaxWait %v: at most %v", c.FetchMaxWait, requestTimeout/2))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("mirror: config: %w", err)
	}
	return nil
}

// saramaConfig is the client configuration for one cluster. Like
// internal/kafka.Config it bounds every call, and it dials through d so that
// Stop can cut every connection.
func (c Config) saramaConfig(d *dialer) *sarama.Config {
	sc := sarama.NewConfig()
	sc.Version = c.Version
	sc.ClientID = "kswitch-mirror"
	sc.Net.DialTimeout = dialTimeout
	sc.Net.ReadTimeout = requestTimeout
	sc.Net.WriteTimeout = requestTimeout
	sc.Net.Proxy.Enable = true // the only way to give sarama a dialer
	sc.Net.Proxy.Dialer = d
	sc.Metadata.Retry.Max = 1
	sc.Metadata.Retry.Backoff = 100 * time.Millisecond
	sc.Metadata.Timeout = requestTimeout
	sc.Metadata.AllowAutoTopicCreation = false
	return sc
}

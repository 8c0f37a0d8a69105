package devstack

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/internal/freeport"
)

// adminTimeout bounds AddPartitions, which goes over the wire.
const adminTimeout = 10 * time.Second

// KafkaOptions configures StartKafka. The zero value is a one-broker cluster
// on a free port, in memory, with no topics.
type KafkaOptions struct {
	// Brokers is the number of brokers. Default 1. When Ports is set it
	// must be 0 or len(Ports).
	Brokers int

	// Ports fixes the brokers' ports, one per broker. Default: free ports
	// chosen at the first start, outside the kernel's ephemeral port range
	// where possible (so no outgoing connection can take them while the
	// cluster is stopped). Either way the ports are kept for Restart.
	Ports []int

	// DataDir is where the cluster persists its topics, records, group
	// offsets and producer state, so that Restart finds them again (see
	// Stop). The directory is created if needed and left behind: the
	// caller owns it. Default "": state is kept in memory only and a
	// Restart starts an empty cluster.
	DataDir string

	// Topics maps topic name to partition count; they are created when a
	// start finds no persisted state (a restart with data keeps what was
	// persisted instead). A count <= 0 means DefaultPartitions.
	Topics map[string]int32

	// AutoCreateTopics lets Metadata requests that ask for it create
	// unknown topics, as real Kafka does with its default
	// auto.create.topics.enable=true. Default false: producing to an
	// unknown topic fails with UNKNOWN_TOPIC_OR_PARTITION, which keeps
	// tests from silently creating misspelled topics.
	AutoCreateTopics bool

	// DefaultPartitions is the partition count of auto-created topics and
	// of CreateTopic with a count <= 0. Default 1, real Kafka's
	// num.partitions default (kfake's own default would be 10).
	DefaultPartitions int

	// Logger receives the cluster's logs: kfake's errors and warnings at
	// their level, its (per-request, chatty) info and debug logs at
	// debug. Default: no logs.
	Logger *zap.Logger

	// Extra kfake options, applied after testenv's own (so they win), on
	// every start. For what KafkaOptions does not cover, such as
	// kfake.GroupMinSessionTimeout or kfake.BrokerConfigs.
	Extra []kfake.Opt
}

// faultMode is what a Kafka cluster does with incoming requests.
type faultMode int32

const (
	faultNone   faultMode = iota // requests are served
	faultFail                    // each request closes its connection
	faultHang                    // requests are swallowed, never answered
	faultStarve                  // fetches are answered with no records
)

func (m faultMode) String() string {
	switch m {
	case faultNone:
		return "none"
	case faultFail:
		return "fail"
	case faultHang:
		return "hang"
	case faultStarve:
		return "starve"
	default:
		return "faultMode(" + strconv.Itoa(int(m)) + ")"
	}
}

// errInjectedFailure is what the Fail control answers with; kfake then closes
// the client's connection. The client never sees this text.
var errInjectedFailure = errors.New("devstack: injected failure")

// Kafka is a fake Kafka cluster (kfake) running in this process on loopback
// ports. Its broker addresses stay the same across Stop and Restart.
//
// All methods are safe for concurrent use. Stop and Restart are serialised
// with each other and with CreateTopic.
type Kafka struct {
	name  string
	opts  KafkaOptions // a copy, with defaults filled in
	ports []int
	mode  atomic.Int32 // a faultMode; read by the control function on kfake's goroutines
	// starved counts the fetches answered empty under Starve.
	starved atomic.Int64
	// swallowed counts the requests swallowed under Hang.
	swallowed atomic.Int64

	mu sync.RWMutex
	c  *kfake.Cluster // nil while stopped
}

// StartKafka starts a fake Kafka cluster named name (also its cluster ID, so
// clusters are told apart in metadata) and returns once it accepts
// connections. The caller must call Stop when done.
func StartKafka(name string, opts KafkaOptions) (*Kafka, error) {
	if opts.Brokers < 0 || (len(opts.Ports) > 0 && opts.Brokers != 0 && opts.Brokers != len(opts.Ports)) {
		return nil, fmt.Errorf("devstack: kafka %s: Brokers=%d does not fit %d Ports", name, opts.Brokers, len(opts.Ports))
	}
	if opts.Brokers == 0 {
		opts.Brokers = max(1, len(opts.Ports))
	}
	if opts.DefaultPartitions <= 0 {
		opts.DefaultPartitions = 1
	}
	opts.Ports = append([]int(nil), opts.Ports...)
	opts.Extra = append([]kfake.Opt(nil), opts.Extra...)
	topics := make(map[string]int32, len(opts.Topics))
	for t, p := range opts.Topics {
		topics[t] = p
	}
	opts.Topics = topics

	k := &Kafka{name: name, opts: opts}
	if len(opts.Ports) > 0 {
		k.ports = opts.Ports
		c, err := k.start()
		if err != nil {
			return nil, err
		}
		k.c = c
		return k, nil
	}
	var lastErr error
	for range startAttempts {
		ports, err := freeport.Ports(opts.Brokers)
		if err != nil {
			return nil, err
		}
		k.ports = ports
		c, err := k.start()
		if err == nil {
			k.c = c
			return k, nil
		}
		lastErr = err
		if !freeport.IsBindError(err) {
			break
		}
	}
	return nil, lastErr
}

// Name returns the name given to StartKafka, which is also the cluster ID.
func (k *Kafka) Name() string { return k.name }

// Brokers returns the brokers' addresses ("127.0.0.1:PORT"), the same across
// Stop and Restart.
func (k *Kafka) Brokers() []string {
	addrs := make([]string, len(k.ports))
	for i, p := range k.ports {
		addrs[i] = hostPort(p)
	}
	return addrs
}

// Cluster returns the running kfake cluster for what this type does not
// wrap (Fault, ControlKey, GroupInfo...), or nil while stopped. A Restart
// makes a new cluster: controls and faults installed on the old one are gone.
func (k *Kafka) Cluster() *kfake.Cluster {
	k.mu.RLock()
	defer k.mu.RUnlock()
	return k.c
}

// Running reports whether the cluster is started (not stopped).
func (k *Kafka) Running() bool {
	k.mu.RLock()
	defer k.mu.RUnlock()
	return k.c != nil
}

// Stop closes the cluster: listeners close (clients get connection refused
// until Restart), open connections are dropped, and, with a DataDir, the
// whole state is written to disk before Stop returns — including
// auto-created topics and the latest group offsets, which kfake only saves
// on this clean close. A few kfake goroutines finish asynchronously, within
// milliseconds. Stop is idempotent.
//
// Stop is the way to simulate a dead process (connections refused); Fail
// and Hang keep the port open.
func (k *Kafka) Stop() {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.c == nil {
		return
	}
	k.c.Close()
	k.c = nil
}

// Restart starts a stopped cluster again on the same ports and, with a
// DataDir, with the data persisted by Stop. If a port is briefly still in use
// it retries for up to 10 s. The fault mode (Fail/Hang) is a property of the
// Kafka value, not of one run: it still applies after Restart until Recover.
// Clients reconnect by themselves (sarama on its next metadata refresh or
// request). Restarting a running cluster is an error.
func (k *Kafka) Restart() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.c != nil {
		return fmt.Errorf("devstack: kafka %s: restart: already running", k.name)
	}
	deadline := time.Now().Add(restartBindTimeout)
	for {
		c, err := k.start()
		if err == nil {
			k.c = c
			return nil
		}
		if !freeport.IsBindError(err) || time.Now().After(deadline) {
			return err
		}
		time.Sleep(100 * time.Millisecond) // waiting for a port to be released; nothing to poll
	}
}

// Fail makes every request to the cluster fail from now on: kfake reads the
// request and closes the connection without answering, so clients see EOF
// or "connection reset" at once and reconnecting does not help (the new
// connection's first request, ApiVersions, fails the same way). To a sarama
// client this looks like a cluster whose brokers are all down: metadata
// refreshes run out of brokers and produce/fetch fail within their retry
// budget (with sarama's defaults: RefreshMetadata failed in under 1 s,
// SendMessage in under 2 s, and a partition consumer reported EOF at once,
// then "run out of available brokers" every ~2.8 s). After Recover, or
// after Stop and Restart, the same sarama client, producer and partition
// consumer carry on by themselves within a fraction of a second.
//
// Use Fail for "the data centre is gone, fast". Use Hang to exercise
// timeouts, and Stop for "connection refused". Connections idle at the time
// of Fail are not cut until they send a request. Recover lifts it.
func (k *Kafka) Fail() { k.mode.Store(int32(faultFail)) }

// Hang makes the cluster swallow every request from now on: it is read and
// never answered, and kfake reads nothing more from that connection. Clients
// see timeouts (sarama: Net.ReadTimeout, 30 s by default), like a network
// partition or a hung broker. Note that a sarama metadata refresh times out
// once per broker address it knows (the seed address and the broker's
// advertised one count separately) and per retry: with Net.ReadTimeout = 1 s
// and Metadata.Retry.Max = 1 it failed after about 5 s.
//
// Recover lifts it for new requests, but a connection that had a request
// swallowed stays dead (its kfake goroutines remain until Stop): clients
// recover when their timeout closes it and they reconnect.
func (k *Kafka) Hang() { k.mode.Store(int32(faultHang)) }

// Swallowed returns how many requests were swallowed under Hang: a test
// waits on it to know that a request is in flight to the hung cluster.
func (k *Kafka) Swallowed() int64 { return k.swallowed.Load() }

// Starve makes the cluster answer every fetch at once with no records and
// no error, after a short wait (starveWait), while it serves everything
// else: records can be produced and their offsets listed, but consumers
// make no progress. A broker that answers and delivers nothing; the
// partitions' lag grows. A fetch already waiting for records when Starve
// is called is still answered with them: wait until Starved has grown by
// the number of consumers before relying on it.
func (k *Kafka) Starve() { k.mode.Store(int32(faultStarve)) }

// Starved returns how many fetches were answered empty under Starve.
func (k *Kafka) Starved() int64 { return k.starved.Load() }

// starveWait is how long a starved fetch waits before its empty answer, so
// that consumers do not spin.
const starveWait = 50 * time.Millisecond

// Recover lifts Fail, Hang or Starve: requests from now on are served
// normally.
func (k *Kafka) Recover() { k.mode.Store(int32(faultNone)) }

// CreateTopic creates a topic with partitions partitions (<= 0: the cluster
// default, see KafkaOptions.DefaultPartitions). It acts on the cluster
// directly, not through a request, so it works even while Fail or Hang is in
// effect; with a DataDir the topic is persisted at once. An existing topic
// gives an error wrapping kerr.TopicAlreadyExists; a stopped cluster gives
// ErrStopped.
func (k *Kafka) CreateTopic(name string, partitions int32) error {
	k.mu.RLock()
	defer k.mu.RUnlock()
	if k.c == nil {
		return fmt.Errorf("devstack: kafka %s: create topic %s: %w", k.name, name, ErrStopped)
	}
	if err := k.c.CreateTopic(name, partitions, nil); err != nil {
		return fmt.Errorf("devstack: kafka %s: create topic %s: %w", k.name, name, err)
	}
	return nil
}

// AddPartitions grows topic to total partitions by sending a CreatePartitions
// request from a short-lived franz-go client. Being a real request, it fails
// while Fail is in effect and times out (10 s) under Hang. Errors from the
// broker wrap the kerr error (e.g. kerr.InvalidPartitions when total is not
// larger than the current count, kerr.UnknownTopicOrPartition).
func (k *Kafka) AddPartitions(topic string, total int32) error {
	wrap := func(err error) error {
		return fmt.Errorf("devstack: kafka %s: add partitions to %s (total %d): %w", k.name, topic, total, err)
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers()...))
	if err != nil {
		return wrap(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), adminTimeout)
	defer cancel()

	req := kmsg.NewPtrCreatePartitionsRequest()
	req.TimeoutMillis = int32(adminTimeout / time.Millisecond)
	rt := kmsg.NewCreatePartitionsRequestTopic()
	rt.Topic = topic
	rt.Count = total
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return wrap(err)
	}
	if len(resp.Topics) != 1 {
		return wrap(fmt.Errorf("%d topics in response, want 1", len(resp.Topics)))
	}
	if err := kerr.ErrorForCode(resp.Topics[0].ErrorCode); err != nil {
		if msg := resp.Topics[0].ErrorMessage; msg != nil && *msg != "" {
			return wrap(fmt.Errorf("%w: %s", err, *msg))
		}
		return wrap(err)
	}
	return nil
}

// start runs one kfake cluster with k's options and installs the fault
// control. Called with k.mu held (or before k is shared).
func (k *Kafka) start() (*kfake.Cluster, error) {
	opts := []kfake.Opt{
		kfake.ClusterID(k.name),
		kfake.DefaultNumPartitions(k.opts.DefaultPartitions),
		kfake.Ports(k.ports...),
	}
	if k.opts.DataDir != "" {
		opts = append(opts, kfake.DataDir(k.opts.DataDir))
	}
	if k.opts.AutoCreateTopics {
		opts = append(opts, kfake.AllowAutoTopicCreation())
	}
	for t, p := range k.opts.Topics {
		opts = append(opts, kfake.SeedTopics(p, t))
	}
	if k.opts.Logger != nil {
		opts = append(opts, kfake.WithLogger(zapKfakeLogger{k.opts.Logger.Sugar().With("kafka", k.name)}))
	}
	opts = append(opts, k.opts.Extra...)

	c, err := kfake.NewCluster(opts...)
	if err != nil {
		return nil, fmt.Errorf("devstack: kafka %s: start: %w", k.name, err)
	}
	// One permanent control for all requests. Unhandled (mode none) it
	// stays installed and kfake serves the request; handled, it must ask
	// to be kept or kfake drops it after one request.
	c.Control(func(req kmsg.Request) (kmsg.Response, error, bool) {
		switch faultMode(k.mode.Load()) {
		case faultStarve:
			c.KeepControl()
			f, ok := req.(*kmsg.FetchRequest)
			if !ok {
				return nil, nil, false
			}
			c.SleepControl(func() { time.Sleep(starveWait) })
			k.starved.Add(1)
			return emptyFetch(f), nil, true
		case faultFail:
			c.KeepControl()
			return nil, errInjectedFailure, true // kfake closes the connection
		case faultHang:
			c.KeepControl()
			k.swallowed.Add(1)
			return nil, nil, true // no response: the connection stalls
		default:
			return nil, nil, false
		}
	})
	return c, nil
}

// ThrottleFetches makes the cluster answer every other Fetch empty and
// ask the client to wait ms milliseconds before its next request
// (ThrottleMillis), as a broker over its quota does; the other fetches are
// served as usual. It lasts until the cluster stops, and returns how many
// fetches it has throttled so far.
func (k *Kafka) ThrottleFetches(ms int32) (throttled func() int32) {
	c := k.Cluster()
	var n, done atomic.Int32
	c.ControlKey(int16(kmsg.Fetch), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if n.Add(1)%2 == 1 {
			return nil, nil, false
		}
		done.Add(1)
		resp := emptyFetch(req.(*kmsg.FetchRequest))
		resp.ThrottleMillis = ms
		return resp, nil, true
	})
	return done.Load
}

// emptyFetch answers f with every partition it asks for, without records
// or error.
func emptyFetch(f *kmsg.FetchRequest) *kmsg.FetchResponse {
	resp := f.ResponseKind().(*kmsg.FetchResponse)
	resp.Version = f.Version
	for _, t := range f.Topics {
		rt := kmsg.NewFetchResponseTopic()
		rt.Topic, rt.TopicID = t.Topic, t.TopicID
		for _, p := range t.Partitions {
			rp := kmsg.NewFetchResponseTopicPartition()
			rp.Partition = p.Partition
			rp.HighWatermark, rp.LastStableOffset, rp.LogStartOffset = -1, -1, -1
			rt.Partitions = append(rt.Partitions, rp)
		}
		resp.Topics = append(resp.Topics, rt)
	}
	return resp
}

// zapKfakeLogger adapts zap to kfake.Logger. kfake logs every request at
// info, so info and debug both go to debug.
type zapKfakeLogger struct{ s *zap.SugaredLogger }

func (l zapKfakeLogger) Logf(level kfake.LogLevel, format string, args ...any) {
	switch level {
	case kfake.LogLevelError:
		l.s.Errorf(format, args...)
	case kfake.LogLevelWarn:
		l.s.Warnf(format, args...)
	case kfake.LogLevelNone:
	default:
		l.s.Debugf(format, args...)
	}
}

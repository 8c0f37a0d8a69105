package translate

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/offsets"
)

// Method is how a Translation was found.
type Method string

// The translation methods, best first.
const (
	// MethodFingerprint found the committed records on the target by their
	// fingerprints: exact when the replica preserves key, value and
	// timestamp.
	MethodFingerprint Method = "fingerprint"
	// MethodMM2 used MirrorMaker 2's offset-syncs or checkpoints: may
	// rewind, never skips.
	MethodMM2 Method = "mm2"
	// MethodTimestamp looked the position's timestamp (minus a margin) up on
	// the target: rewinds by an unknown amount, may skip records whose
	// timestamps are out of order by more than the margin.
	MethodTimestamp Method = "timestamp"
)

// Direction says how the target cluster relates to the source cluster of a
// Request. The zero value is invalid, so that a request cannot
// silently read MirrorMaker 2 data the wrong way round.
type Direction int

const (
	// Forward translates from the primary to its replica (source →
	// replica): MirrorMaker 2's offset-syncs and checkpoints apply as they
	// are.
	Forward Direction = iota + 1
	// Backward translates from the replica back to the primary (failback):
	// offset-syncs are inverted; checkpoints are not used.
	Backward
)

func (d Direction) String() string {
	switch d {
	case Forward:
		return "forward"
	case Backward:
		return "backward"
	default:
		return fmt.Sprintf("Direction(%d)", int(d))
	}
}

// Request is one partition's position to translate.
type Request struct {
	// From and To name the source and target clusters (for messages).
	From, To string
	// Topic is the topic's name on the target cluster (already mapped by
	// the caller, e.g. with config.Replication.RemoteTopic).
	Topic string
	// SourceTopic is the topic's name on the source cluster. Forward, it is
	// the upstream name that keys MirrorMaker 2's offset-syncs; Backward,
	// Topic is (the target is the upstream cluster).
	SourceTopic string
	// Partition is the partition number, the same on both clusters.
	Partition int32
	// Position is the committed position on the source cluster. Only
	// Offset, Timestamp and Fingerprints are used.
	Position offsets.Commit
	// Group is the consumer group whose MirrorMaker 2 checkpoints may be
	// used (Forward only); empty: none.
	Group string
	// Direction is Forward or Backward.
	Direction Direction
	// Unconsumed is where a position without a timestamp (nothing
	// consumed there yet, so nothing to find) continues when fingerprints
	// and MirrorMaker 2 give nothing: "newest", the target's end (as a
	// consumer starting there with initial_offset newest would), or
	// "oldest" (the default).
	Unconsumed string
	// Hint, when set, is an earlier translation of the same partition,
	// such as one made by the fingerprint method while the source was
	// still being consumed: the fingerprint scan starts from it instead of
	// from the offset-syncs or a timestamp lookup. It is only an estimate:
	// a wrong hint costs a longer scan or a rescan, never a wrong answer.
	Hint *Hint
}

// Hint is a pair of positions known to correspond: the record before
// source offset SourceOffset is the record before target offset
// TargetOffset.
type Hint struct {
	SourceOffset, TargetOffset int64
}

// Translation is where to continue on the target.
type Translation struct {
	// Offset is the next offset to consume on the target. It is never
	// past the target partition's end (high watermark) at translation
	// time, nor before its oldest offset.
	Offset int64
	// Method is the method that gave Offset.
	Method Method
	// Rewound is how many records before the exact continuation point will
	// be delivered again: 0 for a fingerprint match; for MirrorMaker 2 an
	// upper bound (the source records between the offset-sync and the
	// position, of which some may not have been replicated); -1 when
	// unknown (timestamp, checkpoints).
	Rewound int64
	// Lagged is how many consumed records the target did not hold yet
	// (the replica lagged behind the consumer): if the replicator copies
	// them later, they are delivered again.
	Lagged int64
	// Detail says in one line why this method, and what fell back and why.
	Detail string
	// End is the target partition's end (high watermark) when it was
	// translated.
	End int64
}

// MethodError is why one method did not give a translation.
type MethodError struct {
	Method Method
	Err    error
}

func (e MethodError) Error() string { return string(e.Method) + ": " + e.Err.Error() }

// Error is returned when no method gave a translation. It names
// the partition and the clusters, and unwraps to each method's error (so
// errors.Is(err, context.DeadlineExceeded) holds when the Translator's
// Timeout cut them short).
type Error struct {
	From, To  string
	Topic     string
	Partition int32
	Methods   []MethodError
}

func (e *Error) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "offsets: translate %s/%d from %s to %s: no method worked", e.Topic, e.Partition, e.From, e.To)
	for _, m := range e.Methods {
		b.WriteString("; ")
		b.WriteString(m.Error())
	}
	return b.String()
}

// Unwrap returns the methods' errors.
func (e *Error) Unwrap() []error {
	errs := make([]error, len(e.Methods))
	for i, m := range e.Methods {
		errs[i] = m.Err
	}
	return errs
}

// Defaults of Translator's fields.
const (
	DefaultScanLimit        = 10000
	DefaultTranslateTimeout = 10 * time.Second
)

// Translator translates committed positions between a primary cluster and
// its MirrorMaker 2 (or kswitch mirror) replica. Its fields are read, never
// written, by Translate, which is safe for concurrent use; set them before
// the first call. Translate starts no goroutine that outlives it except
// abandoned sarama calls (see Translate on Timeout).
type Translator struct {
	// Target is a client of the target cluster. Required.
	//
	// The clients should have Metadata.AllowAutoTopicCreation off (as
	// internal/kafka's have): looking up a missing topic, such as an
	// absent checkpoints topic, would otherwise create it on a broker
	// with auto.create.topics.enable.
	Target sarama.Client
	// Syncs is a client of the cluster holding the MirrorMaker 2
	// offset-syncs topic (Replication.OffsetSyncsCluster); nil if unknown
	// or unreachable, which disables offset-syncs.
	Syncs sarama.Client
	// OpenSyncs, when Syncs is nil, returns the offset-syncs cluster's
	// client the first time a call needs it (nil if it cannot be opened):
	// for a cluster that may be down, so that calls that never reach the
	// mm2 method do not wait for a connection. It must be safe for
	// concurrent use and return the same client every time.
	OpenSyncs func() sarama.Client
	// Replication names MirrorMaker 2's topics: OffsetSyncsTopic (on
	// Syncs) and CheckpointsTopic (on the replica, so read through Target
	// in Forward requests). An empty name disables that source.
	Replication config.Replication
	// TimestampMargin is subtracted from the position's timestamp before
	// looking it up (timestamp method and fingerprint scan start), to
	// tolerate records whose timestamps are slightly out of order. Zero: no
	// margin.
	TimestampMargin time.Duration
	// ScanLimit bounds the records each fingerprint scan reads; there are
	// at most two per call. Default (<= 0): DefaultScanLimit.
	ScanLimit int
	// Timeout bounds each Translate call. Default (<= 0):
	// DefaultTranslateTimeout.
	Timeout time.Duration
	// SyncsCache, when set, keeps what the calls have read of the
	// offset-syncs topic for the next calls (share one across the
	// partitions of one switch). Nil: each call reads the topic in full.
	SyncsCache *SyncsCache
}

func (t *Translator) scanLimit() int {
	if t.ScanLimit <= 0 {
		return DefaultScanLimit
	}
	return t.ScanLimit
}

func (t *Translator) timeout() time.Duration {
	if t.Timeout <= 0 {
		return DefaultTranslateTimeout
	}
	return t.Timeout
}

// Translate returns where a consumer of req.Topic/req.Partition on the
// target should continue to resume from req.Position on the source. It
// tries, best first, and falls back on failure:
//
//  1. fingerprint: needs Position.Fingerprints. It scans the target
//     partition from an estimate (MirrorMaker 2's translation of the first
//     fingerprinted record if offset-syncs are available, else the first
//     offset at Position.Timestamp minus TimestampMargin, else the oldest)
//     for the longest run of consecutive records whose fingerprints are a
//     suffix of Position.Fingerprints ending with the last one; of equally
//     long runs the earliest wins, so that duplicated copies rewind rather
//     than skip. If the estimate was too late (no full match), it scans
//     once more from further back: a few records if a run was cut short
//     by the scan's start, else up to ScanLimit records. Records are read
//     as a read_committed consumer sees them: aborted ones and transaction
//     markers are skipped.
//  2. mm2: MirrorMaker 2's rule on the offset-syncs (Forward: the latest
//     sync with upstream <= Offset gives downstream, +1 unless equal;
//     Backward: the same with the sides swapped) and, Forward, the group's
//     checkpoint; the later of the safe answers wins. The topics are read
//     in full on every call.
//  3. timestamp: the first offset with a timestamp at or after
//     Position.Timestamp - TimestampMargin; the oldest offset if the
//     position has no timestamp; the end if no record is that recent.
//
// Every answer is clamped to the target partition's [oldest, end] range,
// read first: if the target cannot be reached, Translate fails with every
// method's error, as a *Error.
//
// Timeout: the whole call is bounded by Timeout and ctx. The stages get
// shares of the remaining time (offset-syncs a third, the fingerprint scan
// half of what is left…), so that a slow or hung stage leaves time for the
// next. If ctx ends, Translate returns ctx.Err() unchanged. sarama calls
// take no ctx: one cut short goes on in the background until the client's
// Net.ReadTimeout ends it, as with KafkaMirror.Commit.
func (t *Translator) Translate(ctx context.Context, req Request) (Translation, error) {
	if err := t.check(req); err != nil {
		return Translation{}, err
	}
	callCtx, cancel := context.WithTimeout(ctx, t.timeout())
	defer cancel()
	c := &translateCall{t: t, req: req}
	tr, err := c.run(callCtx)
	if err != nil && ctx.Err() != nil {
		return Translation{}, ctx.Err()
	}
	return tr, err
}

func (t *Translator) check(req Request) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("offsets: translate %s/%d from %s to %s: %s", req.Topic, req.Partition, req.From, req.To, fmt.Sprintf(format, args...))
	}
	switch {
	case t.Target == nil:
		return bad("no target client")
	case req.Topic == "":
		return bad("no topic")
	case req.Partition < 0:
		return bad("negative partition")
	case req.Position.Offset < 0:
		return bad("negative offset %d", req.Position.Offset)
	case req.Direction != Forward && req.Direction != Backward:
		return bad("direction %v is neither Forward nor Backward", req.Direction)
	}
	return nil
}

// translateCall is the state of one Translate call, owned by its goroutine.
type translateCall struct {
	t   *Translator
	req Request

	oldest, end int64 // the target partition's range

	mm2       mm2Data
	syncsRead bool
}

// stage returns a ctx for a stage that may use frac of the time left.
func stage(ctx context.Context, frac float64) (context.Context, context.CancelFunc) {
	dl, ok := ctx.Deadline()
	if !ok {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, time.Duration(float64(time.Until(dl))*frac))
}

func (c *translateCall) run(ctx context.Context) (Translation, error) {
	req := c.req
	fail := &Error{From: req.From, To: req.To, Topic: req.Topic, Partition: req.Partition}
	failed := func(m Method, err error) { fail.Methods = append(fail.Methods, MethodError{m, err}) }

	if err := c.bounds(ctx); err != nil {
		err = fmt.Errorf("target partition %s/%d on %s: %w", req.Topic, req.Partition, req.To, err)
		for _, m := range []Method{MethodFingerprint, MethodMM2, MethodTimestamp} {
			failed(m, err)
		}
		return Translation{}, fail
	}
	done := func(tr Translation) (Translation, error) {
		tr.End = c.end
		for _, m := range fail.Methods {
			tr.Detail += "; " + string(m.Method) + " failed: " + m.Err.Error()
		}
		return tr, nil
	}

	if len(req.Position.Fingerprints) > 0 {
		if tr, err := c.fingerprint(ctx); err == nil {
			return done(tr)
		} else {
			failed(MethodFingerprint, err)
		}
	} else {
		failed(MethodFingerprint, errors.New("the position has no fingerprints"))
	}

	if tr, err := c.viaMM2(ctx); err == nil {
		return done(tr)
	} else {
		failed(MethodMM2, err)
	}

	if tr, err := c.timestamp(ctx); err == nil {
		return done(tr)
	} else {
		failed(MethodTimestamp, err)
	}
	return Translation{}, fail
}

// bounds reads the target partition's oldest offset and end.
func (c *translateCall) bounds(ctx context.Context) error {
	sctx, cancel := stage(ctx, 0.25)
	defer cancel()
	var err error
	if c.oldest, err = kafka.ListOffset(sctx, c.t.Target, c.req.Topic, c.req.Partition, sarama.OffsetOldest); err != nil {
		return err
	}
	c.end, err = kafka.ListOffset(sctx, c.t.Target, c.req.Topic, c.req.Partition, sarama.OffsetNewest)
	return err
}

func (c *translateCall) clamp(off int64) int64 { return min(max(off, c.oldest), c.end) }

// loadSyncs reads the offset-syncs once per call.
func (c *translateCall) loadSyncs(ctx context.Context) {
	if c.syncsRead {
		return
	}
	c.syncsRead = true
	client := c.t.Syncs
	if client == nil && c.t.OpenSyncs != nil {
		client = c.t.OpenSyncs()
	}
	switch {
	case client == nil:
		c.mm2.syncsErr = errors.New("no client for the offset-syncs cluster")
		return
	case c.t.Replication.OffsetSyncsTopic == "":
		c.mm2.syncsErr = errors.New("no offset-syncs topic configured")
		return
	}
	upstream := c.req.SourceTopic
	if c.req.Direction == Backward {
		upstream = c.req.Topic
	}
	if upstream == "" {
		c.mm2.syncsErr = errors.New("no source topic name to look offset-syncs up by")
		return
	}
	sctx, cancel := stage(ctx, 1.0/3)
	defer cancel()
	topic := c.t.Replication.OffsetSyncsTopic
	if err := mustExist(sctx, client, topic); err != nil {
		c.mm2.syncsErr = err
		return
	}
	cache := c.t.SyncsCache
	if cache == nil {
		cache = new(SyncsCache)
	}
	syncs, skipped, err := cache.read(sctx, client, topic, upstream, c.req.Partition)
	if err != nil {
		c.mm2.syncsErr = fmt.Errorf("read %s: %w", topic, err)
		return
	}
	c.mm2.syncs, c.mm2.skipped = syncs, c.mm2.skipped+skipped
}

// syncEstimate translates a source offset with the offset-syncs alone, to
// start the fingerprint scan: a lower bound of where its copy is.
func (c *translateCall) syncEstimate(pos int64) (mm2Result, error) {
	d := mm2Data{syncs: c.mm2.syncs, syncsErr: c.mm2.syncsErr}
	if c.req.Direction == Backward {
		return d.translateBackward(pos)
	}
	d.cpErr = errors.New("not used")
	return d.translateForward(pos)
}

// viaMM2 is method 2.
func (c *translateCall) viaMM2(ctx context.Context) (Translation, error) {
	req := c.req
	c.loadSyncs(ctx)
	var r mm2Result
	var err error
	if req.Direction == Backward {
		r, err = c.mm2.translateBackward(req.Position.Offset)
	} else {
		switch {
		case req.Group == "":
			c.mm2.cpErr = errors.New("no group")
		case c.t.Replication.CheckpointsTopic == "":
			c.mm2.cpErr = errors.New("no checkpoints topic configured")
		default:
			sctx, cancel := stage(ctx, 0.5)
			topic := c.t.Replication.CheckpointsTopic
			if err := mustExist(sctx, c.t.Target, topic); err != nil {
				c.mm2.cpErr = err
			} else if err := readCheckpoint(sctx, c.t.Target, topic, req.Group, req.Topic, req.Partition, &c.mm2); err != nil {
				c.mm2.cpErr = fmt.Errorf("read %s: %w", topic, err)
				c.mm2.checkpoint = nil
			}
			cancel()
		}
		r, err = c.mm2.translateForward(req.Position.Offset)
	}
	if err != nil {
		if c.mm2.skipped > 0 {
			err = fmt.Errorf("%w (%d undecodable records skipped)", err, c.mm2.skipped)
		}
		return Translation{}, err
	}
	detail := "mm2: " + r.detail
	off := c.clamp(r.offset)
	switch {
	case off < r.offset:
		detail += fmt.Sprintf(", lowered to the target's end %d", off)
	case off > r.offset:
		detail += fmt.Sprintf(", raised to the target's oldest offset %d", off)
	}
	return Translation{Offset: off, Method: MethodMM2, Rewound: r.rewound, Detail: detail}, nil
}

// mustExist returns an error unless topic exists on the cluster of
// client. A topic in the client's metadata exists; for another, one
// Metadata request goes to one broker, without sarama's retries and
// backoff: MirrorMaker 2's topics are often absent (another replicator,
// offset-syncs kept elsewhere), and sarama's lookup of an absent topic
// retries Metadata.Retry.Max times, Metadata.Retry.Backoff apart, for
// every partition translated, which a failover must not wait for.
func mustExist(ctx context.Context, client sarama.Client, topic string) error {
	if topics, err := client.Topics(); err == nil && slices.Contains(topics, topic) {
		return nil
	}
	return kafka.Call(ctx, func() error {
		b := client.LeastLoadedBroker()
		if b == nil {
			return fmt.Errorf("look topic %s up: %w", topic, sarama.ErrClosedClient)
		}
		req := sarama.NewMetadataRequest(client.Config().Version, []string{topic})
		req.AllowAutoTopicCreation = false
		resp, err := b.GetMetadata(req)
		kafka.CloseOnTransportError(b, err)
		if err != nil {
			return fmt.Errorf("look topic %s up: %w", topic, err)
		}
		for _, tm := range resp.Topics {
			if tm.Name == topic && !errors.Is(tm.Err, sarama.ErrUnknownTopicOrPartition) {
				return nil // exists (or an error the read reports)
			}
		}
		return fmt.Errorf("topic %s does not exist", topic)
	})
}

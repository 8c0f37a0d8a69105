package offsets

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/kswitch/kswitch/keys"
)

// MaxValueSize bounds what a reader parses from an offsets key.
const MaxValueSize = 64 << 10

// Commit is one partition's position to commit.
type Commit struct {
	// Cluster is the name of the Kafka cluster the offset belongs to.
	Cluster string
	// Topic and Partition name the source partition.
	Topic     string
	Partition int32
	// Offset is the next offset to consume: the last consumed record's
	// offset + 1 (Kafka's meaning of a committed offset).
	Offset int64
	// Timestamp is the timestamp of the last consumed record, or zero if
	// none was consumed. It is stored with millisecond precision.
	Timestamp time.Time
	// Fingerprints are those of the last few consumed records, oldest
	// first, at most MaxFingerprints; the last one is of record Offset-1.
	// Empty if none was consumed (or not tracked).
	Fingerprints []Fingerprint
	// TopicID is the identity of the topic the offset belongs to,
	// "<cluster id>/<topic id>" (its incarnation: a topic deleted and
	// created again under the same name gets a new one), "" when unknown.
	// A reader that finds another topic id of the same cluster knows the
	// offset is of a topic that no longer exists (record.SameTopic).
	TopicID string
}

// TopicPartition returns the commit's partition.
func (c Commit) TopicPartition() TopicPartition {
	return TopicPartition{Topic: c.Topic, Partition: c.Partition}
}

// validate checks what Commit and the value parser both require.
func (c Commit) validate() error {
	for _, n := range []struct{ what, v string }{{"cluster", c.Cluster}, {"topic", c.Topic}} {
		if err := keys.ValidName(n.v); err != nil {
			return fmt.Errorf("%s %q %v", n.what, n.v, err)
		}
	}
	if c.Partition < 0 {
		return fmt.Errorf("partition %d is negative", c.Partition)
	}
	if len(c.TopicID) > maxTopicID {
		return fmt.Errorf("topic id of %d bytes, over the limit of %d", len(c.TopicID), maxTopicID)
	}
	return validatePosition(c.Offset, len(c.Fingerprints))
}

// maxTopicID bounds a stored topic id (Kafka's are 22 characters of
// base64).
const maxTopicID = 64

func validatePosition(offset int64, fingerprints int) error {
	if offset < 0 {
		return fmt.Errorf("offset %d is negative", offset)
	}
	if fingerprints > MaxFingerprints {
		return fmt.Errorf("%d fingerprints, over the limit of %d", fingerprints, MaxFingerprints)
	}
	if int64(fingerprints) > offset {
		return fmt.Errorf("%d fingerprints but only %d records before offset %d", fingerprints, offset, offset)
	}
	return nil
}

// Position is a committed offset as read back from etcd: the Commit and who
// wrote it when.
type Position struct {
	Commit
	// Agent and Generation are the committing agent and the assignment
	// generation it was fenced by.
	Agent      string
	Generation int64
	// CommittedAt is the committing agent's clock at commit time.
	CommittedAt time.Time
	// Revision is the etcd mod revision of the value.
	Revision int64
}

// ErrMalformed matches every *MalformedError.
var ErrMalformed = errors.New("offsets: malformed committed offset")

// MalformedError is a value (or key) under offsets/ that cannot be read as a
// committed offset. Callers log and count it and treat the partition as
// having no committed offset (see the package doc).
type MalformedError struct {
	// Key is the etcd key.
	Key string
	// Revision is the key's mod revision.
	Revision int64
	// Err says what is wrong.
	Err error
}

func (e *MalformedError) Error() string {
	return fmt.Sprintf("offsets: value at %s (revision %d) is malformed: %v", e.Key, e.Revision, e.Err)
}

// Unwrap returns the cause.
func (e *MalformedError) Unwrap() error { return e.Err }

// Is reports whether target is ErrMalformed.
func (e *MalformedError) Is(target error) bool { return target == ErrMalformed }

// record is the stored JSON form. Offset is a pointer so that a missing
// field is an error, not offset 0.
type record struct {
	Offset       *int64        `json:"offset"`
	TimestampMs  *int64        `json:"timestamp_ms,omitempty"`
	Fingerprints []Fingerprint `json:"fingerprints,omitempty"`
	TopicID      string        `json:"topic_id,omitempty"`
	Agent        string        `json:"agent"`
	Generation   int64         `json:"generation"`
	CommittedAt  time.Time     `json:"committed_at"`
}

// encodeValue returns the stored form of c, written by agent in generation
// at now.
func encodeValue(c Commit, agent string, generation int64, now time.Time) ([]byte, error) {
	r := record{
		Offset:       &c.Offset,
		Fingerprints: c.Fingerprints,
		TopicID:      c.TopicID,
		Agent:        agent,
		Generation:   generation,
		CommittedAt:  now.UTC().Truncate(time.Millisecond),
	}
	if !c.Timestamp.IsZero() {
		ms := c.Timestamp.UnixMilli()
		r.TimestampMs = &ms
	}
	return json.Marshal(r)
}

// decodeValue parses the value stored at key for cluster/topic/partition.
// Every error is a *MalformedError.
func decodeValue(key string, rev int64, cluster, topic string, partition int32, val []byte) (Position, error) {
	bad := func(err error) (Position, error) {
		return Position{}, &MalformedError{Key: key, Revision: rev, Err: err}
	}
	if len(val) > MaxValueSize {
		return bad(fmt.Errorf("%d bytes, over the %d-byte limit", len(val), MaxValueSize))
	}
	var r record
	if err := json.Unmarshal(val, &r); err != nil {
		return bad(fmt.Errorf("not valid JSON: %w", err))
	}
	if r.Offset == nil {
		return bad(errors.New("no offset"))
	}
	if err := validatePosition(*r.Offset, len(r.Fingerprints)); err != nil {
		return bad(err)
	}
	if len(r.TopicID) > maxTopicID {
		return bad(fmt.Errorf("topic id of %d bytes, over the limit of %d", len(r.TopicID), maxTopicID))
	}
	p := Position{
		Commit: Commit{
			Cluster:      cluster,
			Topic:        topic,
			Partition:    partition,
			Offset:       *r.Offset,
			Fingerprints: r.Fingerprints,
			TopicID:      r.TopicID,
		},
		Agent:       r.Agent,
		Generation:  r.Generation,
		CommittedAt: r.CommittedAt,
		Revision:    rev,
	}
	if r.TimestampMs != nil {
		p.Timestamp = time.UnixMilli(*r.TimestampMs)
	}
	return p, nil
}

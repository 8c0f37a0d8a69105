package routing

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/record"
)

// TxnPosition is the value of a stream's key in the positions topic: the
// source position that the transaction it was written in completes.
type TxnPosition struct {
	// Cluster, Topic and Partition name the physical source partition.
	Cluster   string `json:"cluster"`
	Topic     string `json:"topic"`
	Partition int32  `json:"partition"`
	// Offset is the next offset to consume there.
	Offset int64 `json:"offset"`
	// Fingerprint is the last record's (offset Offset-1), for
	// translation to another cluster's copy.
	Fingerprint offsets.Fingerprint `json:"fp"`
	// TimestampMs is the last record's timestamp, Unix milliseconds.
	TimestampMs int64 `json:"ts"`
	// Generation and Session are the owner's (record.Record).
	Generation int64 `json:"gen"`
	Session    int64 `json:"session"`
	// Done maps each physical copy of the stream consumed so far
	// ("cluster/topic/partition") to the offset after the last record
	// delivered from it: a switch back to a copy (a failback to A) may
	// consume again records delivered from it before the switch (A's
	// unmirrored tail), which are skipped. The stream has one copy per
	// source cluster, so the map stays small.
	Done map[string]int64 `json:"done"`
	// IDs maps each copy in Done to the id of the topic its offset is of
	// (record.Record.TopicID; absent when unknown, and in positions
	// written before kswitch knew ids). A topic deleted and created again
	// under the same name has a new id and offsets from 0 again: an
	// offset of another id than the record's covers nothing.
	IDs map[string]string `json:"ids,omitempty"`
}

func physical(cluster, topic string, partition int32) string {
	return cluster + "/" + topic + "/" + strconv.Itoa(int(partition))
}

// covers reports whether rec was delivered by an earlier transaction: its
// copy's done offset is past it, and of the same topic (an unknown id on
// either side is taken for the same: the offsets alone decide, as before
// ids).
func (p *TxnPosition) covers(rec *record.Record) bool {
	if p == nil {
		return false
	}
	at := physical(rec.Cluster, rec.Topic, rec.Partition)
	if !record.SameTopic(p.IDs[at], rec.TopicID) {
		return false
	}
	return rec.Offset < p.Done[at]
}

// carried returns copies of p's Done and IDs, for the next transaction's
// position to start from (empty maps when p is nil).
func (p *TxnPosition) carried() (map[string]int64, map[string]string) {
	done, ids := map[string]int64{}, map[string]string{}
	if p != nil {
		maps.Copy(done, p.Done)
		maps.Copy(ids, p.IDs)
	}
	return done, ids
}

// markDone moves rec's copy in done and ids past rec. A record of another
// topic id than the copy's offset was of (the topic was created again)
// starts the copy's offset again from it: the old topic's offset says
// nothing of the new one's records.
func markDone(done map[string]int64, ids map[string]string, rec *record.Record) {
	at := physical(rec.Cluster, rec.Topic, rec.Partition)
	if rec.TopicID != "" && ids[at] != rec.TopicID {
		if !record.SameTopic(ids[at], rec.TopicID) {
			delete(done, at)
		}
		ids[at] = rec.TopicID
	}
	done[at] = max(done[at], rec.Offset+1)
}

// positionWait bounds the reading of a stream's committed position when
// its wire opens.
const positionWait = 10 * time.Second

// ensurePositionsTopic creates the positions topic (one partition,
// compacted) unless it exists.
func ensurePositionsTopic(c sarama.Client) error {
	if err := c.RefreshMetadata(config.PositionsTopic); err == nil {
		if ps, err := c.Partitions(config.PositionsTopic); err == nil && len(ps) > 0 {
			return nil
		}
	}
	admin, err := sarama.NewClusterAdminFromClient(c)
	if err != nil {
		return err
	}
	// The admin shares c: closing it would close c.
	rf := int16(min(3, len(c.Brokers())))
	// A new owner reads the whole topic (readPosition): small segments
	// let compaction keep it to about one record per stream and the
	// active segment's few MiB.
	compact, segBytes, segMs := "compact", strconv.Itoa(8<<20), strconv.Itoa(10*60*1000)
	err = admin.CreateTopic(config.PositionsTopic, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: max(rf, 1),
		ConfigEntries: map[string]*string{"cleanup.policy": &compact, "segment.bytes": &segBytes, "segment.ms": &segMs}}, false)
	if err != nil && !errors.Is(err, sarama.ErrTopicAlreadyExists) {
		return fmt.Errorf("create the positions topic %s: %w", config.PositionsTopic, err)
	}
	return c.RefreshMetadata(config.PositionsTopic)
}

// readPosition reads the stream's last committed position from the
// positions topic, as a read_committed consumer sees it; nil when there
// is none. The topic is one partition for every stream: it first waits
// for the transactions open there to end (kafka.WaitStable), or a
// position committed after another stream's open transaction began would
// be missed and an older one read. Another stream's owner that died or
// was released mid-commit holds that until its stream's next owner opens
// its producer (as soon as it has a record for this cluster: the records
// of that transaction were not acknowledged, so it consumes them again)
// or the transaction times out; the open fails if it lasts past ctx, and
// the next record tries again.
func (s *txnSet) readPosition(ctx context.Context, c sarama.Client, k txnKey) (*TxnPosition, error) {
	key := k.positionKey(s.fleet)
	if err := kafka.WaitStable(ctx, c, config.PositionsTopic, 0); err != nil {
		return nil, fmt.Errorf("read %s: %w", config.PositionsTopic, err)
	}
	var last *TxnPosition
	var bad error
	err := kafka.ReadAll(ctx, c, config.PositionsTopic, 0, func(r kafka.Record) bool {
		if string(r.Key) != key {
			return true
		}
		if r.Value == nil {
			last = nil // a tombstone
			return true
		}
		var p TxnPosition
		if err := json.Unmarshal(r.Value, &p); err != nil {
			bad = fmt.Errorf("position of %s at %s/0@%d is not JSON: %w", key, config.PositionsTopic, r.Offset, err)
			return true
		}
		last, bad = &p, nil
		return true
	})
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", config.PositionsTopic, err)
	}
	if bad != nil {
		return nil, bad
	}
	return last, nil
}

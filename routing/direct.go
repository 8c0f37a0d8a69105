package routing

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/internal/kafka"
)

// errRetired fails the produces a retired producer did not finish
// (SetClusters): they are sent again, in order, through the new one.
var errRetired = errors.New("routing: the cluster's definition changed; sending again through a producer with the new one")

// send hands om to its producer (internal/kafka's Producer, which never
// blocks). A produce that cannot be placed (no partition count for its
// topic, or a manual partition the topic lacks) is failed (Router.failed:
// held, or refused for good), and send returns nil. The
// count comes from the producer's cache and never waits on the network:
// a topic the producer has not seen is looked up in the background
// (kafka.ErrPartitionsUnknown) while its first records are held and its
// destination is failing; the recovery rounds send them once the count
// is known (recovery.go).
func (r *Router) send(om *outMsg) error {
	pr := om.pr
	km := &om.km
	// The record's time, as at the first send: Produce stamps a zero one
	// with the time of each send.
	km.Timestamp = om.d.rec.Timestamp
	n, err := pr.kp.Partitions(km.Topic)
	if err == nil {
		km.Partition, err = pr.partition(om, km.Key, n)
	}
	if err != nil {
		r.failed(om, err)
		return nil
	}
	pr.sendMu.RLock()
	defer pr.sendMu.RUnlock()
	if pr.closed {
		return errClosed
	}
	if err := pr.kp.Produce(km); err != nil {
		if errors.Is(err, kafka.ErrProducerClosed) {
			return errClosed
		}
		return err
	}
	return nil
}

// partition chooses om's partition among n by its channel's partitioner
// (hash: kafka.HashPartition, sarama's murmur2 byte for byte; random;
// round-robin per topic; manual): a manual partition the topic does not
// have is sarama.ErrInvalidPartition (the dead-letter channel).
func (pr *producer) partition(om *outMsg, key []byte, n int32) (int32, error) {
	if n <= 0 {
		return -1, fmt.Errorf("topic %s has no partitions: %w", om.ch.Topic, sarama.ErrInvalidPartition)
	}
	switch om.ch.Partitioner {
	case PartitionerRandom:
		return rand.Int32N(n), nil
	case PartitionerRoundRobin:
		c, _ := pr.roundRobin.LoadOrStore(om.ch.Topic, new(atomic.Uint32))
		return int32((c.(*atomic.Uint32).Add(1) - 1) % uint32(n)), nil
	case PartitionerManual:
		if om.srcPartition < 0 || om.srcPartition >= n {
			return -1, sarama.ErrInvalidPartition
		}
		return om.srcPartition, nil
	default:
		if key == nil { // sarama's hash partitioner: random without a key
			return rand.Int32N(n), nil
		}
		return kafka.HashPartition(key, n), nil
	}
}

// codecOf returns the codec of a channel's compression (validated by
// Compile).
func codecOf(compression string) sarama.CompressionCodec {
	switch compression {
	case "gzip":
		return sarama.CompressionGZIP
	case "snappy":
		return sarama.CompressionSnappy
	case "lz4":
		return sarama.CompressionLZ4
	case "zstd":
		return sarama.CompressionZSTD
	default:
		return sarama.CompressionNone
	}
}

// acksOf returns the required acks of a channel's acks (validated by
// Compile).
func acksOf(acks string) sarama.RequiredAcks {
	switch acks {
	case "leader":
		return sarama.WaitForLocal
	case "none":
		return sarama.NoResponse
	default:
		return sarama.WaitForAll
	}
}

// produceHandler receives the outcomes of one producer's messages
// (kafka.ProduceHandler) on its sink goroutines: none of its calls
// blocks.
type produceHandler struct {
	r  *Router
	pr *producer // set before the producer is used
}

// Acked settles each produce of an acknowledged batch, in order.
func (h *produceHandler) Acked(msgs []*kafka.Message, _ int64) {
	for _, m := range msgs {
		h.r.produced(m.Ref.(*outMsg))
	}
}

// Refused fails a produce its destination refused for good: the
// dead-letter channel, a reference, or its partition blocked
// (refusedForGood).
func (h *produceHandler) Refused(m *kafka.Message, err error) {
	om := m.Ref.(*outMsg)
	if h.r.loopCtx.Err() != nil {
		h.r.settle(om)
		return
	}
	h.r.failed(om, err)
}

// Unfinished settles what the producer held when it closed: not
// acknowledged (consumed again by the next owner) when the router
// closes; held and sent again in order through the new producer when
// the producer was retired.
func (h *produceHandler) Unfinished(msgs []*kafka.Message) {
	for _, m := range msgs {
		om := m.Ref.(*outMsg)
		if h.r.loopCtx.Err() != nil || !h.pr.retired.Load() {
			h.r.settle(om)
			continue
		}
		h.r.failed(om, errRetired)
	}
}

// stallError returns the last error of the partitions of ds's topic that
// wait in its producer (kafka.Producer.Stalled), or nil: none waits, or
// ds has no producer (none yet, or an exactly_once stream's).
func (ds *destState) stallError() error {
	ds.enterMu.Lock()
	pr := ds.sending
	ds.enterMu.Unlock()
	if pr == nil {
		return nil
	}
	if st, ok := pr.kp.Stalled(ds.dest.topic, 0); ok {
		return st.Err
	}
	return nil
}

// bumpRepeat is the least time between two new producer ids of a
// producer (kafka.ProducerConfig.BumpInterval, its default: the pool's):
// a bump wanted sooner waits for it, and tells of a broker that keeps
// losing producer state (RELAY.md §3). bumpProblemFor is how long
// readiness then reports it.
const (
	bumpRepeat     = 5 * time.Second
	bumpProblemFor = time.Minute
)

// sampleProducers exports the producers' counters (epoch bumps,
// duplicate sequences) and notes a new producer id wanted within
// bumpRepeat of the one before (kafka.ProducerStats.BumpsDelayed). It
// runs on the loop every second.
func (r *Router) sampleProducers(now time.Time) {
	for _, pr := range r.pool.all() {
		st := pr.kp.Stats()
		if d := st.Duplicates - pr.seen.Duplicates; d > 0 {
			r.m.duplicates.WithLabelValues(pr.key.cluster).Add(float64(d))
		}
		if st.BumpsDelayed > pr.seen.BumpsDelayed {
			pr.bumpRepeated.Store(now.UnixNano())
			since := time.Duration(-1)
			if !pr.bumpAt.IsZero() {
				since = now.Sub(pr.bumpAt).Round(time.Second)
			}
			r.log.Warn("the destination lost the producer's sequence numbers again within 5 s: a broker keeps losing producer state; the next producer id waits for the 5 s, and the producer's records with it",
				zap.Stringer("producer", pr.key), zap.Int64("bumps", st.Bumps), zap.Duration("since_last_bump", since))
		}
		if d := st.Bumps - pr.seen.Bumps; d > 0 {
			r.m.bumps.WithLabelValues(pr.key.cluster).Add(float64(d))
			pr.bumpAt = now
		}
		pr.seen = st
	}
}

// bumpProblems returns, for readiness, the producers that wanted a new
// producer id within bumpRepeat of the one before, less than
// bumpProblemFor ago.
func (r *Router) bumpProblems(now time.Time) []string {
	var out []string
	for _, pr := range r.pool.all() {
		at := pr.bumpRepeated.Load()
		if at == 0 || now.Sub(time.Unix(0, at)) > bumpProblemFor {
			continue
		}
		out = append(out, fmt.Sprintf("the producer for cluster %s lost its sequence numbers twice within %s (%d new producer ids in all, the last repeat %s ago): a broker of the cluster keeps losing producer state (records still flow, in order, pausing up to %[2]s for each new producer id)",
			pr.key, bumpRepeat, pr.kp.Stats().Bumps, now.Sub(time.Unix(0, at)).Round(time.Second)))
	}
	return out
}

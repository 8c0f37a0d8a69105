package agent

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/IBM/sarama"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/state"
)

// kafkaConn is the worker's connection to a cluster it consumes: a
// sarama Client for metadata, offsets and the group mirror, and a
// kafka.Fetcher that reads its partitions.
type kafkaConn struct {
	name    string
	client  sarama.Client
	fetcher *kafka.Fetcher
	mirror  *offsets.KafkaMirror
	// askWithin bounds the worker's wait for each request it sends on its
	// own loop (ask); a request given up on goes on in bg until it ends,
	// and close waits for it. unanswered counts those still running.
	askWithin  time.Duration
	bg         sync.WaitGroup
	unanswered atomic.Int32
	// fetched are the fetcher's figures already exported
	// (countFetchStats); owned by the worker's run.
	fetched kafka.FetchStats
}

// dialKafka connects to cluster name, its partitions read by a Fetcher of
// configuration fetch.
// timeout bounds the group mirror's commits and the wait for answers the
// worker can do without (askWithin).
func dialKafka(name string, c config.Cluster, group string, timeout time.Duration, d kafka.Dialer, fetch kafka.FetchConfig) (*kafkaConn, error) {
	client, err := kafka.NewClientWith(name, c, kafka.Options{Dialer: d})
	if err != nil {
		return nil, err
	}
	k := &kafkaConn{name: name, client: client, mirror: offsets.NewKafkaMirror(client, group, timeout), askWithin: timeout}
	if k.fetcher, err = kafka.NewFetcher(name, client, fetch); err != nil {
		client.Close()
		return nil, fmt.Errorf("kafka: consumer on cluster %s: %w", name, err)
	}
	return k, nil
}

// recordOverhead is what the agent's budget charges per record beyond its
// key, value and headers: the Fetcher's share, the record's delivery (the
// record.Record handed on and the tracker's state) and what the handler
// keeps (record.KeptPerRecord: the routing sink's produce message, or
// nothing for a handler that acknowledges at once).
func recordOverhead(h record.Handler) int {
	return kafka.DefaultFetchRecordOverhead + int(unsafe.Sizeof(delivery{})) + record.KeptPerRecord(h)
}

// fetchConfig is the configuration of the worker's Fetchers. The agent's
// byte budget is theirs: it is charged per response (the records are
// slices of it) and given back as the chunks are acknowledged, so the
// tracker charges nothing more. The fetch sizes follow the budget
// (default 32 MiB: Kafka's 1 MiB per partition, 8 MiB per request): no
// request is sent with less than budget/8 free, and a request asks for
// at most what is free (kafka.Fetcher: on the wire, divided by how much
// the last response weighed more decoded), so the bytes held stay about
// the budget with one broker (plus a batch: KIP-74), and at most a
// quarter of it more for each other broker fetching at the same moment.
//
// Each record is charged recordOverhead beyond its bytes: with small
// records, what the agent and its handler keep per record in flight
// outweighs the record (150 B records charged 64 B each held four times
// the budget, and the garbage collector, held to agent.memory_limit_mib,
// never paused).
func (w *worker) fetchConfig(cluster string) kafka.FetchConfig {
	return kafka.FetchConfig{
		Budget:            w.budget,
		RecordOverhead:    recordOverhead(w.handler),
		PartitionMaxBytes: int32(min(w.budget.max/8, kafka.DefaultFetchPartitionMaxBytes)),
		MaxBytes:          int32(min(w.budget.max/4, kafka.DefaultFetchMaxBytes)),
		Logger:            w.log.With(zap.String("cluster", cluster)),
	}
}

// ask runs f, requests to k's cluster that the worker's loop waits for
// (starting partitions: their offsets, metadata, topic ids), and gives up
// waiting after k.askWithin. A cluster that hung after this agent's probe
// last reached it answers nothing: sarama's read timeout (5 s), a
// metadata refresh and the request again held the loop for 32 s in a
// test, while the next assignment (a switch away from that cluster, as a
// rule) waited, and a revoke meanwhile found the agent unresponsive and
// evicted it. The partitions f was for stay pending and are started again
// later. f goes on in k.bg until its requests end; while one given up on
// runs, further asks are refused at once, so a hung cluster holds no more
// than one round of them.
func ask[T any](k *kafkaConn, what string, f func() (T, error)) (T, error) {
	var zero T
	if n := k.unanswered.Load(); n > 0 {
		return zero, fmt.Errorf("kafka: %s on cluster %s: not asked while %d earlier requests wait for an answer", what, k.name, n)
	}
	type answer struct {
		v   T
		err error
	}
	done := make(chan answer, 1)
	k.bg.Go(func() {
		v, err := f()
		done <- answer{v, err}
	})
	timer := time.NewTimer(k.askWithin)
	defer timer.Stop()
	select {
	case a := <-done:
		if a.err != nil {
			return zero, fmt.Errorf("kafka: %s on cluster %s: %w", what, k.name, a.err)
		}
		return a.v, nil
	case <-timer.C:
		k.unanswered.Add(1)
		k.bg.Go(func() {
			<-done
			k.unanswered.Add(-1)
		})
		return zero, fmt.Errorf("kafka: %s on cluster %s: no answer within %v", what, k.name, k.askWithin)
	}
}

// resolve turns sarama.OffsetOldest or OffsetNewest into an offset.
func (k *kafkaConn) resolve(tp state.TopicPartition, which int64) (int64, error) {
	return ask(k, "list offsets of "+tp.String(), func() (int64, error) {
		return k.client.GetOffset(tp.Topic, tp.Partition, which)
	})
}

// refresh refreshes the client's metadata of topics (ask).
func (k *kafkaConn) refresh(topics []string) error {
	_, err := ask(k, "metadata of "+strings.Join(topics, ", "), func() (struct{}, error) {
		return struct{}{}, k.client.RefreshMetadata(topics...)
	})
	return err
}

func (k *kafkaConn) close() {
	k.fetcher.Close()
	_ = k.client.Close() // ends the requests in flight, those given up on (ask) too
	k.bg.Wait()
}

// knows reports whether the client's metadata holds every partition of
// tps, without asking the cluster.
func (k *kafkaConn) knows(tps []state.TopicPartition) bool {
	topics, err := k.client.Topics() // the cached list
	if err != nil {
		return false
	}
	parts := map[string][]int32{}
	for _, t := range topics {
		parts[t] = nil
	}
	for _, tp := range tps {
		ps, known := parts[tp.Topic]
		if !known {
			return false
		}
		if ps == nil {
			// Known topic: Partitions answers from the cache.
			if ps, err = k.client.Partitions(tp.Topic); err != nil {
				return false
			}
			parts[tp.Topic] = ps
		}
		if !slices.Contains(ps, tp.Partition) {
			return false
		}
	}
	return true
}

// openBrokers connects the client to every broker of the cluster and
// waits until each connection is up or has failed, so that the offset
// look-ups and group commits of the partitions started later find them
// open. The Fetcher dials connections of its own, when it first fetches
// from a broker: those it does not open (docs/RELAY.md §7 step 3).
func (k *kafkaConn) openBrokers() {
	for _, b := range k.client.Brokers() {
		_ = b.Open(k.client.Config()) // ErrAlreadyConnected: fine
		_, _ = b.Connected()          // waits for the connection attempt
	}
}

// warmResult is the outcome of warming a connection to a cluster.
type warmResult struct {
	cluster string
	conn    *kafkaConn
	err     error
}

func (w *worker) dialerFor(cluster string) kafka.Dialer {
	if w.dialer == nil {
		return nil
	}
	return w.dialer(cluster)
}

package kafka

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"
)

// Partition counts off the record path: Partitions answers from a cache
// and never waits on the network. The counts of the topics the cluster
// had when the producer opened come with its metadata client; a topic
// not among them is looked up by the count refresher, a goroutine of the
// Producer, while Partitions answers ErrPartitionsUnknown. The refresher
// also reads the counts of the topics asked for again every
// PartitionsRefresh, so that a topic's new partitions are used.

// ErrPartitionsUnknown is wrapped by Partitions' error while the topic's
// partition count is being looked up (a topic the producer had not seen,
// or one missing on the cluster): ask again later.
var ErrPartitionsUnknown = errors.New("the topic's partition count is not known yet; it is being looked up")

// topicCounts is the cache behind Partitions.
type topicCounts struct {
	mu sync.RWMutex
	// known holds the counts read; an entry is added under mu (write)
	// and its count changed atomically.
	known map[string]*topicCount
	// wanted holds the topics asked for and not known, with their last
	// lookup's error (nil until one failed).
	wanted map[string]error
	kick   chan struct{} // wakes the refresher: a topic is wanted
	done   chan struct{} // closed when the refresher returned
}

type topicCount struct {
	n    atomic.Int32
	used atomic.Bool // asked for by Partitions: read again every PartitionsRefresh
}

// init seeds the cache from the metadata client's, which holds every
// topic of the cluster when it was opened (sarama's full metadata): a
// producer does not hold the first records of a topic that exists.
func (t *topicCounts) init(client sarama.Client) {
	t.known, t.wanted = map[string]*topicCount{}, map[string]error{}
	t.kick, t.done = make(chan struct{}, 1), make(chan struct{})
	topics, _ := client.Topics()
	for _, topic := range topics {
		if ps, err := client.Partitions(topic); err == nil && len(ps) > 0 {
			c := &topicCount{}
			c.n.Store(int32(len(ps)))
			t.known[topic] = c
		}
	}
}

// Partitions returns topic's partition count (for HashPartition) from the
// producer's cache, without waiting on the network. For a topic it does
// not know yet it asks the count refresher to look it up and returns an
// error wrapping ErrPartitionsUnknown and the last lookup's error, if
// one failed (sarama.ErrUnknownTopicOrPartition for a missing topic,
// sarama.ErrTopicAuthorizationFailed, ...): ask again later.
func (p *Producer) Partitions(topic string) (int32, error) {
	t := &p.topics
	t.mu.RLock()
	c := t.known[topic]
	var last error
	asked := false
	if c == nil {
		last, asked = t.wanted[topic]
	}
	t.mu.RUnlock()
	if c != nil {
		if !c.used.Load() {
			c.used.Store(true)
		}
		return c.n.Load(), nil
	}
	if !asked {
		t.mu.Lock()
		if _, ok := t.known[topic]; !ok {
			if _, ok := t.wanted[topic]; !ok {
				t.wanted[topic] = nil
			}
		}
		t.mu.Unlock()
		select {
		case t.kick <- struct{}{}:
		default:
		}
	}
	if last != nil {
		return 0, fmt.Errorf("kafka: partitions of topic %s on cluster %s: %w (last lookup: %w)", topic, p.name, ErrPartitionsUnknown, last)
	}
	return 0, fmt.Errorf("kafka: partitions of topic %s on cluster %s: %w", topic, p.name, ErrPartitionsUnknown)
}

// refreshCounts is the count refresher goroutine: it looks up the topics
// Partitions did not know at once (again after a backoff while a lookup
// fails), and the counts of the topics in use every PartitionsRefresh.
// Its metadata calls are bounded by the client's timeouts; it returns at
// its next check of quit after Close.
func (p *Producer) refreshCounts() {
	t := &p.topics
	defer close(t.done)
	defer p.releaseClient()
	timer := time.NewTimer(p.cfg.PartitionsRefresh)
	defer timer.Stop()
	nextAll := time.Now().Add(p.cfg.PartitionsRefresh)
	failures := 0
	for {
		select {
		case <-p.quit:
			return
		case <-t.kick:
		case <-timer.C:
		}
		if now := time.Now(); !now.Before(nextAll) {
			p.refreshKnown()
			nextAll = now.Add(p.cfg.PartitionsRefresh)
		}
		wait := time.Until(nextAll)
		if p.lookUpWanted() {
			failures = 0
		} else {
			failures++
			wait = min(wait, p.backoff(failures))
		}
		timer.Reset(max(wait, 0)) // go 1.23+: Reset drops a value not received
	}
}

// lookUpWanted asks the cluster for the count of each wanted topic, one
// metadata request per topic (its own error). It reports whether every
// one was found.
func (p *Producer) lookUpWanted() bool {
	t := &p.topics
	t.mu.RLock()
	topics := make([]string, 0, len(t.wanted))
	for topic := range t.wanted {
		topics = append(topics, topic)
	}
	t.mu.RUnlock()
	slices.Sort(topics)
	ok := true
	for _, topic := range topics {
		select {
		case <-p.quit: // each lookup may take the client's timeouts on a hung cluster
			return true
		default:
		}
		ps, err := p.client.Partitions(topic) // a metadata request when the client does not know topic
		t.mu.Lock()
		if err == nil && len(ps) > 0 {
			c := &topicCount{}
			c.n.Store(int32(len(ps)))
			c.used.Store(true)
			t.known[topic] = c
			delete(t.wanted, topic)
		} else {
			ok = false
			if err == nil {
				err = sarama.ErrUnknownTopicOrPartition
			}
			t.wanted[topic] = err
		}
		t.mu.Unlock()
		if err != nil {
			p.log.Debug("partition count lookup failed; trying again", zap.String("topic", topic), zap.Error(err))
		} else {
			p.log.Debug("partition count looked up", zap.String("topic", topic), zap.Int("partitions", len(ps)))
		}
	}
	return ok
}

// refreshKnown reads again the counts of the topics in use (one metadata
// request) and keeps each count it cannot read. A count may grow (new
// partitions) or change with a topic deleted and created again.
func (p *Producer) refreshKnown() {
	t := &p.topics
	t.mu.RLock()
	var topics []string
	for topic, c := range t.known {
		if c.used.Load() {
			topics = append(topics, topic)
		}
	}
	t.mu.RUnlock()
	if len(topics) == 0 {
		return
	}
	if err := p.client.RefreshMetadata(topics...); err != nil {
		p.log.Debug("partition counts not refreshed", zap.Strings("topics", topics), zap.Error(err))
	}
	cached, err := p.client.Topics() // no network: what the client holds
	if err != nil {
		return
	}
	held := make(map[string]bool, len(cached))
	for _, topic := range cached {
		held[topic] = true
	}
	for _, topic := range topics {
		if !held[topic] {
			continue // missing from the answer: its count is kept
		}
		ps, err := p.client.Partitions(topic)
		if err != nil || len(ps) == 0 {
			continue
		}
		t.mu.RLock()
		c := t.known[topic]
		t.mu.RUnlock()
		if old := c.n.Swap(int32(len(ps))); old != int32(len(ps)) {
			p.log.Info("topic's partition count changed", zap.String("topic", topic), zap.Int32("was", old), zap.Int("partitions", len(ps)))
		}
	}
}

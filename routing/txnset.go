package routing

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/record"
)

// txnSet holds a router's transactional producers.
type txnSet struct {
	r     *Router
	fleet string

	// eo holds the names of the exactly_once clusters, read on every
	// produce without the lock (setClusters replaces it).
	eo atomic.Pointer[map[string]bool]

	mu       sync.Mutex
	clusters map[string]config.Cluster
	live     map[txnKey]*txnProducer
	opening  map[txnKey]chan struct{}
	// fenced are the owners whose producer another owner fenced: they
	// are not opened again (which would fence the new owner back).
	fenced  map[txnKey]owner
	clients map[string]sarama.Client // per cluster, for the positions topic
	ready   map[string]bool          // positions topic exists
	// producers are the clusters' transactional Producers that carry
	// the streams (txnwire.go), one per cluster, opened under openMu.
	producers map[string]*producer
	openMu    sync.Mutex
	closed    bool
	wg        sync.WaitGroup
}

func newTxnSet(r *Router, fleet string, clusters map[string]config.Cluster) *txnSet {
	s := &txnSet{r: r, fleet: fleet, clusters: clusters, live: map[txnKey]*txnProducer{},
		opening: map[txnKey]chan struct{}{}, fenced: map[txnKey]owner{}, clients: map[string]sarama.Client{}, ready: map[string]bool{},
		producers: map[string]*producer{}}
	s.eo.Store(exactlyOnceClusters(clusters))
	return s
}

// exactlyOnce reports whether channels on cluster get exactly-once
// delivery. It takes no lock: every produce asks.
func (s *txnSet) exactlyOnce(cluster string) bool {
	return (*s.eo.Load())[cluster]
}

// exactlyOnceClusters returns the names of the exactly_once clusters.
func exactlyOnceClusters(clusters map[string]config.Cluster) *map[string]bool {
	eo := map[string]bool{}
	for name, c := range clusters {
		if c.ExactlyOnce() {
			eo[name] = true
		}
	}
	return &eo
}

func (s *txnSet) setClusters(clusters map[string]config.Cluster) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for name, c := range s.clients {
		if old, now := s.clusters[name], clusters[name]; !sameConnection(old, now) {
			_ = c.Close()
			delete(s.clients, name)
			delete(s.ready, name)
		}
	}
	for name, pr := range s.producers {
		if !sameConnection(s.clusters[name], clusters[name]) {
			// Its streams fail (ErrTxnClosed): they are broken, and
			// opened again on a Producer with the new definition.
			delete(s.producers, name)
			s.wg.Go(func() { closeClusterProducer(pr) })
		}
	}
	s.clusters = clusters
	s.eo.Store(exactlyOnceClusters(clusters))
}

func sameConnection(a, b config.Cluster) bool {
	ca, errA := kafka.Config(a)
	cb, errB := kafka.Config(b)
	return errA == nil && errB == nil && fmt.Sprint(a.Brokers) == fmt.Sprint(b.Brokers) && ca.Version == cb.Version &&
		a.TLS == b.TLS && a.SASL == b.SASL && a.Proxy == b.Proxy
}

// acquire returns the producer of k for the owner own, opening
// it in the background: it waits at most wait (or until ctx ends).
func (s *txnSet) acquire(ctx context.Context, k txnKey, own owner, wait time.Duration) (*txnProducer, error) {
	var timeout <-chan time.Time // made when first waiting: most calls find the producer open
	for {
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			return nil, errClosed
		}
		if s.fenced[k] == own {
			s.mu.Unlock()
			return nil, fmt.Errorf("the transactional producer of %s on %s was fenced: the partition has a new owner", k.positionKey(s.fleet), k.cluster)
		}
		tp := s.live[k]
		if tp != nil && tp.own == own {
			s.mu.Unlock() // before tp.mu: commit takes s.mu under tp.mu
			tp.mu.Lock()
			failed := tp.failed
			tp.mu.Unlock()
			if failed != nil {
				return nil, failed
			}
			return tp, nil
		}
		ch := s.opening[k]
		if ch == nil {
			ch = make(chan struct{})
			s.opening[k] = ch
			old := tp
			s.wg.Go(func() { s.open(k, own, old, ch) })
		}
		s.mu.Unlock()
		if timeout == nil {
			t := time.NewTimer(wait)
			defer t.Stop()
			timeout = t.C
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-timeout:
			return nil, fmt.Errorf("transactional producer of %s on %s still opening after %s", k.positionKey(s.fleet), k.cluster, wait)
		}
	}
}

// releaseWait bounds how long release waits for the producers' commits or
// openings in progress. An opening against a cluster that does not answer
// can take longer (the cluster's Producer opening, the stream's
// InitProducerID, each up to openTimeout, and the position's read):
// it then fences whoever opened the stream's producer
// meanwhile, which is logged.
const releaseWait = 15 * time.Second

// errReleased fails the producer of an owner that gave its partition up.
var errReleased = errors.New("the partition was released by its owner")

// release stops the producers of p's stream for p's owner without
// committing (Router.Release): their loops drop what they hold,
// unacknowledged, and close them; none is opened again for that owner.
// It waits, at most releaseWait, for the loops and for openings in
// progress.
func (s *txnSet) release(p record.Owned) {
	rec := &record.Record{Cluster: p.Cluster, Topic: p.Topic, SourceTopic: p.SourceTopic, Origin: p.Origin, Partition: p.Partition}
	own := owner{p.Token, p.Generation, p.Session}
	s.mu.Lock()
	var tps []*txnProducer
	var opening []chan struct{}
	for cluster := range *s.eo.Load() {
		k := txnKeyOf(cluster, rec)
		if tp := s.live[k]; tp != nil && tp.own == own {
			tps = append(tps, tp)
			delete(s.live, k)
		}
		// An opening for this owner installs nothing once it is done
		// (open checks fenced), and acquire refuses the owner.
		if ch := s.opening[k]; ch != nil {
			opening = append(opening, ch)
		}
		s.fenced[k] = own
	}
	s.mu.Unlock()
	for _, tp := range tps {
		tp.mu.Lock()
		if tp.failed == nil {
			tp.failed = errReleased
		}
		tp.mu.Unlock()
		tp.halt()
	}
	deadline := time.NewTimer(releaseWait)
	defer deadline.Stop()
	waitFor := func(ch <-chan struct{}) bool {
		select {
		case <-ch:
			return true
		case <-deadline.C:
			return false
		}
	}
	stream := txnKeyOf("", rec).positionKey(s.fleet)
	for _, ch := range opening {
		if !waitFor(ch) {
			s.r.log.Warn("a transactional producer of a released partition is still opening; it may fence the partition's next owner",
				zap.String("stream", stream), zap.Duration("waited", releaseWait))
			return
		}
	}
	for _, tp := range tps {
		if !waitFor(tp.done) {
			s.r.log.Warn("a transactional producer of a released partition is still committing or opening again; it may fence the partition's next owner",
				zap.String("cluster", tp.key.cluster), zap.String("stream", stream), zap.Duration("waited", releaseWait))
			return
		}
	}
}

// open opens the producer of k for an owner, after closing the last
// owner's (old, committing what it holds), and reads the position
// committed last. On failure nothing is installed; the next acquire tries
// again.
func (s *txnSet) open(k txnKey, own owner, old *txnProducer, done chan struct{}) {
	defer func() {
		s.mu.Lock()
		delete(s.opening, k)
		s.mu.Unlock()
		close(done)
	}()
	if old != nil {
		old.close()
	}
	tp, err := s.newProducer(k, own)
	if err != nil {
		s.r.log.Warn("cannot open a transactional producer; its records wait", zap.String("cluster", k.cluster),
			zap.String("stream", k.positionKey(s.fleet)), zap.Error(err))
		s.mu.Lock()
		if s.live[k] == old {
			delete(s.live, k)
		}
		s.mu.Unlock()
		return
	}
	s.mu.Lock()
	if s.closed || s.fenced[k] == own {
		// Closed, or the owner released the partition meanwhile.
		s.mu.Unlock()
		tp.closeProducer() // never used: its loop was not started
		return
	}
	s.live[k] = tp
	delete(s.fenced, k)
	s.wg.Go(tp.run)
	s.mu.Unlock()
}

func (s *txnSet) newProducer(k txnKey, own owner) (*txnProducer, error) {
	w, committed, err := s.openWire(k)
	if err != nil {
		return nil, err
	}
	return &txnProducer{key: k, own: own, set: s, r: s.r, log: s.r.log, w: w, committed: committed,
		kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}, nil
}

// openWire opens a wire with k's transactional.id, which fences the last
// one (Kafka aborts its open transaction, so the position read next is
// final), and reads the stream's committed position.
func (s *txnSet) openWire(k txnKey) (*txnWire, *TxnPosition, error) {
	s.mu.Lock()
	cl, ok := s.clusters[k.cluster]
	s.mu.Unlock()
	if !ok {
		return nil, nil, fmt.Errorf("cluster %q is not configured", k.cluster)
	}
	client, err := s.client(k.cluster, cl)
	if err != nil {
		return nil, nil, err
	}
	w, err := s.openStream(k, cl)
	if err != nil {
		return nil, nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), positionWait)
	defer cancel()
	committed, err := s.readPosition(ctx, client, k)
	if err != nil {
		w.close()
		return nil, nil, err
	}
	return w, committed, nil
}

// client returns the cluster's client for the positions topic, creating
// the topic on first use.
func (s *txnSet) client(name string, cl config.Cluster) (sarama.Client, error) {
	s.mu.Lock()
	c := s.clients[name]
	ready := s.ready[name]
	s.mu.Unlock()
	if c == nil {
		sc, err := kafka.Config(cl)
		if err != nil {
			return nil, err
		}
		if c, err = sarama.NewClient(cl.Brokers, sc); err != nil {
			return nil, fmt.Errorf("connect to cluster %s: %w", name, err)
		}
		s.mu.Lock()
		if prev := s.clients[name]; prev != nil {
			s.mu.Unlock()
			_ = c.Close()
			c = prev
		} else {
			s.clients[name] = c
			s.mu.Unlock()
		}
	}
	if ready {
		return c, nil
	}
	if err := ensurePositionsTopic(c); err != nil {
		return nil, fmt.Errorf("cluster %s: %w", name, err)
	}
	s.mu.Lock()
	s.ready[name] = true
	s.mu.Unlock()
	return c, nil
}

// status summarises the producers by cluster, sorted.
func (s *txnSet) status() []TxnClusterStatus {
	s.mu.Lock()
	live := make([]*txnProducer, 0, len(s.live))
	for _, tp := range s.live {
		live = append(live, tp)
	}
	s.mu.Unlock()
	by := map[string]*TxnClusterStatus{}
	for _, tp := range live {
		cs := by[tp.key.cluster]
		if cs == nil {
			cs = &TxnClusterStatus{Cluster: tp.key.cluster}
			by[tp.key.cluster] = cs
		}
		tp.mu.Lock()
		cs.Producers++
		cs.Open += len(tp.msgs)
		cs.Queued += len(tp.queued)
		if tp.align != nil {
			cs.Held += len(tp.align.held)
		}
		if tp.broken != nil {
			cs.Broken = append(cs.Broken, tp.key.positionKey(s.fleet)+": "+tp.broken.Error())
		}
		tp.mu.Unlock()
	}
	out := make([]TxnClusterStatus, 0, len(by))
	for _, name := range slices.Sorted(maps.Keys(by)) {
		slices.Sort(by[name].Broken)
		out = append(out, *by[name])
	}
	return out
}

// close closes every producer and client.
func (s *txnSet) close() {
	s.mu.Lock()
	s.closed = true
	live := make([]*txnProducer, 0, len(s.live))
	for _, tp := range s.live {
		live = append(live, tp)
	}
	s.live = map[txnKey]*txnProducer{}
	s.mu.Unlock()
	for _, tp := range live {
		tp.close()
	}
	s.wg.Wait() // the openings too: a cluster's Producer opened from now on is closed at once
	s.mu.Lock()
	for name, c := range s.clients {
		_ = c.Close()
		delete(s.clients, name)
	}
	producers := s.producers
	s.producers = map[string]*producer{}
	s.mu.Unlock()
	for _, pr := range producers {
		closeClusterProducer(pr)
	}
}

// markFenced notes that k's producer of owner own was fenced: the
// partition has a new owner, and own's records are not taken again.
func (s *txnSet) markFenced(k txnKey, own owner) {
	s.mu.Lock()
	s.fenced[k] = own
	s.mu.Unlock()
}

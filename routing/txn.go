package routing

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/offsets"
	"github.com/kswitch/kswitch/record"
)

// Exactly-once delivery (config.Cluster.Delivery exactly_once).
//
// The records of one source partition bound for channels on one
// exactly_once cluster go through one transactional producer (a
// txnProducer over its wire, a kafka.TxnStream on the cluster's
// transactional Producer: txn_direct.go), whose
// transactional.id is derived from the fleet, the cluster and the
// partition's stream (its logical topic, origin and number: the same for
// every physical copy, so that an owner on B fences the last owner on A).
// Every transaction_interval the producer adds the partition's position
// (the offset after the last record in the transaction) to the cluster's
// positions topic and commits: the records and the position become
// visible together, and only then are the records acknowledged to the
// agent, which commits its own position to etcd afterwards. etcd's
// position is therefore never ahead of the cluster's.
//
// A new owner opens the producer with the same transactional.id (Kafka
// aborts the last owner's open transaction and fences it), reads the
// position committed last, and skips, for this cluster, the records before
// it that it consumes again from etcd's older position. An owner is the
// agent consuming the partition under one generation and session
// (record.Record): when they change, the producer is opened again.

// txnKey identifies a transactional producer: the exactly_once cluster
// and the source partition's stream.
type txnKey struct {
	cluster, topic, origin string
	partition              int32
}

func txnKeyOf(cluster string, rec *record.Record) txnKey {
	// A record from a runtime that does not name the streams (an
	// embedding's own) is its own stream.
	return txnKey{cluster: cluster, topic: cmp.Or(rec.SourceTopic, rec.Topic), origin: cmp.Or(rec.Origin, rec.Cluster), partition: rec.Partition}
}

// positionKey is the key of the stream's position in the positions topic.
func (k txnKey) positionKey(fleet string) string {
	return fleet + "/" + k.topic + "/" + k.origin + "/" + strconv.Itoa(int(k.partition))
}

// transactionalID is the producer's transactional.id.
func (k txnKey) transactionalID(fleet string) string {
	return "kswitch/" + fleet + "/" + k.cluster + "/" + k.topic + "/" + k.origin + "/" + strconv.Itoa(int(k.partition))
}

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

// txnProducer is the transactional producer of one stream on one cluster
// for one owner.
type txnProducer struct {
	key txnKey
	own owner
	set *txnSet
	w   *txnWire // replaced, under mu, when it broke (reopen)
	// committed is the position of the last committed transaction (read
	// at open, then ours); nil when there is none.
	committed *TxnPosition

	mu   sync.Mutex
	msgs []*outMsg   // in the open transaction
	pos  TxnPosition // after the last record in the open transaction, but its Fingerprint
	// posRec is the last record in the open transaction: pos's
	// Fingerprint is hashed from it at the commit, not at every record
	// (FNV over the key and value was a microsecond per KiB record).
	// posRec is also the one record of its copy not yet marked in pos's
	// Done: a copy's records come in offset order, so only the last one
	// moves it (markDone once per copy and transaction, not per record).
	posRec *record.Record
	inTxn  bool
	failed error // fenced: the partition has a new owner
	// broken is set when the wire failed otherwise (its cluster went
	// away, or a commit's outcome is unknown): the loop opens another,
	// which aborts what was not committed, and sends the open
	// transaction's records again.
	broken error
	align  *alignment
	// committing is set while CommitTxn runs without mu; records handed
	// meanwhile are queued for the next transaction.
	committing bool
	queued     []*outMsg
	// aligned are the copies aligned with the committed position.
	aligned map[string]bool
	idle    int // commit ticks without a record
	// bytes is what the open transaction's records weigh (keys and
	// values); at txnCommitBytes put kicks run to commit before the
	// interval ends.
	bytes    int
	kick     chan struct{} // 1-buffered
	stop     chan struct{}
	stopOnce sync.Once // closes stop
	done     chan struct{}
	shut     sync.Once // closes w
}

// txnCommitBytes is what an open transaction's records weigh when it is
// committed without waiting for the transaction interval. Its records are
// acknowledged to the agent only at the commit, so they count against
// source.max_in_flight_mib until then: at the 50 ms default interval a
// fast stream filled the budget, and the fetching waited for the commits
// (exactly_once moved half what at_least_once did).
const txnCommitBytes = 1 << 20

// txnIdleTicks is how many transaction intervals a producer waits without
// a record before it closes.
const txnIdleTicks = 600

// owner is a partition's owner as its records name it: the generation
// and its term's token, and the agent's session (record.Record).
type owner struct{ token, gen, session int64 }

// ownerOf is the owner that consumed rec.
func ownerOf(rec *record.Record) owner { return owner{rec.Token, rec.Generation, rec.Session} }

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
	// the streams (txn_direct.go), one per cluster, opened under openMu.
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

// halt ends the producer's loop; any goroutine may call it, more than
// once.
func (t *txnProducer) halt() { t.stopOnce.Do(func() { close(t.stop) }) }

// stopped is the end of the loop of a producer halted after it failed
// (fenced, or released): what it holds is dropped unacknowledged, and it
// is closed, in the background (a producer whose cluster is failing may
// take its retries to close). A producer halted otherwise is closed by
// close.
func (t *txnProducer) stopped() {
	t.mu.Lock()
	failed := t.failed
	dropped := len(t.msgs) + len(t.queued)
	if a := t.align; a != nil {
		dropped += len(a.held)
	}
	if failed != nil {
		t.dropAll()
	}
	t.mu.Unlock()
	if failed == nil {
		return
	}
	if dropped > 0 {
		t.set.r.log.Info("transactional producer stopped: its records not committed are dropped, for the partition's next owner to deliver",
			zap.String("cluster", t.key.cluster), zap.String("stream", t.key.positionKey(t.set.fleet)), zap.Int("records", dropped), zap.Error(failed))
	}
	t.set.wg.Go(t.closeProducer)
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
	return &txnProducer{key: k, own: own, set: s, w: w, committed: committed,
		kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}, nil
}

// positionWait bounds the reading of a stream's committed position when
// its wire opens.
const positionWait = 10 * time.Second

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

// add puts om in the open transaction, beginning one if needed. It does
// not wait on the network.
func (t *txnProducer) add(om *outMsg) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.failed != nil {
		return t.failed
	}
	if t.broken != nil {
		return fmt.Errorf("transactional producer of %s on %s being opened again: %w", t.key.positionKey(t.set.fleet), t.key.cluster, t.broken)
	}
	if t.committing {
		// The partition's loop does not wait for the commit: the
		// record joins the next transaction when it ends.
		t.queued = append(t.queued, om)
		return nil
	}
	return t.admit(om)
}

// admit puts om in the open transaction, or holds or skips it while a
// copy is aligned. Called with mu held.
func (t *txnProducer) admit(om *outMsg) error {
	rec := om.d.rec
	if t.align == nil && t.mustAlign(rec) {
		t.align = &alignment{copy: physical(rec.Cluster, rec.Topic, rec.Partition), since: time.Now()}
	}
	if a := t.align; a != nil {
		c := t.committed
		ts := rec.Timestamp.UnixMilli()
		switch {
		case ts == c.TimestampMs && offsets.FingerprintOf(rec.Key, rec.Value, rec.Timestamp) == c.Fingerprint:
			// The last record committed, on this copy: it and what
			// came before it here were delivered from the other copy.
			for _, h := range append(a.held, om) {
				t.set.r.skip(h)
			}
			t.endAlign(len(a.held)+1, "matched")
			return nil
		case ts <= c.TimestampMs:
			a.held = append(a.held, om) // before the last committed record, or it
			return nil
		default: // after it: the copy does not hold it where expected
			held := a.held
			t.endAlign(0, "passed")
			for _, h := range held {
				if err := t.put(h); err != nil {
					return err
				}
			}
		}
	}
	return t.put(om)
}

// alignment is a producer's search, on a copy of the stream other than
// the one its last committed transaction consumed, for the last record
// committed (by fingerprint): the owner starts from etcd's position, which
// may be behind the cluster's (an owner crashed, then the fleet switched
// clusters), translated to this copy. The records up to that one were
// delivered before and are skipped. Records are held until it is found;
// the first record after its timestamp, or alignTimeout, ends the search
// and the held records are delivered (at least once: no record is skipped
// that might not have been delivered).
type alignment struct {
	copy  string
	since time.Time
	held  []*outMsg
}

// alignTimeout bounds how long records are held while a copy is aligned.
// The records held are older than the last committed one: in order, they
// came before it and were delivered, unless the copy never gets it. A
// mirror that lagged when the fleet switched copies the rest once it can
// (after a broker restart, or once A is back): seconds, not 1 s (a 1 s
// hold gave up and delivered them again, TestExactlyOnceOnRealKafka). It
// stays below the agent's default StuckAfter (30 s), so a hold does not
// make the agent unready.
const alignTimeout = 20 * time.Second

// mustAlign reports whether rec's copy is not the one the last committed
// transaction consumed and has not been aligned by this producer.
func (t *txnProducer) mustAlign(rec *record.Record) bool {
	c := t.committed
	if c == nil || c.TimestampMs <= 0 || (c.Cluster == rec.Cluster && c.Topic == rec.Topic && c.Partition == rec.Partition) {
		return false
	}
	return !t.aligned[physical(rec.Cluster, rec.Topic, rec.Partition)]
}

// endAlign ends the alignment; skipped records were found delivered.
func (t *txnProducer) endAlign(skipped int, how string) {
	a := t.align
	t.align = nil
	if t.aligned == nil {
		t.aligned = map[string]bool{}
	}
	t.aligned[a.copy] = true
	t.set.r.log.Info("exactly-once: aligned a copy of the stream with the last committed transaction", zap.String("cluster", t.key.cluster),
		zap.String("stream", t.key.positionKey(t.set.fleet)), zap.String("copy", a.copy), zap.String("how", how),
		zap.Int("skipped", skipped), zap.Duration("held", time.Since(a.since)))
}

// put adds om to the open transaction, beginning one if needed. Called
// with mu held.
func (t *txnProducer) put(om *outMsg) error {
	if err := t.w.send(om); err != nil {
		return t.fail(fmt.Errorf("transactional producer of %s on %s: %w", t.key.positionKey(t.set.fleet), t.key.cluster, err))
	}
	t.inTxn = true
	rec := om.d.rec
	t.msgs = append(t.msgs, om)
	t.idle = 0
	if t.bytes += len(rec.Key) + len(rec.Value); t.bytes >= txnCommitBytes {
		select {
		case t.kick <- struct{}{}:
		default:
		}
	}
	done, ids := t.pos.Done, t.pos.IDs
	if done == nil {
		done, ids = t.committed.carried()
	}
	if p := t.posRec; p != nil && (p.Cluster != rec.Cluster || p.Topic != rec.Topic || p.Partition != rec.Partition || p.TopicID != rec.TopicID) {
		markDone(done, ids, p) // the last of another copy's records: its copy is done to there
	}
	t.pos = TxnPosition{Cluster: rec.Cluster, Topic: rec.Topic, Partition: rec.Partition, Offset: rec.Offset + 1,
		TimestampMs: rec.Timestamp.UnixMilli(), Generation: rec.Generation, Session: rec.Session, Done: done, IDs: ids}
	t.posRec = rec
	return nil
}

// fail marks the producer fenced or broken; called with mu held.
func (t *txnProducer) fail(err error) error {
	if fenced(err) {
		t.failed = err
	} else {
		t.broken = err
	}
	return err
}

// run commits the open transaction every transaction interval, or sooner
// when it weighs txnCommitBytes, until the producer is closed.
func (t *txnProducer) run() {
	defer close(t.done)
	t.set.mu.Lock()
	// A configuration built in code without config.Validate has none.
	interval := cmp.Or(t.set.clusters[t.key.cluster].TransactionInterval, config.DefaultTransactionInterval)
	t.set.mu.Unlock()
	tick := time.NewTicker(max(interval, 10*time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-t.stop:
			t.stopped()
			return
		case <-tick.C:
		case <-t.kick:
			t.mu.Lock()
			open := t.inTxn // not if a commit since the kick took its records: a commit of nothing counts an idle tick
			t.mu.Unlock()
			if !open {
				continue
			}
		}
		if t.reopen() {
			continue
		}
		if t.commit() {
			t.retire()
			return
		}
	}
}

// retire removes an idle or failed producer from the set and closes it.
func (t *txnProducer) retire() {
	s := t.set
	s.mu.Lock()
	if s.live[t.key] == t {
		delete(s.live, t.key)
	}
	s.mu.Unlock()
	t.closeProducer()
}

func (t *txnProducer) closeProducer() {
	t.mu.Lock()
	w := t.w
	t.mu.Unlock()
	t.shut.Do(w.close)
}

// place readies om for its wire (txnWire.place) before any produce of
// its record is handed over.
func (t *txnProducer) place(ctx context.Context, om *outMsg, wait time.Duration) error {
	t.mu.Lock()
	w := t.w
	t.mu.Unlock()
	return w.place(ctx, om, wait)
}

// covers reports whether rec was produced by a committed transaction.
func (t *txnProducer) covers(rec *record.Record) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.committed.covers(rec)
}

// reopen replaces a broken wire (see broken) and reports
// whether it tried. The new one aborts what the old one did not commit;
// the records of the open transaction are then skipped if the position
// read says that their transaction did commit (the commit's answer was
// lost), and sent again in a new one otherwise. A failed attempt is tried
// again at the next tick.
func (t *txnProducer) reopen() bool {
	t.mu.Lock()
	broken, failed := t.broken, t.failed
	t.mu.Unlock()
	if broken == nil || failed != nil {
		return false // failed: released or fenced, never opened again
	}
	w, committed, err := t.set.openWire(t.key)
	if err != nil {
		t.set.r.log.Debug("transactional producer not opened again yet", zap.String("cluster", t.key.cluster), zap.Error(err))
		return true
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.failed != nil {
		// Released while it opened: its opening fenced whoever opened
		// the stream's producer meanwhile (release waited for it, at
		// most releaseWait).
		t.set.wg.Go(w.close)
		return true
	}
	old := t.w
	t.set.wg.Go(old.close) // a broken producer's Close may wait for its retries
	t.w, t.committed, t.broken, t.inTxn = w, committed, nil, false
	t.shut = sync.Once{}
	msgs := t.msgs
	t.msgs, t.pos.Done, t.pos.IDs, t.posRec, t.bytes = nil, nil, nil, nil, 0
	skipped := 0
	for i, om := range msgs {
		if committed.covers(om.d.rec) {
			t.set.r.skip(om)
			skipped++
			continue
		}
		if err := t.put(om); err != nil {
			// Broken again: the rest wait for the next attempt.
			t.msgs = append(t.msgs, msgs[i:]...)
			break
		}
	}
	if t.broken == nil {
		t.admitQueued()
	}
	t.set.r.log.Info("transactional producer opened again", zap.String("cluster", t.key.cluster),
		zap.String("stream", t.key.positionKey(t.set.fleet)), zap.Int("committed_before", skipped), zap.Int("sent_again", len(msgs)-skipped))
	return true
}

// commit commits the open transaction with the position it completes,
// then acknowledges its records. An abortable failure aborts it and
// sends the same records again in a new one. It reports whether the
// producer should close: idle for long, or failed for good (fenced: the
// partition has a new owner, whose consumption redoes what this owner did
// not commit).
func (t *txnProducer) commit() (closeIt bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.failed != nil {
		t.dropAll()
		return true
	}
	if t.broken != nil {
		return false // reopen's business
	}
	if a := t.align; a != nil && time.Since(a.since) >= alignTimeout {
		held := a.held
		t.endAlign(0, "timed out")
		for _, h := range held {
			if err := t.put(h); err != nil {
				t.dropAll()
				return true
			}
		}
	}
	if !t.inTxn {
		if t.align != nil || len(t.queued) > 0 {
			t.idle = 0 // records held while a copy is aligned
		} else {
			t.idle++
		}
		return t.idle >= txnIdleTicks
	}
	t.settlePos()
	val, err := json.Marshal(t.pos)
	if err != nil {
		t.fail(err)
		t.dropAll()
		return true
	}
	t.committing = true
	w := t.w
	t.mu.Unlock()
	refused, err := w.commit([]byte(t.key.positionKey(t.set.fleet)), val)
	t.mu.Lock()
	t.committing = false
	defer t.admitQueued()
	m := t.set.r.m.txns
	if err == nil {
		m.WithLabelValues(t.key.cluster, "committed").Inc()
		t.inTxn, t.bytes = false, 0
		pos := t.pos
		t.committed = &pos
		t.pos.Done, t.pos.IDs = nil, nil // the next transaction's start from copies of pos's
		msgs := t.msgs
		t.msgs = nil
		for _, om := range msgs {
			t.set.r.produced(om)
		}
		return false
	}
	if errors.Is(err, kafka.ErrTxnAborted) && !fenced(err) {
		t.set.r.log.Warn("transaction aborted; its records are sent again in the next", zap.String("cluster", t.key.cluster),
			zap.String("stream", t.key.positionKey(t.set.fleet)), zap.Int("records", len(t.msgs)), zap.Int("refused", len(refused)), zap.Error(err))
		m.WithLabelValues(t.key.cluster, "aborted").Inc()
		t.refusedInTxn(refused, err)
		return false
	}
	if t.fail(fmt.Errorf("transaction on cluster %s failed: %w", t.key.cluster, err)); t.broken != nil {
		m.WithLabelValues(t.key.cluster, "failed").Inc()
		t.set.r.log.Warn("transactional producer failed; it is opened again and its open transaction's records sent again",
			zap.String("cluster", t.key.cluster), zap.String("stream", t.key.positionKey(t.set.fleet)), zap.Int("records", len(t.msgs)), zap.Error(err))
		return false
	}
	if fenced(err) {
		m.WithLabelValues(t.key.cluster, "fenced").Inc()
		t.set.mu.Lock()
		t.set.fenced[t.key] = t.own
		t.set.mu.Unlock()
		t.set.r.log.Info("transactional producer fenced: the partition has a new owner", zap.String("cluster", t.key.cluster),
			zap.String("stream", t.key.positionKey(t.set.fleet)))
	}
	t.dropAll()
	return true
}

// settlePos completes pos with posRec: its copy's done offset and its
// fingerprint. Called with mu held, while posRec is not acknowledged (its
// key and value are whole until then: record.Handler).
func (t *txnProducer) settlePos() {
	if r := t.posRec; r != nil {
		markDone(t.pos.Done, t.pos.IDs, r)
		t.pos.Fingerprint, t.posRec = offsets.FingerprintOf(r.Key, r.Value, r.Timestamp), nil
	}
}

// refusedInTxn takes out of the open transaction the records a
// destination refused for good in the one just aborted (the stream names
// them; they are not in the new one). With a dead-letter channel
// they go there, at least once, as at_least_once produces refused do;
// without one, or for an error the router does not take for a refusal,
// they are put in the transaction again: it is refused and aborted again,
// and the stream's records wait until the routes change, as an
// at_least_once partition blocks. Called with mu held.
func (t *txnProducer) refusedInTxn(refused []*outMsg, err error) {
	if len(refused) == 0 {
		return
	}
	if slices.ContainsFunc(refused, func(om *outMsg) bool { return om.d.rec == t.posRec }) {
		t.settlePos() // now: dead-lettered, it may be acknowledged (and let go of its value) before the next commit
	}
	t.msgs = slices.DeleteFunc(t.msgs, func(om *outMsg) bool { return slices.Contains(refused, om) })
	var ae *kafka.TxnAbortedError
	cause := err
	if errors.As(err, &ae) {
		cause = ae.Err
	}
	if t.set.r.cur.Load().deadLetter != nil && permanent(cause) {
		for _, om := range refused {
			t.set.r.failed(om, cause)
		}
		return
	}
	t.set.r.log.Error("a destination refused a record of a transaction for good and there is no dead-letter channel; the stream's transactions abort until the routes change",
		zap.String("cluster", t.key.cluster), zap.String("stream", t.key.positionKey(t.set.fleet)), zap.Int("refused", len(refused)), zap.Error(cause))
	for _, om := range refused {
		if t.w.send(om) != nil {
			t.set.r.settle(om) // the wire failed: consumed again from the committed position
			continue
		}
		t.msgs = append(t.msgs, om)
	}
}

// admitQueued puts the records queued during a commit in the next
// transaction; those that cannot go in yet (the producer failed) stay
// queued. Called with mu held.
func (t *txnProducer) admitQueued() {
	if t.failed != nil || t.broken != nil {
		return
	}
	q := t.queued
	t.queued = nil
	for i, om := range q {
		if err := t.admit(om); err != nil {
			t.queued = append(q[i:i:i], q[i:]...)
			return
		}
	}
}

// dropAll forgets the open transaction's records without acknowledging
// them: they are consumed again (by this agent or the partition's next
// owner) from the last committed position. Called with mu held.
func (t *txnProducer) dropAll() {
	for _, om := range t.msgs {
		t.set.r.settle(om)
	}
	if a := t.align; a != nil {
		for _, om := range a.held {
			t.set.r.settle(om)
		}
		t.align = nil
	}
	for _, om := range t.queued {
		t.set.r.settle(om)
	}
	t.msgs, t.queued = nil, nil
	t.inTxn = false
}

// close commits what the producer holds and closes it.
func (t *txnProducer) close() {
	t.halt()
	<-t.done
	t.commit()
	t.mu.Lock()
	t.dropAll()
	t.mu.Unlock()
	t.closeProducer()
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

// fenced reports whether err says that another producer with the same
// transactional.id took over.
func fenced(err error) bool {
	return errors.Is(err, kafka.ErrTxnFenced) || errors.Is(err, sarama.ErrProducerFenced) || errors.Is(err, sarama.ErrInvalidProducerEpoch) ||
		errors.Is(err, sarama.ErrTransactionCoordinatorFenced)
}

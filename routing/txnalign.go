package routing

import (
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/record"
)

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
	t.log.Info("exactly-once: aligned a copy of the stream with the last committed transaction", zap.String("cluster", t.key.cluster),
		zap.String("stream", t.key.positionKey(t.set.fleet)), zap.String("copy", a.copy), zap.String("how", how),
		zap.Int("skipped", skipped), zap.Duration("held", time.Since(a.since)))
}

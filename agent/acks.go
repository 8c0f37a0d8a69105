package agent

import (
	"context"
	"encoding/json"
	"maps"
	"strconv"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// ack tells the leader this agent has applied gen. A failed write is
// tried again on the next commit ticks (ackDue).
func (w *worker) ack(ctx context.Context, gen int64) {
	var err error
	if w.ackFails != nil {
		err = w.ackFails(gen)
	}
	if err == nil {
		actx, cancel := context.WithTimeout(ctx, w.cfg.Etcd.RequestTimeout)
		_, err = w.etcd.Put(actx, w.keys.Ack(w.id), strconv.FormatInt(gen, 10), clientv3.WithLease(w.lease))
		cancel()
	}
	if err != nil {
		if w.ackDue != gen {
			w.log.Warn("cannot acknowledge generation; trying again at the next commit tick", zap.Int64("generation", gen), zap.Error(err))
		}
		w.ackDue = gen
		return
	}
	if w.ackDue != 0 {
		w.log.Info("acknowledged generation", zap.Int64("generation", gen))
	}
	w.ackDue = 0
}

// deadLetterInterval is how often the worker publishes its handler's
// dead-letter counts when they changed.
const deadLetterInterval = time.Second

// publishDeadLetters writes the handler's dead-letter counts to
// deadletters/<id> on the session lease whenever they changed, at most
// every deadLetterInterval, until ctx ends: a staged move's check reads
// them (state.ParseDeadLetters).
func (w *worker) publishDeadLetters(ctx context.Context, counts func() map[string]int64) {
	tick := time.NewTicker(deadLetterInterval)
	defer tick.Stop()
	var last map[string]int64
	for {
		if counts := counts(); !maps.Equal(counts, last) {
			val, err := json.Marshal(counts)
			if err == nil {
				pctx, cancel := context.WithTimeout(ctx, w.cfg.Etcd.RequestTimeout)
				_, err = w.etcd.Put(pctx, w.keys.DeadLetterCount(w.id), string(val), clientv3.WithLease(w.lease))
				cancel()
			}
			if err == nil {
				last = counts
			} else if ctx.Err() == nil {
				w.log.Debug("cannot publish the dead-letter counts; trying again", zap.Error(err))
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

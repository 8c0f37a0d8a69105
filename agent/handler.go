package agent

import (
	"context"
	"sync/atomic"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/record"
)

// CountingHandler is the handler of an agent without routes: it logs each
// record at debug level, acknowledges it and counts it.
type CountingHandler struct {
	Log   *zap.Logger
	count atomic.Int64
}

// Handle logs, counts and acknowledges r.
func (h *CountingHandler) Handle(_ context.Context, r *record.Record) error {
	if h.Log != nil && h.Log.Core().Enabled(zap.DebugLevel) {
		h.Log.Debug("record", zap.String("topic", r.Topic), zap.Int32("partition", r.Partition),
			zap.Int64("offset", r.Offset), zap.Int("bytes", len(r.Value)))
	}
	h.count.Add(1)
	r.Ack()
	return nil
}

// KeptPerRecord is 0: a record is acknowledged as it is handled
// (record.Keeper).
func (h *CountingHandler) KeptPerRecord() int { return 0 }

// Count returns how many records were handled.
func (h *CountingHandler) Count() int64 { return h.count.Load() }

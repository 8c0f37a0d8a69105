package translate

import (
	"context"
	"fmt"
	"time"

	"github.com/kswitch/kswitch/internal/kafka"
)

// timestamp is method 3.
func (c *translateCall) timestamp(ctx context.Context) (Translation, error) {
	ts := c.req.Position.Timestamp
	if ts.IsZero() {
		if c.req.Unconsumed == "newest" {
			return Translation{Offset: c.end, Method: MethodTimestamp, Rewound: 0,
				Detail: "timestamp: the position has no timestamp (nothing consumed there yet): the target's end, as for source.initial_offset newest"}, nil
		}
		return Translation{Offset: c.oldest, Method: MethodTimestamp, Rewound: -1,
			Detail: "timestamp: the position has no timestamp (nothing consumed there yet): the target's oldest offset"}, nil
	}
	off, err := c.atTimestamp(ctx)
	if err != nil {
		return Translation{}, err
	}
	return Translation{Offset: off, Method: MethodTimestamp, Rewound: -1,
		Detail: fmt.Sprintf("timestamp: first offset at or after %s minus %v",
			ts.UTC().Format(time.RFC3339Nano), c.t.TimestampMargin)}, nil
}

// atTimestamp returns the first target offset whose record's timestamp is
// at or after the position's timestamp minus the margin, or the end if
// there is none.
func (c *translateCall) atTimestamp(ctx context.Context) (int64, error) {
	// A negative timestamp would mean "latest" (-1) or "earliest" (-2).
	ms := max(c.req.Position.Timestamp.Add(-c.t.TimestampMargin).UnixMilli(), 0)
	off, err := kafka.ListOffset(ctx, c.t.Target, c.req.Topic, c.req.Partition, ms)
	if err != nil {
		return 0, fmt.Errorf("list offset at timestamp %d: %w", ms, err)
	}
	if off < 0 {
		return c.end, nil
	}
	return c.clamp(off), nil
}

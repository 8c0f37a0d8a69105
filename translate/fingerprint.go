package translate

import (
	"context"
	"fmt"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/offsets"
)

// fingerprint is method 1.
func (c *translateCall) fingerprint(ctx context.Context) (Translation, error) {
	req := c.req
	fps := req.Position.Fingerprints
	n := int64(len(fps))
	first := req.Position.Offset - n // source offset of the first fingerprinted record

	start, from, err := c.scanStart(ctx, first)
	if err != nil {
		return Translation{}, err
	}

	sctx, cancel := stage(ctx, 0.5)
	defer cancel()
	limit := c.t.scanLimit()
	s1, err := scanFingerprints(sctx, c.t.Target, Span{Topic: req.Topic, Partition: req.Partition, From: start, Stop: c.end, Limit: int64(limit)}, fps, start > c.oldest)
	if err != nil {
		return Translation{}, fmt.Errorf("scan from %d: %w", start, err)
	}
	best, how := s1.best, fmt.Sprintf("scanned %d records from %d (%s)", s1.read, start, from)
	if best.matched < len(fps) && start > c.oldest {
		// The estimate may be past the run's beginning (or past its end:
		// a first record newer than the position says so).
		if s1.read > 0 && !req.Position.Timestamp.IsZero() && s1.firstTS.After(req.Position.Timestamp) {
			how += fmt.Sprintf(", overshot (first record at %s is after the position's %s)",
				s1.firstTS.UTC().Format(time.RFC3339Nano), req.Position.Timestamp.UTC().Format(time.RFC3339Nano))
		}
		// A run cut short by the scan's start lacks only its first
		// records, just before start (a few offsets per record allow for
		// transaction markers). Without any match, go back as far as the
		// limit allows while still reaching past start by a full run.
		back := max(int64(limit)-2*n, 1)
		if s1.best.truncated {
			back = 4 * n
		}
		retry := max(c.oldest, start-back)
		s2, err := scanFingerprints(sctx, c.t.Target, Span{Topic: req.Topic, Partition: req.Partition, From: retry, Stop: max(s1.next, start), Limit: int64(limit)}, fps, false)
		if err != nil {
			return Translation{}, fmt.Errorf("%s; rescan from %d: %w", how, retry, err)
		}
		how += fmt.Sprintf(", then %d from %d", s2.read, retry)
		if s2.best.matched > best.matched || (s2.best.matched == best.matched && s2.best.matched > 0 && s2.best.next < best.next) {
			best = s2.best
		}
	}
	if best.matched == 0 {
		// A replica that lags behind the consumer holds a prefix of what
		// was consumed: its last record is one of the earlier
		// fingerprinted ones. Everything on the target was then consumed,
		// and the continuation is its end; the newer consumed records
		// never reached it (they are not lost: they were delivered).
		if j, err := c.lagMatch(sctx, fps); err == nil && j >= 0 {
			return Translation{
				Offset: c.end, Method: MethodFingerprint, Rewound: 0, Lagged: n - 1 - int64(j),
				Detail: fmt.Sprintf("fingerprint: the target lags: its last record (offset %d) is the record consumed %d before the committed position; continuing at its end; %s",
					c.end-1, n-int64(j), how),
			}, nil
		}
		reason := "the last consumed record is not on the target"
		if c.end <= start {
			reason += " (the target may lag behind)"
		}
		return Translation{}, fmt.Errorf("%s: %s", how, reason)
	}
	return Translation{
		Offset:  best.next,
		Method:  MethodFingerprint,
		Rewound: 0,
		Detail: fmt.Sprintf("fingerprint: matched the last %d of %d fingerprints, last at offset %d; %s",
			best.matched, len(fps), best.next-1, how),
	}, nil
}

// scanStart returns where the fingerprint scan starts, for source offset
// first (the first fingerprinted record), and what the estimate is from:
// the request's hint; else the offset-syncs; else the position's
// timestamp; else the oldest offset.
func (c *translateCall) scanStart(ctx context.Context, first int64) (int64, string, error) {
	if h := c.req.Hint; h != nil {
		// The copies of later source records come later on the target:
		// records consumed since the hint are at or after its target
		// offset; for those before it, count back one offset a record.
		return c.clamp(h.TargetOffset - max(0, h.SourceOffset-first)),
			fmt.Sprintf("the earlier translation of offset %d to %d", h.SourceOffset, h.TargetOffset), nil
	}
	c.loadSyncs(ctx)
	if r, err := c.syncEstimate(first); err == nil {
		return c.clamp(r.offset), "the offset-syncs' translation of offset " + fmt.Sprint(first), nil
	}
	if c.req.Position.Timestamp.IsZero() {
		return c.oldest, "the oldest offset", nil
	}
	sctx, cancel := stage(ctx, 0.25)
	defer cancel()
	off, err := c.atTimestamp(sctx)
	if err != nil {
		return 0, "", err
	}
	return off, "the position's timestamp", nil
}

// lagMatch reports which fingerprint (index into fps, not the last) the
// target's last records match as a run ending at the target's end, or -1.
func (c *translateCall) lagMatch(ctx context.Context, fps []offsets.Fingerprint) (int, error) {
	n := len(fps)
	if c.end <= c.oldest || n < 2 {
		return -1, nil
	}
	from := max(c.oldest, c.end-int64(n))
	var tail []offsets.Fingerprint
	_, err := kafka.ReadPartition(ctx, c.t.Target, c.req.Topic, c.req.Partition, from, func(r kafka.Record) bool {
		if r.Offset >= c.end {
			return false
		}
		tail = append(tail, offsets.FingerprintOf(r.Key, r.Value, r.Timestamp))
		return true
	})
	if err != nil || len(tail) == 0 {
		return -1, err
	}
	last := tail[len(tail)-1]
	for j := n - 2; j >= 0; j-- {
		if fps[j] != last {
			continue
		}
		// The records before it must match too, as far as both go.
		ok := true
		for k := 1; k <= j && k < len(tail); k++ {
			if tail[len(tail)-1-k] != fps[j-k] {
				ok = false
				break
			}
		}
		if ok {
			return j, nil
		}
	}
	return -1, nil
}

// scan is the outcome of one fingerprint scan.
type scan struct {
	best    fpMatch
	read    int       // records read
	next    int64     // the offset after the last record read
	firstTS time.Time // the first record's timestamp
}

// fpMatch is a run of records matching a suffix of the fingerprints.
type fpMatch struct {
	matched int   // its length, 0 if none
	next    int64 // the offset after its last record
	// truncated: the run began at the scan's first record and is shorter
	// than the fingerprints: it may go on before the scan's start.
	truncated bool
}

// Span is the records of one partition a reader reads: from offset From
// until offset Stop (Stop < 0: the partition's end), at most Limit of
// them.
type Span struct {
	Topic      string
	Partition  int32
	From, Stop int64
	Limit      int64
}

// scanFingerprints reads sp (Stop >= 0) and returns the longest (then
// earliest) run of consecutive records matching a suffix of fps. It stops
// early at a full match and, if stopTruncated, at a truncated one (which
// a scan from further back is to complete).
func scanFingerprints(ctx context.Context, client sarama.Client, sp Span, fps []offsets.Fingerprint, stopTruncated bool) (scan, error) {
	s := scan{next: sp.From}
	n := len(fps)
	window := make([]offsets.Fingerprint, 0, n) // the last n records' fingerprints
	if sp.From >= sp.Stop {
		return s, nil
	}
	_, err := kafka.ReadPartition(ctx, client, sp.Topic, sp.Partition, sp.From, func(r kafka.Record) bool {
		if r.Offset >= sp.Stop {
			return false
		}
		if s.read == 0 {
			s.firstTS = r.Timestamp
		}
		s.read++
		s.next = r.Offset + 1
		fp := offsets.FingerprintOf(r.Key, r.Value, r.Timestamp)
		if len(window) == n {
			copy(window, window[1:])
			window = window[:n-1]
		}
		window = append(window, fp)
		if fp == fps[n-1] {
			k := 1
			for k < n && k < len(window) && window[len(window)-1-k] == fps[n-1-k] {
				k++
			}
			if k > s.best.matched {
				s.best = fpMatch{matched: k, next: r.Offset + 1, truncated: k < n && k == s.read}
				if s.best.truncated && stopTruncated {
					return false
				}
			}
		}
		return s.best.matched < n && int64(s.read) < sp.Limit
	})
	return s, err
}

// CountBefore reads sp until the first record whose timestamp is not
// before `before`, and returns how many records it read and the first
// one's timestamp. More than sp.Limit records says truncated. It counts
// the records of a replica's tail that were written before a moment, such
// as the records a primary held at a failover that its replica did not.
func CountBefore(ctx context.Context, client sarama.Client, sp Span, before time.Time) (n int64, first time.Time, truncated bool, err error) {
	if sp.Stop >= 0 && sp.From >= sp.Stop {
		return 0, time.Time{}, false, nil
	}
	_, err = kafka.ReadPartition(ctx, client, sp.Topic, sp.Partition, sp.From, func(r kafka.Record) bool {
		if (sp.Stop >= 0 && r.Offset >= sp.Stop) || !r.Timestamp.Before(before) {
			return false
		}
		if n == sp.Limit {
			truncated = true
			return false
		}
		if n == 0 {
			first = r.Timestamp
		}
		n++
		return true
	})
	return n, first, truncated, err
}

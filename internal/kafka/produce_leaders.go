package kafka

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"
)

func (p *Producer) kickResolver() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// backoff is the wait before the n-th resend (n >= 1).
func (p *Producer) backoff(n int) time.Duration {
	d := p.cfg.RetryBackoff
	for i := 1; i < n && d < p.cfg.RetryBackoffMax; i++ {
		d *= 2
	}
	return min(d, p.cfg.RetryBackoffMax)
}

// resolve is the resolver goroutine: it finds the leader of each
// partition without a sink, and bumps the producer id once a bump is
// wanted and nothing is in flight.
func (p *Producer) resolve() {
	defer close(p.resolved)
	defer p.releaseClient()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	failures, bumpFailures := 0, 0
	for {
		wait := time.Duration(0)
		ready, hold := p.bumpReady(time.Now())
		if hold > 0 {
			wait = hold // the bump's BumpInterval ends
		}
		if ready {
			// A failed InitProducerID is tried again after a backoff (every
			// partition waits for the bump meanwhile: a bump given up
			// would hold them for good).
			if err := p.bumpProducerID(); err != nil {
				bumpFailures++
				wait = p.backoff(bumpFailures)
			} else {
				bumpFailures = 0
			}
		}
		if !p.assignLeaders() {
			failures++
			if w := p.backoff(failures); wait == 0 || w < wait {
				wait = w
			}
		} else {
			failures = 0
		}
		if wait > 0 {
			timer.Reset(wait)
		}
		select {
		case <-p.quit:
			return
		case <-p.kick:
		case <-timer.C:
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
	}
}

// assignLeaders gives each partition without a sink its leader's sink.
// It returns false when a leader could not be found (to retry later).
func (p *Producer) assignLeaders() bool {
	p.mu.Lock()
	var todo []*partState
	topics := map[string]bool{}
	orphan := func(ps *partState) {
		if ps.sink == nil && ps.reported == 0 {
			todo = append(todo, ps)
			if ps.refresh {
				topics[ps.topic] = true
			}
		}
	}
	for _, ps := range p.parts {
		orphan(ps)
	}
	for t := range p.streams {
		for _, ps := range t.parts {
			orphan(ps)
		}
	}
	p.mu.Unlock()
	if len(todo) == 0 {
		return true
	}
	ok := true
	if len(topics) > 0 && !p.isClosing() {
		if err := p.client.RefreshMetadata(slices.Collect(maps.Keys(topics))...); err != nil {
			p.log.Debug("metadata refresh failed", zap.Error(err))
		}
	}
	for _, ps := range todo {
		select {
		case <-p.quit: // each lookup may take the client's timeouts on a hung cluster
			return true
		default:
		}
		b, err := p.client.Leader(ps.topic, ps.partition)
		if err != nil {
			ok = false
			p.mu.Lock()
			if p.closing {
				p.mu.Unlock()
				return true
			}
			ps.lastErr = fmt.Errorf("kafka: leader of %s/%d on cluster %s: %w", ps.topic, ps.partition, p.name, err)
			ps.refresh = true
			p.mu.Unlock()
			continue
		}
		p.mu.Lock()
		if p.closing {
			p.mu.Unlock()
			return true
		}
		if ps.txn != nil && ps.txn.err != nil {
			p.mu.Unlock()
			continue // its stream ended meanwhile: nothing of it is sent again
		}
		s := p.sinks[b.ID()]
		if s == nil || s.addr != b.Addr() {
			s = newSink(p, b.ID(), b.Addr())
			p.sinks[b.ID()] = s
		}
		ps.sink, ps.refresh, ps.gate = s, false, true
		s.parts = append(s.parts, ps)
		p.mu.Unlock()
		s.wake()
	}
	return ok
}

// bumpReady reports whether a bump is wanted and may run: nothing is in
// flight, no partition's next batch may have been written, and
// BumpInterval has passed since the last bump. Otherwise hold is how long
// the interval still holds a drained bump back (0 when it does not).
func (p *Producer) bumpReady(now time.Time) (ready bool, hold time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.bump == "" || p.closing {
		return false, 0
	}
	for _, ps := range p.parts {
		if len(ps.inflight) > 0 || len(ps.queue) > 0 && ps.queue[0].maybe {
			return false, 0
		}
	}
	if p.bumpedAt.IsZero() {
		return true, 0
	}
	at := p.bumpedAt.Add(p.cfg.BumpInterval)
	if !now.Before(at) {
		return true, 0
	}
	if !p.bumpDelayed {
		p.bumpDelayed = true
		p.stats.bumpsDelayed.Add(1)
		err := fmt.Errorf("kafka: producer for cluster %s: the sequence was lost again (%s) %s after the last new producer id; the next is taken at %s (one per %s): a broker keeps losing producer state",
			p.name, p.bump, now.Sub(p.bumpedAt).Round(time.Millisecond), at.Format(time.RFC3339Nano), p.cfg.BumpInterval)
		for _, ps := range p.parts {
			if ps.pending > 0 {
				ps.lastErr = err
			}
		}
		p.log.Warn("producer id bump delayed: the sequence was lost again within the bump interval",
			zap.String("reason", p.bump), zap.Duration("since_last", now.Sub(p.bumpedAt)), zap.Duration("interval", p.cfg.BumpInterval))
	}
	return false, at.Sub(now)
}

// bumpProducerID takes a new producer id and renumbers every partition's
// unacknowledged batches from 0, in order (drain-and-bump, §3). It asks
// once: on failure every waiting partition's Stall.Err says why, and the
// resolver asks again after a backoff.
func (p *Producer) bumpProducerID() error {
	pid, epoch, err := p.initProducerIDOnce()
	p.mu.Lock()
	if p.closing {
		p.mu.Unlock()
		return nil
	}
	if err != nil {
		err = fmt.Errorf("kafka: InitProducerID on cluster %s for a new producer id (%s), every partition waits for it: %w", p.name, p.bump, err)
		for _, ps := range p.parts {
			if ps.pending > 0 {
				ps.lastErr = err
			}
		}
		p.mu.Unlock()
		p.log.Warn("producer id bump failed; trying again", zap.Error(err))
		return err
	}
	why := p.bump
	oldPid, oldEpoch := p.pid, p.epoch
	p.pid, p.epoch, p.bump = pid, epoch, ""
	p.bumpedAt, p.bumpDelayed = time.Now(), false
	for _, ps := range p.parts {
		seq := int32(0)
		for _, b := range ps.queue {
			if b.seq >= 0 {
				// Not written under the old id (bumpReady): a fresh batch.
				b.seq, b.maybe, b.unsure = seq, false, false
				seq = addSeq(seq, int32(len(b.msgs)))
			}
		}
		ps.nextSeq, ps.gate = seq, true
	}
	// Every partition's sink: a partition may still be on the sink of a
	// broker's former address, which p.sinks no longer names.
	sinks := map[*sink]bool{}
	for _, ps := range p.parts {
		if ps.sink != nil {
			sinks[ps.sink] = true
		}
	}
	p.mu.Unlock()
	p.stats.bumps.Add(1)
	p.log.Warn("producer id bumped: a partition's sequence was lost; its unacknowledged batches are renumbered from 0, nothing acknowledged is sent again",
		zap.String("reason", why), zap.Int64("old_producer_id", oldPid), zap.Int16("old_epoch", oldEpoch),
		zap.Int64("producer_id", pid), zap.Int16("epoch", epoch))
	for s := range sinks {
		s.wake()
	}
	return nil
}

// initProducerID asks any broker for a producer id, retrying until ctx
// ends.
func (p *Producer) initProducerID(ctx context.Context) (int64, int16, error) {
	var last error
	for n := 1; ; n++ {
		pid, epoch, err := p.initProducerIDOnce()
		if err == nil {
			return pid, epoch, nil
		}
		if errors.Is(err, sarama.ErrClusterAuthorizationFailed) {
			return 0, 0, fmt.Errorf("kafka: InitProducerID on cluster %s: the idempotent producer needs IdempotentWrite on the cluster: %w", p.name, err)
		}
		last = err
		p.log.Debug("InitProducerID failed; retrying", zap.Int("attempt", n), zap.Error(err))
		if err := sleepCtx(ctx, p.backoff(n)); err != nil {
			return 0, 0, fmt.Errorf("kafka: InitProducerID on cluster %s: %w (last error: %v)", p.name, err, last)
		}
	}
}

// initProducerIDOnce asks the least loaded broker for a producer id.
func (p *Producer) initProducerIDOnce() (int64, int16, error) {
	req := &sarama.InitProducerIDRequest{Version: InitProducerIDVersion(p.sc.Version), ProducerID: -1, ProducerEpoch: -1}
	resp, err := p.sendInitProducerID(req)
	if err == nil && !errors.Is(resp.Err, sarama.ErrNoError) {
		err = resp.Err
	}
	if err != nil {
		return 0, 0, err
	}
	return resp.ProducerID, resp.ProducerEpoch, nil
}

func (p *Producer) sendInitProducerID(req *sarama.InitProducerIDRequest) (*sarama.InitProducerIDResponse, error) {
	b := p.client.LeastLoadedBroker()
	if b == nil {
		if err := p.client.RefreshMetadata(); err != nil {
			return nil, err
		}
		return nil, sarama.ErrBrokerNotAvailable
	}
	r := *req
	resp, err := b.InitProducerID(&r)
	CloseOnTransportError(b, err)
	return resp, err
}

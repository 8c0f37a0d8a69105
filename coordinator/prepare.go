package coordinator

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/kswitch/kswitch/state"
	"github.com/kswitch/kswitch/translate"
)

// A planned switch (both clusters reachable by a quorum: a pin, or an
// automatic failback) is made before it is broken: prepare readies the
// target while the fleet still consumes the cluster it leaves, so that
// between the revoke and the first record from the target only the
// unavoidable remains (the final commits, translating the last few
// records, two etcd publications). Everything prepare does is an
// optimization: whatever fails or times out, the switch goes on as it
// would have without it.

// prepared is what a planned switch readied before it revoked anything.
type prepared struct {
	x *translation
	// hints are the pre-translated positions, by partition on the target: where
	// the positions committed during the preparation continue on the
	// target, found by fingerprint.
	hints map[state.TopicPartition]*translate.Hint
}

// use returns the translation and hints prepared for a switch from → to,
// or nil when p prepared another switch or nothing.
func (p *prepared) use(from, to string) (*translation, map[state.TopicPartition]*translate.Hint) {
	if p == nil || p.x == nil || p.x.from != from || p.x.to != to {
		return nil, nil
	}
	return p.x, p.hints
}

func (p *prepared) close() {
	if p != nil {
		p.x.close()
	}
}

// prepareTimeout bounds the preparation of a planned switch: the failure
// window, the delay the fleet accepts anyway before it acts on an outage.
func (l *Leader) prepareTimeout() time.Duration { return l.cfg.Failover.FailureWindow }

// prepare readies a planned switch from the active cluster to `to`. It
//
//   - publishes the current assignment again as a new generation with
//     Warm = to: each agent opens its client to `to` (connections to the
//     brokers, metadata) while it goes on consuming, and acknowledges the
//     generation once warm;
//   - meanwhile opens the leader's own clients to `to` (and the
//     offset-syncs cluster) and translates the positions committed so far,
//     whose fingerprint matches become the hints of the final
//     translation;
//   - returns once both are done, or after prepareTimeout.
//
// It writes nothing but the warm generation, which changes no ownership:
// a leader that dies here leaves the fleet consuming as before, and its
// successor decides afresh. The caller closes the result.
func (l *Leader) prepare(ctx context.Context, t *term, to string, live func() []string, log *zap.Logger) *prepared {
	from := t.active.Cluster
	pctx, cancel := context.WithTimeout(ctx, l.prepareTimeout())
	defer cancel()

	warmGen := int64(0)
	switch {
	case t.current.Warm == to:
		warmGen = t.current.Generation // a predecessor's preparation
	case t.current.Generation > 0 && t.current.Cluster == from && len(t.current.Revoking) == 0:
		// Only a settled assignment: while partitions move, the agents
		// releasing them must not wait for a warm-up to acknowledge.
		next := t.current
		next.Generation++
		next.Warm = to
		if err := l.publishTerm(pctx, t, next); err != nil {
			log.Info("cannot publish the warm-up generation; the switch goes on without it", zap.Error(err))
		} else {
			warmGen = next.Generation
		}
	}

	p := &prepared{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		x, err := l.openTranslation(pctx, from, to, false, log)
		if err != nil {
			log.Info("cannot open the translation clients ahead of the switch; opening them after the revoke", zap.Error(err))
			return
		}
		p.x = x
		positions, err := l.committed(pctx, from, log)
		if err != nil {
			return
		}
		// Partial results are fine: a partition without a hint is
		// translated from scratch.
		parts, _, _ := l.translate(pctx, x, positions, nil)
		p.hints = map[state.TopicPartition]*translate.Hint{}
		for _, ps := range parts {
			if ps.Method == string(translate.MethodFingerprint) && ps.Lagged == 0 {
				p.hints[state.TopicPartition{Topic: ps.ToTopic, Partition: ps.Partition}] = &translate.Hint{SourceOffset: ps.FromOffset, TargetOffset: ps.ToOffset}
			}
		}
	}()

	for warmGen > 0 {
		acks := t.acks.upTo(t.current.Generation)
		cold := 0
		for _, id := range live() {
			if acks[id] < warmGen {
				cold++
			}
		}
		if cold == 0 {
			break
		}
		select {
		case <-pctx.Done():
			log.Info("agents not warm within the preparation bound; they connect after the revoke",
				zap.Int("cold_agents", cold), zap.Duration("bound", l.prepareTimeout()))
			warmGen = 0
		case <-t.acks.changed:
		case <-time.After(50 * time.Millisecond):
		}
	}
	<-done
	return p
}

package routing

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"

	"github.com/IBM/sarama"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/record"
)

// deadLetter sends rec to the dead-letter channel of v because of the
// evaluation error err, or returns err when v has none.
func (r *Router) deadLetter(ctx context.Context, v *Version, rec *record.Record, err error) error {
	var ee *EvalError
	rule := "?"
	if errors.As(err, &ee) {
		rule = ee.Rule
	}
	if v.deadLetter == nil {
		r.m.waits.WithLabelValues("evaluation").Inc()
		return fmt.Errorf("%w (no dead-letter channel: the partition waits for a version that routes this record)", err)
	}
	m := r.newMsg(rec, v.deadLetter, rule, rec.Key, deadHeaders(rec, rule, err))
	r.health.deadLetterCause(err)
	m.dead, m.deadReason = true, "evaluation"
	if errors.Is(err, ErrBudget) {
		m.deadReason = "budget"
	}
	if err := r.submit(ctx, rec, []*outMsg{m}); err != nil {
		return err
	}
	r.log.Debug("record sent to the dead-letter channel", zap.String("source", sourceOf(rec)), zap.String("rule", rule), zap.Error(err))
	return nil
}

// countDead counts a record sent to the dead-letter channel by its
// logical topic.
func (r *Router) countDead(rec *record.Record) {
	r.deadMu.Lock()
	if r.deadBy == nil {
		r.deadBy = map[string]int64{}
	}
	r.deadBy[rec.SourceTopic]++
	r.deadMu.Unlock()
}

// DeadLettered returns, by logical topic, the records sent to the
// dead-letter channel since the router was created
// (record.DeadLetterCounter).
func (r *Router) DeadLettered() map[string]int64 {
	r.deadMu.Lock()
	defer r.deadMu.Unlock()
	return maps.Clone(r.deadBy)
}

func sourceOf(rec *record.Record) string {
	return rec.Topic + "/" + strconv.Itoa(int(rec.Partition)) + "@" + strconv.FormatInt(rec.Offset, 10)
}

func deadHeaders(rec *record.Record, rule string, err error) []sarama.RecordHeader {
	return []sarama.RecordHeader{
		{Key: []byte(HeaderError), Value: []byte(err.Error())},
		{Key: []byte(HeaderRule), Value: []byte(rule)},
		{Key: []byte(HeaderSource), Value: []byte(sourceOf(rec))},
		{Key: []byte(HeaderSourceCluster), Value: []byte(rec.Cluster)},
	}
}

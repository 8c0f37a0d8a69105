package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/state"
)

// topicWant is where a topic is wanted, and why: by a topic pin or a
// staged move. An empty cluster is the fleet's.
type topicWant struct {
	cluster, reason string
}

// stageWants returns where the move s wants its topics: the stages up to the
// one in progress on the target (those before a rolled-back stage), and
// the rolled-back stage's back on the fleet's cluster.
func stageWants(s state.StageState) map[string]topicWant {
	out := map[string]topicWant{}
	n := len(s.Plan.Stages)
	for i, st := range s.Plan.Stages {
		for _, t := range st.Topics {
			switch {
			case s.Phase == state.StageOverridden:
			case s.Phase == state.StageRolledBack && i == s.Stage:
				out[t] = topicWant{reason: fmt.Sprintf("rolled back: stage %d of %d of the staged move to %s failed its check: %s", i+1, n, s.Plan.To, s.Reason)}
			case i < s.Stage || (i == s.Stage && s.Phase != state.StageRolledBack):
				out[t] = topicWant{cluster: s.Plan.To, reason: fmt.Sprintf("staged: stage %d of %d of the move to %s", i+1, n, s.Plan.To)}
			}
		}
	}
	return out
}

// stagePlan follows control/stages: the plan in force and the revision
// it was written at (0: none). A value that does not parse is refused
// and the plan in force stays.
type stagePlan struct {
	mu   sync.Mutex
	plan *state.StagePlan
	rev  int64
	// bad: the key holds a value that was refused while no plan was in
	// force (a new leader's first read): state/stages stays as it is.
	bad     bool
	changed chan struct{}
	valid   func(string) bool
	// source reports whether a logical topic is one the fleet consumes.
	source  func(string) bool
	log     *zap.Logger
	refused func()
}

func (p *stagePlan) Reset(kvs []*mvccpb.KeyValue, _ int64) {
	if len(kvs) == 0 {
		p.set(nil, 0)
		return
	}
	p.put(kvs[0])
}

func (p *stagePlan) Apply(evs []*clientv3.Event) {
	for _, ev := range evs {
		if ev.Type == clientv3.EventTypeDelete {
			p.set(nil, 0)
			continue
		}
		p.put(ev.Kv)
	}
}

func (p *stagePlan) put(kv *mvccpb.KeyValue) {
	plan, err := state.ParseStagePlan(kv.Value, p.valid)
	if err == nil && p.source != nil {
		for _, st := range plan.Stages {
			for _, t := range st.Topics {
				if !p.source(t) {
					err = fmt.Errorf("stages: %s is not a source topic of the fleet", t)
				}
			}
		}
	}
	if err != nil {
		p.log.Warn("refusing control/stages; the staged move in force stays", zap.Error(err),
			zap.String("value", refused.Truncate(kv.Value, 200)), zap.Int64("in_force_revision", p.get()))
		if p.refused != nil {
			p.refused()
		}
		p.mu.Lock()
		p.bad = p.plan == nil
		p.mu.Unlock()
		return
	}
	p.set(&plan, kv.ModRevision)
}

func (p *stagePlan) set(plan *state.StagePlan, rev int64) {
	p.mu.Lock()
	p.plan, p.rev, p.bad = plan, rev, false
	p.mu.Unlock()
	select {
	case p.changed <- struct{}{}:
	default:
	}
}

// get returns the revision of the plan in force (0: none).
func (p *stagePlan) get() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.rev
}

// current returns the plan in force and its revision; bad when there is
// none because the key's value was refused.
func (p *stagePlan) current() (plan *state.StagePlan, rev int64, bad bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.plan, p.rev, p.bad
}

// topicWants returns where the topic pins and the staged move want their
// topics; a topic pin takes precedence over the move.
func (r *leaderRun) topicWants() map[string]topicWant {
	out := map[string]topicWant{}
	if r.stages != nil {
		out = stageWants(*r.stages)
	}
	for t, c := range r.tp.get() {
		out[t] = topicWant{cluster: c, reason: "manual: topic pinned to " + c}
	}
	return out
}

// readStages reads state/stages at the start of a term.
func (r *leaderRun) readStages(ctx context.Context) error {
	gctx, cancel := context.WithTimeout(ctx, r.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := r.etcd.Get(gctx, r.keys.StagesState())
	if err != nil {
		return err
	}
	if len(resp.Kvs) == 0 {
		return nil
	}
	s, err := state.ParseStageState(resp.Kvs[0].Value)
	if err != nil {
		r.log.Warn("ignoring unusable state/stages: the staged move starts again from control/stages", zap.Error(err))
		return nil
	}
	r.stages = &s
	return nil
}

// writeStages writes s to state/stages (nil: deletes it), fenced by the
// term, and records step (when not nil) in history/stages/.
func (r *leaderRun) writeStages(ctx context.Context, s *state.StageState, step *state.StageStep) error {
	wctx, cancel := context.WithTimeout(ctx, r.cfg.Etcd.RequestTimeout)
	defer cancel()
	var ops []clientv3.Op
	if s == nil {
		ops = append(ops, clientv3.OpDelete(r.keys.StagesState()))
	} else {
		s.Leader, s.Token = r.t.ID, r.t.Rev
		if step != nil {
			step.Leader = r.t.ID
			val, err := json.Marshal(step)
			if err != nil {
				return err
			}
			ops = append(ops, clientv3.OpPut(r.keys.StageEvent(s.Revision, s.Steps), string(val)))
			s.Steps++
		}
		val, err := json.Marshal(s)
		if err != nil {
			return err
		}
		ops = append(ops, clientv3.OpPut(r.keys.StagesState(), string(val)))
	}
	if _, err := r.t.Txn(wctx, nil, ops...); err != nil {
		return fmt.Errorf("coordinator: write state/stages: %w", err)
	}
	r.stages = s
	if step != nil {
		r.log.Info("staged move", zap.Int("stage", step.Stage+1), zap.Strings("topics", step.Topics), zap.String("phase", step.Phase),
			zap.String("reason", step.Reason))
	}
	return nil
}

// stageStep advances the staged move by what changed: a new plan starts
// it, a deleted one ends it (its topics go back to the fleet's cluster),
// a stage whose topics are all on the target starts its check, a check
// that ran its interval passes the stage or rolls it back.
func (r *leaderRun) stageStep(ctx context.Context, now time.Time) error {
	plan, rev, bad := r.sp.current()
	s := r.stages
	switch {
	case plan == nil && (s == nil || bad):
		return nil
	case plan == nil:
		return r.writeStages(ctx, nil, nil)
	case s == nil || s.Revision != rev:
		ns := &state.StageState{Revision: rev, Plan: *plan, Phase: state.StageMoving, Since: now.UTC()}
		step := &state.StageStep{Stage: 0, Topics: plan.Stages[0].Topics, Phase: state.StageMoving, At: now.UTC(),
			Reason: fmt.Sprintf("staged move to %s of %d stages, each checked for %s", plan.To, len(plan.Stages), plan.Check)}
		if plan.To == r.t.active.Cluster && r.t.active.Phase == state.PhaseActive {
			ns.Phase, step.Phase = state.StageDone, state.StageDone
			ns.Reason = "the fleet is on " + plan.To + " already: nothing to move"
			step.Reason = ns.Reason
		}
		return r.writeStages(ctx, ns, step)
	}
	stage := s.Plan.Stages[s.Stage]
	switch s.Phase {
	case state.StageMoving:
		for _, t := range stage.Topics {
			if c, moving := r.t.active.TopicCluster(t); c != s.Plan.To || moving {
				return nil
			}
		}
		base, err := r.measureStage(ctx, s.Plan.To, stage.Topics)
		if err != nil {
			r.log.Warn("staged move: cannot measure the stage for its check; trying again", zap.Error(err))
			return nil
		}
		dead, err := r.deadLetters(ctx, stage.Topics)
		if err != nil {
			r.log.Warn("staged move: cannot read the agents' dead letters; trying again", zap.Error(err))
			return nil
		}
		ns := *s
		ns.Phase, ns.Since, ns.Baseline, ns.DeadAtStart = state.StageChecking, now.UTC(), base, dead
		ns.Reason = fmt.Sprintf("on %s: checking for %s (lag %d)", s.Plan.To, s.Plan.Check, lagOf(base))
		return r.writeStages(ctx, &ns, &state.StageStep{Stage: s.Stage, Topics: stage.Topics, Phase: state.StageChecking, At: now.UTC(),
			Reason: ns.Reason, LagBefore: lagOf(base)})
	case state.StageChecking:
		if now.Before(s.Since.Add(s.Plan.Check)) {
			return nil
		}
		healthy, why, after, dl, err := r.checkStage(ctx, s, stage.Topics)
		if err != nil {
			if now.Before(s.Since.Add(2 * s.Plan.Check)) {
				r.log.Warn("staged move: cannot check the stage; trying again", zap.Error(err))
				return nil
			}
			healthy, why = false, "could not be checked: "+err.Error()
		}
		ns := *s
		ns.Baseline, ns.DeadAtStart, ns.Since = nil, nil, now.UTC()
		step := &state.StageStep{Stage: s.Stage, Topics: stage.Topics, At: now.UTC(), LagBefore: lagOf(s.Baseline), LagAfter: after, DeadLetters: dl}
		switch {
		case !healthy:
			ns.Phase, ns.Reason = state.StageRolledBack, why
		case s.Stage == len(s.Plan.Stages)-1:
			ns.Phase, ns.Reason = state.StageDone, fmt.Sprintf("every stage healthy on %s (the last: %s)", s.Plan.To, why)
		default:
			ns.Stage, ns.Phase, ns.Reason = s.Stage+1, state.StageMoving, fmt.Sprintf("stage %d healthy: %s", s.Stage+1, why)
		}
		// The step is the state the check led to: the next stage moving
		// (with the passed check's measures), done, or rolled back.
		step.Stage, step.Topics, step.Phase, step.Reason = ns.Stage, ns.Plan.Stages[ns.Stage].Topics, ns.Phase, ns.Reason
		return r.writeStages(ctx, &ns, step)
	}
	return nil
}

// overrideStages stops a staged move in progress after the fleet switch
// ev moved every topic.
func (r *leaderRun) overrideStages(ctx context.Context, ev state.SwitchEvent) {
	s := r.stages
	if s == nil || !s.Running() {
		return
	}
	ns := *s
	ns.Phase, ns.Since, ns.Baseline, ns.DeadAtStart = state.StageOverridden, time.Now().UTC(), nil, nil
	ns.Reason = fmt.Sprintf("overridden by the fleet switch of epoch %d to %s (%s)", ev.Epoch, ev.To, ev.Reason)
	step := &state.StageStep{Stage: s.Stage, Topics: s.Plan.Stages[s.Stage].Topics, Phase: state.StageOverridden, At: ns.Since, Reason: ns.Reason}
	if err := r.writeStages(ctx, &ns, step); err != nil {
		r.log.Warn("staged move: cannot record its override", zap.Error(err))
	}
}

// kafkaClient connects to cluster, with the probe timeout.
func (r *leaderRun) kafkaClient(cluster string) (sarama.Client, error) {
	conf := r.conf()
	return kafka.NewClientWith(cluster, conf.clusters[cluster], kafka.Options{Dialer: r.dialer(cluster), Timeout: r.cfg.Failover.ProbeTimeout})
}

// lagOf is the total lag of marks.
func lagOf(marks map[string]state.PartitionMark) int64 {
	var n int64
	for _, m := range marks {
		n += max(0, m.End-max(m.Committed, 0))
	}
	return n
}

// measureStage returns, by partition of topics on cluster, the committed
// offset (etcd) and the end (Kafka).
func (r *leaderRun) measureStage(ctx context.Context, cluster string, topics []string) (map[string]state.PartitionMark, error) {
	conf := r.conf()
	client, err := r.kafkaClient(cluster)
	if err != nil {
		return nil, err
	}
	defer client.Close()
	positions, err := r.committed(ctx, cluster, r.log)
	if err != nil {
		return nil, err
	}
	out := map[string]state.PartitionMark{}
	for _, tp := range r.lists[cluster] {
		if !slices.Contains(topics, conf.naming.Logical(cluster, tp.Topic)) {
			continue
		}
		end, err := client.GetOffset(tp.Topic, tp.Partition, sarama.OffsetNewest)
		if err != nil {
			return nil, fmt.Errorf("the end of %s/%d on %s: %w", tp.Topic, tp.Partition, cluster, err)
		}
		m := state.PartitionMark{Committed: -1, End: end}
		if p, ok := positions[tp]; ok {
			m.Committed = p.Offset
		}
		out[state.ClusterPartition{Cluster: cluster, TopicPartition: tp}.String()] = m
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no partition of %s listed on %s", strings.Join(topics, ", "), cluster)
	}
	return out, nil
}

// checkStage judges a stage held on the target for its check: consuming
// (every partition owned there, and each that had records to consume
// committed past where it was), its lag not grown by more than the plan's
// slack, and no dead letters of its topics.
func (r *leaderRun) checkStage(ctx context.Context, s *state.StageState, topics []string) (healthy bool, why string, lag, dead int64, err error) {
	to := s.Plan.To
	now, err := r.measureStage(ctx, to, topics)
	if err != nil {
		return false, "", 0, 0, err
	}
	counts, err := r.deadLetters(ctx, topics)
	if err != nil {
		return false, "", 0, 0, err
	}
	for agent, n := range counts {
		dead += n - min(n, s.DeadAtStart[agent])
	}
	owned := map[string]bool{}
	for _, tps := range r.t.current.Section(to).Owned {
		for _, tp := range tps {
			owned[state.ClusterPartition{Cluster: to, TopicPartition: tp}.String()] = true
		}
	}
	healthy, why = judgeStage(s.Baseline, now, owned, int64(s.Plan.LagSlack), dead)
	return healthy, why, lagOf(now), dead, nil
}

// judgeStage is checkStage's verdict on what it measured: the partitions'
// marks at the check's start (before) and end (now), which of them have
// an owner, the lag's slack and the records dead-lettered meanwhile.
func judgeStage(before, now map[string]state.PartitionMark, owned map[string]bool, slack, dead int64) (healthy bool, why string) {
	var problems []string
	for _, p := range slices.Sorted(maps.Keys(now)) {
		b, ok := before[p]
		switch {
		case !owned[p]:
			problems = append(problems, p+" has no consumer")
		case ok && b.End > max(b.Committed, 0) && now[p].Committed <= b.Committed:
			problems = append(problems, fmt.Sprintf("%s not consuming: committed %d at the check's start and its end", p, now[p].Committed))
		}
	}
	lagBefore, lag := lagOf(before), lagOf(now)
	if lag > lagBefore+slack {
		problems = append(problems, fmt.Sprintf("lag grew from %d to %d records (slack %d)", lagBefore, lag, slack))
	}
	if dead > 0 {
		problems = append(problems, fmt.Sprintf("%d records dead-lettered", dead))
	}
	if len(problems) > 0 {
		return false, strings.Join(problems, "; ")
	}
	return true, fmt.Sprintf("consuming, lag %d → %d, no dead letters", lagBefore, lag)
}

// deadLetters returns, by agent, the records of topics its handler sent
// to a dead-letter channel, as the agents published them
// (deadletters/<id>).
func (r *leaderRun) deadLetters(ctx context.Context, topics []string) (map[string]int64, error) {
	gctx, cancel := context.WithTimeout(ctx, r.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := r.etcd.Get(gctx, r.keys.DeadLetters(), clientv3.WithPrefix())
	if err != nil {
		return nil, err
	}
	out := map[string]int64{}
	for _, kv := range resp.Kvs {
		counts, err := state.ParseDeadLetters(kv.Value)
		if err != nil {
			r.log.Warn("ignoring malformed dead-letter counts", zap.String("key", string(kv.Key)), zap.Error(err))
			continue
		}
		var n int64
		for _, t := range topics {
			n += counts[t]
		}
		out[strings.TrimPrefix(string(kv.Key), r.keys.DeadLetters())] = n
	}
	return out, nil
}

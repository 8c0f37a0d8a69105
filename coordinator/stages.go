package coordinator

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/keys"
)

// Staged moves: an operator's control/stages moves topics to a cluster
// stage by stage. The leader carries a stage out as topic switches (the
// stage's topics wanted on the target, like topic pins), holds it there
// for the check interval, and goes on only while the stage's topics are
// healthy on the target; a stage that is not is moved back, and the move
// stops. Its progress is state/stages, so a new leader continues it; each
// step is in history/stages/.

// StagePlan is the value of control/stages (YAML, strict):
//
//	to: B
//	check: 30s
//	stages:
//	  - topics: [audit, clicks]
//	  - topics: [orders, payments]
type StagePlan struct {
	// To is the cluster the topics move to.
	To string `yaml:"to" json:"to"`
	// Stages are moved in order; a topic is in one stage at most.
	Stages []Stage `yaml:"stages" json:"stages"`
	// Check is how long each stage is held on To and checked before the
	// next one moves (default 30s).
	Check time.Duration `yaml:"check" json:"check"`
	// LagSlack is how many records the stage's lag may grow by over the
	// check before the stage counts as unhealthy (default 1000).
	LagSlack int `yaml:"lag_slack" json:"lag_slack"`
}

// Stage is the topics that move together.
type Stage struct {
	Topics []string `yaml:"topics" json:"topics"`
}

// The bounds of a staged move.
const (
	maxStagesSize   = 64 << 10
	defaultCheck    = 30 * time.Second
	defaultLagSlack = 1000
)

// ParseStagePlan decodes a control/stages value and checks it: a cluster
// that valid accepts, at least one stage, every stage with topics, no
// topic twice, a check between 1s and 24h.
func ParseStagePlan(data []byte, valid func(cluster string) bool) (StagePlan, error) {
	var p StagePlan
	if len(data) > maxStagesSize {
		return p, fmt.Errorf("%d bytes, over the %d-byte limit", len(data), maxStagesSize)
	}
	if err := config.DecodeOver(data, "control/stages", &p); err != nil {
		return StagePlan{}, err
	}
	p.Check = cmp.Or(p.Check, defaultCheck)
	if p.LagSlack == 0 {
		p.LagSlack = defaultLagSlack
	}
	seen := map[string]int{}
	switch {
	case p.To == "":
		return p, fmt.Errorf("to: the cluster the stages move to is missing")
	case valid != nil && !valid(p.To):
		return p, fmt.Errorf("to: %q is not a primary or standby cluster of this configuration", p.To)
	case len(p.Stages) == 0:
		return p, fmt.Errorf("stages: none given (stages: [{topics: [audit]}, {topics: [orders]}])")
	case p.Check < time.Second || p.Check > 24*time.Hour:
		return p, fmt.Errorf("check: %v is outside 1s to 24h", p.Check)
	case p.LagSlack < 0:
		return p, fmt.Errorf("lag_slack: %d is negative", p.LagSlack)
	}
	for i, s := range p.Stages {
		if len(s.Topics) == 0 {
			return p, fmt.Errorf("stages[%d]: no topics", i)
		}
		for _, t := range s.Topics {
			if err := keys.ValidName(t); err != nil {
				return p, fmt.Errorf("stages[%d]: topic %q: %v", i, t, err)
			}
			if j, dup := seen[t]; dup {
				return p, fmt.Errorf("stages[%d]: topic %s is in stage %d already", i, t, j)
			}
			seen[t] = i + 1
		}
	}
	return p, nil
}

// FormatStagePlan is p as the YAML that control/stages holds.
func FormatStagePlan(p StagePlan) string {
	var b strings.Builder
	fmt.Fprintf(&b, "to: %s\ncheck: %s\n", p.To, p.Check)
	if p.LagSlack != 0 {
		fmt.Fprintf(&b, "lag_slack: %d\n", p.LagSlack)
	}
	b.WriteString("stages:\n")
	for _, s := range p.Stages {
		fmt.Fprintf(&b, "  - topics: [%s]\n", strings.Join(s.Topics, ", "))
	}
	return b.String()
}

// The phases of a staged move.
const (
	// StageMoving: the stage's topics are being switched to the target.
	StageMoving = "moving"
	// StageChecking: the stage is on the target, held for the check.
	StageChecking = "checking"
	// StageDone: every stage passed its check.
	StageDone = "done"
	// StageRolledBack: the stage failed its check and was moved back;
	// the earlier stages stay on the target. The move stops.
	StageRolledBack = "rolled_back"
	// StageOverridden: a fleet switch (an automatic failover, a fleet
	// pin) moved every topic; the move stops.
	StageOverridden = "overridden"
)

// stagePhases are the phases a staged move and its steps may be in.
var stagePhases = []string{StageMoving, StageChecking, StageDone, StageRolledBack, StageOverridden}

// StageState is state/stages: the leader's progress of the plan written
// to control/stages at Revision.
type StageState struct {
	Revision int64     `json:"revision"`
	Plan     StagePlan `json:"plan"`
	// Stage is the index of the stage in progress (the last one once
	// done; the failed one once rolled back).
	Stage  int       `json:"stage"`
	Phase  string    `json:"phase"`
	Since  time.Time `json:"since"`
	Reason string    `json:"reason,omitempty"`
	// Baseline is what the check in progress measured at its start:
	// by partition on the target, its committed offset and end.
	Baseline map[string]PartitionMark `json:"baseline,omitempty"`
	// DeadAtStart is the dead letters of the stage's topics each agent
	// had counted at the check's start.
	DeadAtStart map[string]int64 `json:"dead_letters_at_start,omitempty"`
	// Steps is how many steps history/stages/<revision>/ holds.
	Steps  int    `json:"steps"`
	Leader string `json:"leader,omitempty"`
	Token  int64  `json:"fencing_token,omitempty"`
}

// PartitionMark is a partition's committed offset (-1: none) and end.
type PartitionMark struct {
	Committed int64 `json:"committed"`
	End       int64 `json:"end"`
}

// StageStep is one step of a staged move in history/stages/.
type StageStep struct {
	Stage  int       `json:"stage"`
	Topics []string  `json:"topics"`
	Phase  string    `json:"phase"`
	At     time.Time `json:"at"`
	Reason string    `json:"reason"`
	// The check's measures (a check step only).
	LagBefore   int64  `json:"lag_before,omitempty"`
	LagAfter    int64  `json:"lag_after,omitempty"`
	DeadLetters int64  `json:"dead_letters,omitempty"`
	Leader      string `json:"leader"`
}

// ParseStageStep decodes a step of history/stages/.
func ParseStageStep(data []byte) (StageStep, error) {
	var s StageStep
	if len(data) > maxStagesSize*4 {
		return s, fmt.Errorf("coordinator: stage step: %d bytes, over the limit", len(data))
	}
	if err := json.Unmarshal(data, &s); err != nil {
		return s, fmt.Errorf("coordinator: stage step: %w", err)
	}
	if !slices.Contains(stagePhases, s.Phase) {
		return s, fmt.Errorf("coordinator: stage step of stage %d in phase %q", s.Stage, s.Phase)
	}
	return s, nil
}

// ParseStageState decodes state/stages.
func ParseStageState(data []byte) (StageState, error) {
	var s StageState
	if len(data) > maxStagesSize*4 {
		return s, fmt.Errorf("coordinator: state/stages: %d bytes, over the limit", len(data))
	}
	if err := json.Unmarshal(data, &s); err != nil {
		return s, fmt.Errorf("coordinator: state/stages: %w", err)
	}
	if s.Stage < 0 || s.Stage >= len(s.Plan.Stages) || !slices.Contains(stagePhases, s.Phase) {
		return s, fmt.Errorf("coordinator: state/stages: stage %d of %d in phase %q", s.Stage, len(s.Plan.Stages), s.Phase)
	}
	return s, nil
}

// Running reports whether the move is in progress (not finished).
func (s StageState) Running() bool { return s.Phase == StageMoving || s.Phase == StageChecking }

// topicWant is where a topic is wanted, and why: by a topic pin or a
// staged move. An empty cluster is the fleet's.
type topicWant struct {
	cluster, reason string
}

// wants returns where the move wants its topics: the stages up to the
// one in progress on the target (those before a rolled-back stage), and
// the rolled-back stage's back on the fleet's cluster.
func (s StageState) wants() map[string]topicWant {
	out := map[string]topicWant{}
	n := len(s.Plan.Stages)
	for i, st := range s.Plan.Stages {
		for _, t := range st.Topics {
			switch {
			case s.Phase == StageOverridden:
			case s.Phase == StageRolledBack && i == s.Stage:
				out[t] = topicWant{reason: fmt.Sprintf("rolled back: stage %d of %d of the staged move to %s failed its check: %s", i+1, n, s.Plan.To, s.Reason)}
			case i < s.Stage || (i == s.Stage && s.Phase != StageRolledBack):
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
	plan *StagePlan
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
	plan, err := ParseStagePlan(kv.Value, p.valid)
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

func (p *stagePlan) set(plan *StagePlan, rev int64) {
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
func (p *stagePlan) current() (plan *StagePlan, rev int64, bad bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.plan, p.rev, p.bad
}

// topicWants returns where the topic pins and the staged move want their
// topics; a topic pin takes precedence over the move.
func (r *leaderRun) topicWants() map[string]topicWant {
	out := map[string]topicWant{}
	if r.stages != nil {
		out = r.stages.wants()
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
	s, err := ParseStageState(resp.Kvs[0].Value)
	if err != nil {
		r.log.Warn("ignoring unusable state/stages: the staged move starts again from control/stages", zap.Error(err))
		return nil
	}
	r.stages = &s
	return nil
}

// writeStages writes s to state/stages (nil: deletes it), fenced by the
// term, and records step (when not nil) in history/stages/.
func (r *leaderRun) writeStages(ctx context.Context, s *StageState, step *StageStep) error {
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
		ns := &StageState{Revision: rev, Plan: *plan, Phase: StageMoving, Since: now.UTC()}
		step := &StageStep{Stage: 0, Topics: plan.Stages[0].Topics, Phase: StageMoving, At: now.UTC(),
			Reason: fmt.Sprintf("staged move to %s of %d stages, each checked for %s", plan.To, len(plan.Stages), plan.Check)}
		if plan.To == r.t.active.Cluster && r.t.active.Phase == PhaseActive {
			ns.Phase, step.Phase = StageDone, StageDone
			ns.Reason = "the fleet is on " + plan.To + " already: nothing to move"
			step.Reason = ns.Reason
		}
		return r.writeStages(ctx, ns, step)
	}
	stage := s.Plan.Stages[s.Stage]
	switch s.Phase {
	case StageMoving:
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
		ns.Phase, ns.Since, ns.Baseline, ns.DeadAtStart = StageChecking, now.UTC(), base, dead
		ns.Reason = fmt.Sprintf("on %s: checking for %s (lag %d)", s.Plan.To, s.Plan.Check, lagOf(base))
		return r.writeStages(ctx, &ns, &StageStep{Stage: s.Stage, Topics: stage.Topics, Phase: StageChecking, At: now.UTC(),
			Reason: ns.Reason, LagBefore: lagOf(base)})
	case StageChecking:
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
		step := &StageStep{Stage: s.Stage, Topics: stage.Topics, At: now.UTC(), LagBefore: lagOf(s.Baseline), LagAfter: after, DeadLetters: dl}
		switch {
		case !healthy:
			ns.Phase, ns.Reason = StageRolledBack, why
		case s.Stage == len(s.Plan.Stages)-1:
			ns.Phase, ns.Reason = StageDone, fmt.Sprintf("every stage healthy on %s (the last: %s)", s.Plan.To, why)
		default:
			ns.Stage, ns.Phase, ns.Reason = s.Stage+1, StageMoving, fmt.Sprintf("stage %d healthy: %s", s.Stage+1, why)
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
func (r *leaderRun) overrideStages(ctx context.Context, ev SwitchEvent) {
	s := r.stages
	if s == nil || !s.Running() {
		return
	}
	ns := *s
	ns.Phase, ns.Since, ns.Baseline, ns.DeadAtStart = StageOverridden, time.Now().UTC(), nil, nil
	ns.Reason = fmt.Sprintf("overridden by the fleet switch of epoch %d to %s (%s)", ev.Epoch, ev.To, ev.Reason)
	step := &StageStep{Stage: s.Stage, Topics: s.Plan.Stages[s.Stage].Topics, Phase: StageOverridden, At: ns.Since, Reason: ns.Reason}
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
func lagOf(marks map[string]PartitionMark) int64 {
	var n int64
	for _, m := range marks {
		n += max(0, m.End-max(m.Committed, 0))
	}
	return n
}

// measureStage returns, by partition of topics on cluster, the committed
// offset (etcd) and the end (Kafka).
func (r *leaderRun) measureStage(ctx context.Context, cluster string, topics []string) (map[string]PartitionMark, error) {
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
	out := map[string]PartitionMark{}
	for _, tp := range r.lists[cluster] {
		if !slices.Contains(topics, conf.naming.Logical(cluster, tp.Topic)) {
			continue
		}
		end, err := client.GetOffset(tp.Topic, tp.Partition, sarama.OffsetNewest)
		if err != nil {
			return nil, fmt.Errorf("the end of %s/%d on %s: %w", tp.Topic, tp.Partition, cluster, err)
		}
		m := PartitionMark{Committed: -1, End: end}
		if p, ok := positions[tp]; ok {
			m.Committed = p.Offset
		}
		out[ClusterPartition{Cluster: cluster, TopicPartition: tp}.String()] = m
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
func (r *leaderRun) checkStage(ctx context.Context, s *StageState, topics []string) (healthy bool, why string, lag, dead int64, err error) {
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
			owned[ClusterPartition{Cluster: to, TopicPartition: tp}.String()] = true
		}
	}
	healthy, why = judgeStage(s.Baseline, now, owned, int64(s.Plan.LagSlack), dead)
	return healthy, why, lagOf(now), dead, nil
}

// judgeStage is checkStage's verdict on what it measured: the partitions'
// marks at the check's start (before) and end (now), which of them have
// an owner, the lag's slack and the records dead-lettered meanwhile.
func judgeStage(before, now map[string]PartitionMark, owned map[string]bool, slack, dead int64) (healthy bool, why string) {
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
		counts, err := ParseDeadLetters(kv.Value)
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

// ParseDeadLetters decodes an agent's deadletters/<id>: logical topic →
// records dead-lettered since the agent started.
func ParseDeadLetters(data []byte) (map[string]int64, error) {
	if len(data) > 1<<20 {
		return nil, fmt.Errorf("%d bytes, over the limit", len(data))
	}
	var m map[string]int64
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, err
	}
	for t, n := range m {
		if n < 0 {
			return nil, fmt.Errorf("topic %s: %s records", t, strconv.FormatInt(n, 10))
		}
	}
	return m, nil
}

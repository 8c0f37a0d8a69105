package state

import (
	"cmp"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kswitch/kswitch/config"
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
		return s, fmt.Errorf("state: stage step: %d bytes, over the limit", len(data))
	}
	if err := json.Unmarshal(data, &s); err != nil {
		return s, fmt.Errorf("state: stage step: %w", err)
	}
	if !slices.Contains(stagePhases, s.Phase) {
		return s, fmt.Errorf("state: stage step of stage %d in phase %q", s.Stage, s.Phase)
	}
	return s, nil
}

// ParseStageState decodes state/stages.
func ParseStageState(data []byte) (StageState, error) {
	var s StageState
	if len(data) > maxStagesSize*4 {
		return s, fmt.Errorf("state: state/stages: %d bytes, over the limit", len(data))
	}
	if err := json.Unmarshal(data, &s); err != nil {
		return s, fmt.Errorf("state: state/stages: %w", err)
	}
	if s.Stage < 0 || s.Stage >= len(s.Plan.Stages) || !slices.Contains(stagePhases, s.Phase) {
		return s, fmt.Errorf("state: state/stages: stage %d of %d in phase %q", s.Stage, len(s.Plan.Stages), s.Phase)
	}
	return s, nil
}

// Running reports whether the move is in progress (not finished).
func (s StageState) Running() bool { return s.Phase == StageMoving || s.Phase == StageChecking }

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

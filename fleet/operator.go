package fleet

import (
	"context"
	"errors"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/fleetview"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/signals"
	"github.com/kswitch/kswitch/state"
)

// Operator steers and reads one fleet through etcd, as an operator does
// with the kswitch commands (which call it). Each write is one etcd
// request to a key an operator could write with etcdctl; the leader and
// the agents follow those keys. A value is checked as its reader checks
// it before it is written: a value refused is never written.
//
// An Operator has no goroutine and holds no state but its fleet's name:
// any number of them can share one etcd client, which the caller owns.
type Operator struct {
	etcd *clientv3.Client
	keys keys.Fleet
	name string
}

// NewOperator returns the operator of the fleet named name, over etcd.
func NewOperator(etcd *clientv3.Client, name string) (*Operator, error) {
	if etcd == nil {
		return nil, errors.New("fleet: NewOperator: no etcd client")
	}
	if err := keys.ValidName(name); err != nil {
		return nil, fmt.Errorf("fleet: name %q: %w", name, err)
	}
	return &Operator{etcd: etcd, keys: keys.New(name), name: name}, nil
}

// Name is the fleet's name.
func (o *Operator) Name() string { return o.name }

// Keys are the fleet's etcd keys.
func (o *Operator) Keys() keys.Fleet { return o.keys }

// Pin pins the fleet to cluster (control/pin := cluster): the leader
// switches there if a quorum of agents reaches it, and stays there
// whatever the health verdict says until Unpin.
func (o *Operator) Pin(ctx context.Context, cluster string) error {
	if err := keys.ValidName(cluster); err != nil {
		return fmt.Errorf("fleet %s: pin to %q: %w", o.name, cluster, err)
	}
	return o.put(ctx, o.keys.Pin(), cluster)
}

// Unpin removes the fleet's pin: automatic failover and failback again.
func (o *Operator) Unpin(ctx context.Context) error {
	return o.del(ctx, o.keys.Pin())
}

// PinTopic moves the logical topic alone to cluster and keeps it there
// (control/pin/topic/<topic> := cluster), while the fleet's other topics
// stay where they are; the topic comes back by itself if that cluster
// fails.
func (o *Operator) PinTopic(ctx context.Context, topic, cluster string) error {
	if err := keys.ValidName(topic); err != nil {
		return fmt.Errorf("fleet %s: pin topic %q: %w", o.name, topic, err)
	}
	if err := keys.ValidName(cluster); err != nil {
		return fmt.Errorf("fleet %s: pin topic %s to %q: %w", o.name, topic, cluster, err)
	}
	return o.put(ctx, o.keys.TopicPin(topic), cluster)
}

// UnpinTopic returns the topic to wherever the fleet consumes.
func (o *Operator) UnpinTopic(ctx context.Context, topic string) error {
	if err := keys.ValidName(topic); err != nil {
		return fmt.Errorf("fleet %s: unpin topic %q: %w", o.name, topic, err)
	}
	return o.del(ctx, o.keys.TopicPin(topic))
}

// MoveInStages starts a staged move (control/stages := plan): the leader
// moves the first stage's topics to plan.To, holds them there for
// plan.Check, and moves the next stage only if they are healthy there.
// The plan is checked as the leader checks it (state.ParseStagePlan)
// and refused with the reason.
func (o *Operator) MoveInStages(ctx context.Context, plan state.StagePlan) error {
	val := state.FormatStagePlan(plan)
	if _, err := state.ParseStagePlan([]byte(val), nil); err != nil {
		return fmt.Errorf("fleet %s: staged move refused: %w", o.name, err)
	}
	return o.put(ctx, o.keys.Stages(), val)
}

// EndStagedMove ends the staged move in progress: its topics go back to
// the fleet's cluster.
func (o *Operator) EndStagedMove(ctx context.Context) error {
	return o.del(ctx, o.keys.Stages())
}

// Active reads state/active: the cluster the fleet consumes, the switch in
// progress if any, and the topics placed elsewhere. ok is false before a
// leader has written it.
func (o *Operator) Active(ctx context.Context) (a state.Active, ok bool, err error) {
	resp, err := o.etcd.Get(ctx, o.keys.Active())
	if err != nil {
		return state.Active{}, false, fmt.Errorf("fleet %s: read %s: %w", o.name, o.keys.Active(), err)
	}
	if len(resp.Kvs) == 0 {
		return state.Active{}, false, nil
	}
	if a, err = state.ParseActive(resp.Kvs[0].Value); err != nil {
		return state.Active{}, false, fmt.Errorf("fleet %s: %s: %w", o.name, o.keys.Active(), err)
	}
	return a, true, nil
}

// Pause pauses scope (signals/<scope> := "pause # note"): the agents stop
// handing on its records and keep their assignment until Resume.
func (o *Operator) Pause(ctx context.Context, scope signals.Scope, note string) error {
	return o.signal(ctx, scope, true, note)
}

// Resume starts scope again (signals/<scope> := "start # note"). A
// partition stays paused while another scope covering it is paused.
func (o *Operator) Resume(ctx context.Context, scope signals.Scope, note string) error {
	return o.signal(ctx, scope, false, note)
}

func (o *Operator) signal(ctx context.Context, scope signals.Scope, pause bool, note string) error {
	if err := signals.Write(ctx, o.etcd, o.keys, scope, pause, note); err != nil {
		return fmt.Errorf("fleet %s: %w", o.name, err)
	}
	return nil
}

// Signals reads the pause/start signals in force, and the values the
// agents refuse.
func (o *Operator) Signals(ctx context.Context) (signals.State, error) {
	s, err := signals.Read(ctx, o.etcd, o.keys)
	if err != nil {
		return signals.State{}, fmt.Errorf("fleet %s: %w", o.name, err)
	}
	return s, nil
}

// Switches returns the last n cluster switches of history/, newest
// first, and the values it could not read (each naming its key).
func (o *Operator) Switches(ctx context.Context, n int64) ([]state.SwitchEvent, []error, error) {
	resp, err := o.etcd.Get(ctx, o.keys.SwitchHistory(), clientv3.WithPrefix(),
		clientv3.WithSort(clientv3.SortByKey, clientv3.SortDescend), clientv3.WithLimit(n))
	if err != nil {
		return nil, nil, fmt.Errorf("fleet %s: read %s: %w", o.name, o.keys.SwitchHistory(), err)
	}
	var evs []state.SwitchEvent
	var bad []error
	for _, kv := range resp.Kvs {
		ev, err := state.ParseSwitchEvent(kv.Value)
		if err != nil {
			bad = append(bad, fmt.Errorf("%s: %w", kv.Key, err))
			continue
		}
		evs = append(evs, ev)
	}
	return evs, bad, nil
}

// Status reads the fleet as 'kswitch status' shows it: the leader, the
// registered agents, the active cluster, the assignment with every
// partition's committed position, the signals, the configuration in
// force, a staged move's progress. Nothing is asked of the agents or of
// Kafka: FleetView.AskReady and FleetView.FillLag do that.
func (o *Operator) Status(ctx context.Context) (fleetview.FleetView, error) {
	v, err := fleetview.ReadFleet(ctx, o.etcd, o.keys)
	if err != nil {
		return fleetview.FleetView{}, fmt.Errorf("fleet %s: %w", o.name, err)
	}
	return v, nil
}

func (o *Operator) put(ctx context.Context, key, val string) error {
	if _, err := o.etcd.Put(ctx, key, val); err != nil {
		return fmt.Errorf("fleet %s: put %s: %w", o.name, key, err)
	}
	return nil
}

func (o *Operator) del(ctx context.Context, key string) error {
	if _, err := o.etcd.Delete(ctx, key); err != nil {
		return fmt.Errorf("fleet %s: delete %s: %w", o.name, key, err)
	}
	return nil
}

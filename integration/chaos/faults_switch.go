//go:build chaos

package chaos

import (
	"context"
	"fmt"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// SwitchLeaderKill targets the leader mid-switch: the cluster the fleet
// consumes is stopped, and the leader is SIGKILLed the moment it starts
// the failover away from it (state/active turns "switching"). The next
// leader must finish the switch from what etcd holds. Heal: the agent and
// the cluster started again (then failback, when the stopped cluster was
// the primary).
const SwitchLeaderKill Kind = "switch-leader-kill"

// switchKinds are the faults aimed at a switch in progress.
var switchKinds = []kindSpec{
	{SwitchLeaderKill, []string{"leader"}, 5 * time.Second, 20 * time.Second, (*run).applySwitchLeaderKill},
}

// alsoBusy names, per kind, the targets a fault of that kind occupies
// besides its drawn one: the timeline draws no other fault on them
// meanwhile. switch-leader-kill stops whichever of A and B is active when
// it fires.
var alsoBusy = map[Kind][]string{
	SwitchLeaderKill: {"A", "B"},
}

// switchWait bounds the wait for the failover to start once the active
// cluster is stopped: the failure window (1.5 s) and probes, several
// times over.
const switchWait = 20 * time.Second

// midSwitch is what each run's switch-leader-kill did, for its heal (one
// at a time: the kind's target is the leader).
var midSwitch = struct {
	sync.Mutex
	m map[*run]switchKill
}{m: map[*run]switchKill{}}

type switchKill struct {
	cluster string // stopped
	agent   string // killed; empty when no switch started in time
}

func (r *run) applySwitchLeaderKill(_ string, heal bool) error {
	midSwitch.Lock()
	done := midSwitch.m[r]
	midSwitch.Unlock()
	if heal {
		midSwitch.Lock()
		delete(midSwitch.m, r)
		midSwitch.Unlock()
		var err error
		if done.agent != "" {
			err = r.agent(done.agent).start()
		}
		if done.cluster != "" {
			if ferr := r.stack.fault(done.cluster, "restart"); err == nil {
				err = ferr
			}
		}
		return err
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: r.stack.info.Etcd, DialTimeout: 2 * time.Second})
	if err != nil {
		return fmt.Errorf("switch-leader-kill: etcd client: %w", err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), switchWait)
	defer cancel()
	key := keys.New(fleetName).Active()
	resp, err := cli.Get(ctx, key)
	if err != nil || len(resp.Kvs) == 0 {
		r.say("  switch-leader-kill: state/active unreadable (%v): skipped", err)
		return nil
	}
	before, err := state.ParseActive(resp.Kvs[0].Value)
	if err != nil || before.Phase != state.PhaseActive {
		r.say("  switch-leader-kill: the fleet is not settled on a cluster (%+v, %v): skipped", before, err)
		return nil
	}
	// The watch starts before the stop, so that no switch is missed.
	wch := cli.Watch(ctx, key, clientv3.WithRev(resp.Header.Revision+1))
	if err := r.stack.fault(before.Cluster, "stop"); err != nil {
		return err
	}
	midSwitch.Lock()
	midSwitch.m[r] = switchKill{cluster: before.Cluster}
	midSwitch.Unlock()
	for w := range wch {
		for _, ev := range w.Events {
			a, err := state.ParseActive(ev.Kv.Value)
			if err != nil || a.Epoch == before.Epoch {
				continue
			}
			id, err := r.leader()
			if err != nil {
				r.say("  switch-leader-kill: the switch to %s began, but %v", a.Cluster, err)
				return nil
			}
			r.agent(id).kill()
			r.say("  switch-leader-kill: %s stopped; %s killed as state/active turned %s (epoch %d, to %s)", before.Cluster, id, a.Phase, a.Epoch, a.Cluster)
			midSwitch.Lock()
			midSwitch.m[r] = switchKill{cluster: before.Cluster, agent: id}
			midSwitch.Unlock()
			return nil
		}
	}
	r.say("  switch-leader-kill: %s stopped, no switch began within %v: no leader killed", before.Cluster, switchWait)
	return nil
}

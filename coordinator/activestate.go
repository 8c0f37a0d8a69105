package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/state"
)

// writeActive publishes a, fenced by the term and the revision it replaces.
func (l *Leader) writeActive(ctx context.Context, t *term, a state.Active) error {
	a.Leader, a.Token = t.ID, t.Rev
	val, err := json.Marshal(a)
	if err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := t.Txn(wctx, []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(l.keys.Active()), "=", t.activeRev)},
		clientv3.OpPut(l.keys.Active(), string(val)))
	if err != nil {
		return fmt.Errorf("coordinator: write state/active: %w", err)
	}
	t.active, t.activeRev = a, resp.Header.Revision
	return nil
}

// readActive reads state/active. When it is absent, malformed, names a
// cluster this configuration lacks, or is not a value a leader wrote
// (believable), the active cluster and epoch are recovered from what else
// the fleet recorded (recoverActive), and recovered says to write the
// result back at once.
func (l *Leader) readActive(ctx context.Context) (a state.Active, rev int64, recovered bool, err error) {
	rctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
	defer cancel()
	// One snapshot of both keys: a switch writes them together.
	resp, err := l.etcd.Txn(rctx).Then(clientv3.OpGet(l.keys.Active()), clientv3.OpGet(l.keys.Assignment())).Commit()
	if err != nil {
		return state.Active{}, 0, false, err
	}
	act, asg := resp.Responses[0].GetResponseRange().Kvs, resp.Responses[1].GetResponseRange().Kvs
	why := "absent"
	if len(act) > 0 {
		rev = act[0].ModRevision
		a, err := state.ParseActive(act[0].Value)
		_, known := l.conf().clusters[a.Cluster]
		switch {
		case err != nil:
			why = err.Error()
		case !known:
			why = "names cluster " + a.Cluster + ", which this configuration lacks"
		default:
			if why, err = l.believable(rctx, a, rev, asg); err != nil {
				return state.Active{}, 0, false, err
			}
			if why == "" {
				return a, rev, false, nil
			}
			l.metrics.refusedValue(refused.Active)
		}
	}
	a, err = l.recoverActive(rctx)
	if err != nil {
		return state.Active{}, 0, false, err
	}
	if rev != 0 || a.Epoch > 1 {
		l.log.Warn("state/active is unusable; recovered the active cluster and epoch from state/assignment and history/",
			zap.String("found", why), zap.String("active", a.Cluster), zap.Int64("epoch", a.Epoch))
	}
	return a, rev, true, nil
}

// believable returns "" when a, found in state/active at revision rev at
// the start of a term, can be a value a leader wrote, else why not. The
// fleet's cluster changes only by a switch, and every switch leaves a
// trace: history/ names where the last one left the fleet (its target, or
// its origin when abandoned; the primary before any), and a switch that
// completed but whose history entry is not written yet wrote state/active
// in the same transaction as the assignment on its target (activate), so
// at the same revision. A value that moves the fleet elsewhere with
// neither was written by someone else: taken as it is, the new leader
// would consume a cluster with no switch, no translation and no history
// entry (from offset 0 of a cluster never consumed). asg is
// state/assignment in the same snapshot as a.
func (l *Leader) believable(ctx context.Context, a state.Active, rev int64, asg []*mvccpb.KeyValue) (string, error) {
	on, err := l.lastFleetCluster(ctx)
	if err != nil {
		return "", err
	}
	switch a.Phase {
	case state.PhaseSwitching:
		if a.From != on {
			return fmt.Sprintf("is a switch from %s to %s (epoch %d), but history/ leaves the fleet on %s: a switch starts where the fleet is",
				a.From, a.Cluster, a.Epoch, on), nil
		}
	default:
		if a.Cluster == on {
			return "", nil
		}
		if len(asg) > 0 && asg[0].ModRevision == rev {
			if g, err := state.ParseAssignment(asg[0].Value); err == nil && g.Cluster == a.Cluster {
				return "", nil // a switch activated, its history not yet written
			}
		}
		return fmt.Sprintf("names cluster %s (epoch %d), but history/ leaves the fleet on %s and no switch to %s wrote state/assignment with it",
			a.Cluster, a.Epoch, on, a.Cluster), nil
	}
	return "", nil
}

// historyPage is how many history/ entries lastFleetCluster reads at a
// time: topic switches between fleet switches are skipped.
const historyPage = 32

// lastFleetCluster returns the cluster history/ leaves the fleet on: the
// target of its last fleet switch (not a topic switch), the origin if that
// switch was abandoned, the primary if there is none. Malformed entries
// are skipped.
func (l *Leader) lastFleetCluster(ctx context.Context) (string, error) {
	end := clientv3.GetPrefixRangeEnd(l.keys.SwitchHistory())
	for {
		resp, err := l.etcd.Get(ctx, l.keys.SwitchHistory(), clientv3.WithRange(end),
			clientv3.WithSort(clientv3.SortByKey, clientv3.SortDescend), clientv3.WithLimit(historyPage))
		if err != nil {
			return "", err
		}
		for _, kv := range resp.Kvs {
			ev, err := state.ParseSwitchEvent(kv.Value)
			if err != nil || len(ev.Topics) > 0 {
				continue
			}
			if ev.Abandoned != "" {
				return ev.From, nil
			}
			return ev.To, nil
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return l.conf().primary, nil
		}
		end = string(resp.Kvs[len(resp.Kvs)-1].Key)
	}
}

// recoverActive returns the fleet's active cluster and epoch as the rest
// of its state records them, for the leader to write: the cluster of
// state/assignment (where agents consume now), else the target of the
// last switch in history/, else the primary; the epoch of the last switch
// in history/ (1 if none), so that the next switch takes the epoch after
// every recorded one and never overwrites an entry.
func (l *Leader) recoverActive(ctx context.Context) (state.Active, error) {
	conf := l.conf()
	a := state.Active{Cluster: conf.primary, Epoch: 1, Phase: state.PhaseActive, Reason: "initial", Since: time.Now().UTC()}
	resp, err := l.etcd.Get(ctx, l.keys.SwitchHistory(), clientv3.WithLastKey()...)
	if err != nil {
		return a, err
	}
	if len(resp.Kvs) > 0 {
		if ev, err := state.ParseSwitchEvent(resp.Kvs[0].Value); err == nil && ev.Epoch > 0 {
			a.Epoch = ev.Epoch
			switch {
			case len(ev.Topics) > 0:
				// A topic switch: the fleet's cluster is not in it.
			case ev.Abandoned != "":
				a.Cluster, a.Reason = ev.From, "recovered from history/"
			default:
				a.Cluster, a.Reason = ev.To, "recovered from history/"
			}
		}
	}
	if resp, err = l.etcd.Get(ctx, l.keys.Assignment()); err != nil {
		return a, err
	}
	if len(resp.Kvs) > 0 {
		if asg, err := state.ParseAssignment(resp.Kvs[0].Value); err == nil && asg.Cluster != "" {
			a.Cluster, a.Reason = asg.Cluster, "recovered from state/assignment"
			a.Topics = recoverPlaced(asg, a, conf)
		}
	}
	if _, ok := conf.clusters[a.Cluster]; !ok {
		a.Cluster, a.Topics = conf.primary, nil
	}
	return a, nil
}

// recoverPlaced returns the topics asg consumes on a cluster other than
// its own (its placed sections), placed there in a: their positions are
// there, and treating them as on a.Cluster would consume them again from
// older positions.
func recoverPlaced(asg state.Assignment, a state.Active, conf *dynamic) map[string]state.TopicActive {
	var out map[string]state.TopicActive
	for _, c := range asg.Sections()[1:] {
		if _, ok := conf.clusters[c]; !ok || c == a.Cluster {
			continue
		}
		sec := asg.Section(c)
		for _, m := range []map[string][]state.TopicPartition{sec.Owned, sec.Revoking} {
			for _, tps := range m {
				for _, tp := range tps {
					if out == nil {
						out = map[string]state.TopicActive{}
					}
					out[conf.naming.Logical(c, tp.Topic)] = state.TopicActive{Cluster: c, Phase: state.PhaseActive, Epoch: a.Epoch,
						Reason: "recovered from state/assignment", Since: a.Since}
				}
			}
		}
	}
	return out
}

package agent

import (
	"context"
	"fmt"
	"maps"
	"net"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/etcdclient"
	"github.com/kswitch/kswitch/internal/version"
	"github.com/kswitch/kswitch/signals"
	"github.com/kswitch/kswitch/state"
)

// Signals returns the signals in force as this agent has read them from
// etcd: what the routing sink pauses channels by. Call it from the
// handler or after Start returned; before Start no signal is in force.
func (a *Agent) Signals() signals.State {
	if a.signals == nil {
		return signals.State{}
	}
	return a.signals.State()
}

// HTTPAddr returns the address the HTTP listener is bound to (useful when
// agent.http has port 0). Valid after Start.
func (a *Agent) HTTPAddr() string { return a.httpLn.Addr().String() }

// httpAdvertised is the HTTP address other agents use to reach this one,
// written in its registration: the bound address, or, when it is bound to
// every interface (0.0.0.0:8080, the usual setting in a container), the
// same port on the host gossip advertises (agent.gossip_advertise, else
// the private address memberlist picked). A wildcard address in the
// registration would make the leader, asking an agent who it is, ask
// itself.
func (a *Agent) httpAdvertised() string {
	bound := a.HTTPAddr()
	host, port, err := net.SplitHostPort(bound)
	if err != nil {
		return bound
	}
	if ip := net.ParseIP(host); host != "" && (ip == nil || !ip.IsUnspecified()) {
		return bound
	}
	ghost, _, err := net.SplitHostPort(a.GossipAddr())
	if err != nil || ghost == "" {
		return bound
	}
	return net.JoinHostPort(ghost, port)
}

// GossipAddr returns the host:port other agents use to reach this agent's
// gossip. Valid after Start.
func (a *Agent) GossipAddr() string { return a.gossipAddr }

// Ready reports whether the agent is connected to etcd and registered, and
// why not otherwise.
func (a *Agent) Ready() (bool, string) {
	s := a.session.Load()
	if e := *a.etcdErr.Load(); e != "" {
		return false, e
	}
	if !s.registered {
		return false, s.reason
	}
	if e := a.gossipKeyErr.Load(); e != nil && *e != "" {
		return false, *e
	}
	if r := a.stuck.Load(); r != nil && *r != "" {
		return false, *r
	}
	if p := a.deliveryProblem(); p != "" {
		return false, p
	}
	if h := a.hold.Load(); h != nil {
		if since := h.failingSince(); !since.IsZero() {
			return false, fmt.Sprintf("commits to etcd have not succeeded for %s: delivery held, so that a crash now delivers no more records again",
				time.Since(since).Round(time.Millisecond))
		}
	}
	if p := a.active.Load(); p != nil && a.prober != nil {
		view := a.prober.view()
		if v, ok := view[*p]; ok && !v.Reachable {
			return false, fmt.Sprintf("cannot reach the active cluster %s: %s", *p, v.Error)
		}
		for _, c := range slices.Sorted(maps.Keys(a.OwnedByCluster())) {
			if v, ok := view[c]; ok && !v.Reachable && c != *p {
				return false, fmt.Sprintf("cannot reach cluster %s, where topics this agent consumes are placed: %s", c, v.Error)
			}
		}
	}
	return true, ""
}

// deliveryProblem is why the handler's records do not reach where they
// go, or "".
func (a *Agent) deliveryProblem() string {
	f := a.opts.DeliveryProblem
	if f == nil {
		dr, ok := a.opts.Handler.(interface{ DeliveryProblem(time.Duration) string })
		if !ok {
			return ""
		}
		f = dr.DeliveryProblem
	}
	if p := f(a.opts.StuckAfter); p != "" {
		return "records do not reach their channels: " + p
	}
	return ""
}

// Leading reports whether this agent leads the fleet now.
func (a *Agent) Leading() bool { return a.cand != nil && a.cand.Leading() }

// LeaderView returns who leads, as this agent sees it.
func (a *Agent) LeaderView() LeaderView {
	l, ok := a.observer.Leader()
	return leaderView(a.id, a.Leading(), l, ok)
}

// leaderView is LeaderView of agent id, whose leader work runs (leading)
// or not, when etcd's election names l (ok) or nobody. An agent leads when
// its leader work runs and etcd does not name another: a leader whose term
// etcd has ended (its lease expired while it was stopped or cut off) can
// see its successor's election key before its own work notices the end,
// and must not claim the successor's term meanwhile (its writes are
// fenced already).
func leaderView(id string, leading bool, l election.Leader, ok bool) LeaderView {
	v := LeaderView{Agent: id, Self: leading && (!ok || l.ID == id)}
	if ok {
		v.Leader, v.FencingToken = l.ID, l.Token
	}
	return v
}

// Status returns the agent's view of the fleet.
func (a *Agent) Status() Status {
	ok, reason := a.Ready()
	s := a.session.Load()
	st := Status{
		Agent: a.id, Fleet: a.cfg.Fleet, Version: version.Version, Started: a.started,
		Ready: ok, ReadyReason: reason,
		Leader: a.LeaderView(),
		Agents: a.registry.list(),
		Gossip: a.gossip.members(),
		Etcd: EtcdStatus{
			Endpoints: a.cfg.Etcd.Endpoints, Reachable: *a.etcdErr.Load() == "",
			LastError: *a.etcdErr.Load(), LeaseID: int64(s.lease),
		},
		Clusters:       a.gossip.views(),
		Signals:        a.signals.State(),
		SignalsApplied: a.SignalsApplied(),
		Active:         deref(a.active.Load()),
		Config:         a.dyn.status(),
		ConfigDigest:   a.digest,
	}
	st.ConfigDisagree = state.CompareConfigs(st.Agents, st.Leader.Leader)
	for c, tps := range a.OwnedByCluster() {
		if c == st.Active {
			st.Owned = tps
			continue
		}
		if st.OwnedOn == nil {
			st.OwnedOn = map[string][]state.TopicPartition{}
		}
		st.OwnedOn[c] = tps
	}
	if a.Leading() {
		st.Coordinator = a.leader.Status()
	}
	if a.opts.HandlerStatus != nil {
		st.Handler = a.opts.HandlerStatus()
	}
	return st
}

func deref(p *string) string {
	if p == nil {
		return ""
	}
	return *p
}

// GossipMembers returns the live and suspect gossip members.
func (a *Agent) GossipMembers() []GossipMember { return a.gossip.members() }

// Registered returns the agents registered in etcd, as this agent sees them.
func (a *Agent) Registered() []state.Registration { return a.registry.list() }

// SignalsApplied returns the etcd revision of the pause/start signals that
// every partition this agent runs obeys: once it is at least the revision
// of a pause's write, no record of the paused scope is handed to the
// handler any more.
func (a *Agent) SignalsApplied() int64 { return a.signalsApplied.Load() }

// Owned returns the partitions this agent consumes now, on every cluster,
// sorted (OwnedByCluster tells them apart).
func (a *Agent) Owned() []state.TopicPartition {
	var out []state.TopicPartition
	for _, tps := range a.OwnedByCluster() {
		out = append(out, tps...)
	}
	slices.SortFunc(out, state.TopicPartition.Compare)
	return out
}

// OwnedByCluster returns the partitions this agent consumes now, by
// cluster, each list sorted.
func (a *Agent) OwnedByCluster() map[string][]state.TopicPartition {
	if p := a.owned.Load(); p != nil {
		return maps.Clone(*p)
	}
	return nil
}

// Metrics returns the agent's metrics registry.
func (a *Agent) Metrics() *prometheus.Registry { return a.reg }

func (a *Agent) updateReady() {
	ok, _ := a.Ready()
	if ok {
		a.metrics.ready.Set(1)
	} else {
		a.metrics.ready.Set(0)
	}
}

// probeEtcdLoop checks that etcd answers, every third of the session TTL
// (at most every second), so readiness reflects an outage long before the
// lease would expire.
func (a *Agent) probeEtcdLoop(ctx context.Context) {
	interval := min(a.cfg.Etcd.SessionTTL/3, time.Second)
	t := time.NewTicker(interval)
	defer t.Stop()
	fails := 0
	for {
		pctx, cancel := context.WithTimeout(ctx, a.cfg.Etcd.RequestTimeout)
		resp, err := a.client.Get(pctx, a.keys.Agent(a.id), clientv3.WithCountOnly())
		cancel()
		if a.opts.hooks.EtcdProbed != nil {
			a.opts.hooks.EtcdProbed(err == nil && resp.Count > 0)
		}
		if ctx.Err() != nil {
			return
		}
		if err == nil && resp.Count == 0 {
			// A read served before the registration was written (the
			// probe raced the registration) says nothing about it.
			if s, st := a.current.Load(), a.session.Load(); s != nil && st.registered && resp.Header.Revision >= st.revision {
				// The leader evicted us (gossip thought us dead) or an
				// operator deleted the key: our commits are refused from
				// now on, so end this session and register again.
				a.log.Warn("this agent's registration was deleted; ending the session and registering again")
				s.Orphan()
			}
		}
		msg := ""
		if err != nil {
			a.metrics.etcdErrors.WithLabelValues("probe").Inc()
			fails++
			// One failed request is not an outage: with several
			// endpoints, the client may just be moving off a member that
			// died while the others hold quorum. Refused credentials or
			// access are reported as such, at once.
			switch {
			case etcdclient.AccessDenied(err):
				msg = etcdclient.Explain(err, a.cfg.Etcd, "read "+a.keys.Agent(a.id)).Error()
			case fails >= 2:
				msg = fmt.Sprintf("etcd unreachable at %v: %v", a.cfg.Etcd.Endpoints, err)
			}
		} else {
			fails = 0
		}
		if prev := *a.etcdErr.Swap(&msg); prev != msg {
			if msg != "" {
				a.log.Warn("etcd check failed", zap.String("error", msg))
			} else {
				a.log.Info("etcd reachable")
			}
		}
		a.updateReady()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// leaderChangeLoop logs leader changes and keeps the gauges of the fleet
// view fresh.
func (a *Agent) leaderChangeLoop(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-a.observer.Changes():
			l, ok := a.observer.Leader()
			if ok && l != a.lastLeader {
				a.metrics.leaderChanges.Inc()
				a.log.Info("leader changed", zap.String("leader", l.ID), zap.Int64("fencing_token", l.Token))
				a.lastLeader = l
			} else if !ok {
				a.log.Info("no leader")
			}
		case <-t.C:
		}
		a.metrics.agents.Set(float64(len(a.registry.list())))
		a.metrics.gossipMembers.Set(float64(a.ml.NumMembers()))
	}
}

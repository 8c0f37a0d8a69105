package agent

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"
)

// GossipMember is one member of the gossip cluster as this agent sees it.
type GossipMember struct {
	Name  string `json:"name"`
	Addr  string `json:"addr"`
	State string `json:"state"`
}

// deathWatch is the memberlist event delegate: it passes the names of
// members that left gossip to the leader through a bounded queue.
// memberlist calls it with its node lock held (so it must not call back
// into memberlist) and must not be blocked, so what does not fit is
// dropped and counted; the lease TTL still frees such an agent's
// partitions.
//
// It cannot tell a death from a clean leave: memberlist does not update
// Node.State before the call. It need not: an agent that stops cleanly
// leaves gossip only after it has committed and released its lease, so
// the leader finds nothing to evict.
type deathWatch struct {
	dead    chan string
	dropped func()
}

func (d *deathWatch) NotifyJoin(*memberlist.Node)   {}
func (d *deathWatch) NotifyUpdate(*memberlist.Node) {}
func (d *deathWatch) NotifyLeave(n *memberlist.Node) {
	select {
	case d.dead <- n.Name:
	default:
		d.dropped()
	}
}

// newMemberlist creates this agent's gossip node. bind and advertise are
// host:port; port 0 binds a free port (the same for TCP and UDP).
func newMemberlist(id, bind, advertise string, mlog *memberlistLog, events memberlist.EventDelegate) (*memberlist.Memberlist, error) {
	c := memberlist.DefaultLANConfig()
	c.Name = id
	c.Events = events
	host, port, err := splitHostPort(bind)
	if err != nil {
		return nil, fmt.Errorf("agent: gossip address %q: %w", bind, err)
	}
	c.BindAddr, c.BindPort = host, port
	c.AdvertisePort = port
	if advertise != "" {
		if c.AdvertiseAddr, c.AdvertisePort, err = splitHostPort(advertise); err != nil {
			return nil, fmt.Errorf("agent: gossip advertise address %q: %w", advertise, err)
		}
	}
	// Joins and push/pull go to agents on the same LAN; a dead seed must not
	// hold the join loop for the LAN default of 10 s.
	c.TCPTimeout = 3 * time.Second
	c.Logger = log.New(mlog, "", 0)
	ml, err := memberlist.Create(c)
	if err != nil {
		return nil, fmt.Errorf("agent: start gossip on %s: %w", bind, err)
	}
	return ml, nil
}

func splitHostPort(hp string) (string, int, error) {
	host, p, err := net.SplitHostPort(hp)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.Atoi(p)
	if err != nil || port < 0 || port > 65535 {
		return "", 0, fmt.Errorf("port %q is not a number in 0-65535", p)
	}
	return host, port, nil
}

// gossipAlive reports whether gossip considers member id alive (or only
// suspect) now.
func gossipAlive(ml *memberlist.Memberlist, id string) bool {
	for _, n := range ml.Members() {
		if n.Name == id {
			return n.State == memberlist.StateAlive || n.State == memberlist.StateSuspect
		}
	}
	return false
}

// gossipMembers returns the live and suspect members, sorted by name.
func gossipMembers(ml *memberlist.Memberlist) []GossipMember {
	var out []GossipMember
	for _, n := range ml.Members() {
		state := "alive"
		switch n.State {
		case memberlist.StateSuspect:
			state = "suspect"
		case memberlist.StateDead:
			state = "dead"
		case memberlist.StateLeft:
			state = "left"
		}
		out = append(out, GossipMember{Name: n.Name, Addr: n.Address(), State: state})
	}
	slices.SortFunc(out, func(a, b GossipMember) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// gossipJoinLoop joins the agents registered in etcd that are not yet
// gossip members: etcd is the seed list, so no static seeds are needed. It
// runs on every registry change and every interval (to heal a partition
// that memberlist alone would not), until ctx ends.
func (a *Agent) gossipJoinLoop(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	changes := a.registry.Subscribe(ctx)
	for {
		select {
		case <-ctx.Done():
			return
		case <-changes:
		case <-t.C:
		}
		known := map[string]bool{}
		for _, n := range a.ml.Members() {
			known[n.Name] = true
		}
		var seeds []string
		for _, r := range a.registry.list() {
			if r.ID != a.id && !known[r.ID] && r.Gossip != "" {
				seeds = append(seeds, r.Gossip)
			}
		}
		if len(seeds) == 0 {
			continue
		}
		n, err := a.ml.Join(seeds)
		if err != nil {
			a.log.Debug("gossip join incomplete", zap.Strings("seeds", seeds), zap.Int("joined", n), zap.Error(err))
		} else {
			a.log.Info("joined gossip", zap.Strings("seeds", seeds))
		}
	}
}

// memberlistLog turns memberlist's "[LEVEL] memberlist: msg" lines into zap
// entries at the matching level. memberlist's Shutdown returns while probes
// it started may still run (and log) for up to a probe interval; after
// close, their lines are dropped so nothing logs past the agent's end.
type memberlistLog struct {
	log    *zap.Logger
	closed atomic.Bool
}

func (m *memberlistLog) close() { m.closed.Store(true) }

func (m *memberlistLog) Write(p []byte) (int, error) {
	if m.closed.Load() {
		return len(p), nil
	}
	line := string(bytes.TrimSpace(p))
	lvl, msg := "", line
	if strings.HasPrefix(line, "[") {
		if i := strings.IndexByte(line, ']'); i > 0 {
			lvl, msg = line[1:i], strings.TrimSpace(line[i+1:])
		}
	}
	switch lvl {
	case "ERR", "ERROR":
		m.log.Error(msg)
	case "WARN":
		m.log.Warn(msg)
	case "INFO":
		m.log.Info(msg)
	default:
		m.log.Debug(msg)
	}
	return len(p), nil
}

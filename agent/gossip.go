package agent

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/coordinator"
	"github.com/kswitch/kswitch/internal/notify"
	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/state"
)

// GossipMember is one member of the gossip cluster as this agent sees it.
type GossipMember struct {
	Name string `json:"name"`
	Addr string `json:"addr"`
}

// gossipState is the memberlist event delegate: it passes the names of
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
//
// It also keeps a copy of every member's metadata (its view of the
// clusters): memberlist's Members() hands out pointers to nodes whose
// metadata it later rewrites without a lock that readers could take, so
// metadata is only read here, in the callbacks, and copied.
type gossipState struct {
	dead    chan string
	dropped func()

	mu    sync.Mutex
	metas map[string][]byte
	addrs map[string]string
	// viewsChanged are told when a member's views change: the leader wakes on a
	// view that changed (a cluster seen down or back) instead of at its
	// next tick.
	viewsChanged notify.Subscribers
}

func (d *gossipState) keepMeta(n *memberlist.Node) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.metas == nil {
		d.metas, d.addrs = map[string][]byte{}, map[string]string{}
	}
	changed := !bytes.Equal(d.metas[n.Name], n.Meta)
	d.metas[n.Name] = bytes.Clone(n.Meta)
	d.addrs[n.Name] = n.Address()
	if changed {
		d.viewsChanged.Notify()
	}
}

// members returns the live (and suspect) gossip members, sorted by name.
func (d *gossipState) members() []GossipMember {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]GossipMember, 0, len(d.addrs))
	for name, addr := range d.addrs {
		out = append(out, GossipMember{Name: name, Addr: addr})
	}
	slices.SortFunc(out, func(a, b GossipMember) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// alive reports whether gossip counts member id in now.
func (d *gossipState) alive(id string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	_, ok := d.addrs[id]
	return ok
}

// addrOf returns the address member id gossips from, "" when it is not
// a member.
func (d *gossipState) addrOf(id string) string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.addrs[id]
}

// views returns the members' views of the clusters; members whose
// metadata does not parse are left out.
func (d *gossipState) views() coordinator.AgentViews {
	v, _ := d.viewsFrom()
	return v
}

// viewsFrom is views with the address each member gossips from.
func (d *gossipState) viewsFrom() (coordinator.AgentViews, map[string]string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	out, addrs := coordinator.AgentViews{}, map[string]string{}
	for name, meta := range d.metas {
		if v, err := parseViews(meta); err == nil {
			out[name], addrs[name] = v, d.addrs[name]
		}
	}
	return out, addrs
}

// skewAllowance is how far an agent's clock may be ahead of the leader's
// before a claimed failure longer than the agent has run is counted as
// refused (it is cut to that length either way).
const skewAllowance = 5 * time.Second

// memberViews returns the views the leader may count: those of gossip
// members that are agents registered in etcd and gossip from the address
// they registered (a stranger's node, or one using a member's name from
// elsewhere, says nothing), each failure claimed no longer than the agent
// has run (fail_ms counts from the agent's start at most: Registration.Started).
// What it refuses or cuts is logged and counted as refused (kind
// "gossip") once per distinct value. Called by the leader's loop.
func (a *Agent) memberViews(now time.Time) coordinator.AgentViews {
	regs := map[string]state.Registration{}
	for _, r := range a.registry.list() {
		regs[r.ID] = r
	}
	views, addrs := a.gossip.viewsFrom()
	out := coordinator.AgentViews{}
	refusals := map[string]string{}
	for name, v := range views {
		r, ok := regs[name]
		if !ok {
			continue // not a member, or not yet: the leader counts only members anyway
		}
		if r.Gossip != addrs[name] {
			refusals[name+"@"+addrs[name]] = fmt.Sprintf("gossips from %s, but its registration says %s: its views are not counted", addrs[name], r.Gossip)
			continue
		}
		// In milliseconds, as claimed: a claim as a Duration could overflow.
		ran := max(0, now.Sub(r.Started).Milliseconds())
		bounded := make(map[string]coordinator.ClusterView, len(v))
		for c, cv := range v {
			switch {
			case cv.FailingMs < 0:
				refusals[fmt.Sprintf("%s/%s/%d", name, c, cv.FailingMs)] = fmt.Sprintf("claims cluster %s failing for %d ms, a negative time: counted as 0", c, cv.FailingMs)
				cv.FailingMs = 0
			case !cv.Reachable && cv.FailingMs > ran:
				if cv.FailingMs-ran > skewAllowance.Milliseconds() {
					refusals[fmt.Sprintf("%s/%s/%d", name, c, cv.FailingMs)] = fmt.Sprintf("claims cluster %s unreachable for %d ms, but started %d ms ago (its registration): counted from its start",
						c, cv.FailingMs, ran)
				}
				cv.FailingMs = ran
			}
			bounded[c] = cv
		}
		out[name] = bounded
	}
	a.viewRefusals.note(refusals, a.log, func() { a.metrics.badValues.WithLabelValues(refused.Gossip).Inc() })
	return out
}

// viewRefusals remembers the refusals memberViews last reported, so that
// a value refused at every leader turn is logged and counted once.
type viewRefusals struct {
	mu   sync.Mutex
	last map[string]string
}

// note logs and counts the refusals (by the member, and what it sent,
// in the key, "member@addr" or "member/cluster/fail_ms"; why as value)
// that were not refused at the last call.
func (r *viewRefusals) note(now map[string]string, log *zap.Logger, count func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for k, why := range now {
		if _, was := r.last[k]; was {
			continue
		}
		member, _, _ := strings.Cut(k, "/")
		member, _, _ = strings.Cut(member, "@")
		log.Warn("gossip view refused", zap.String("member", member), zap.String("why", why))
		count()
	}
	r.last = now
}

// parseViews decodes a member's gossip metadata: its view of each cluster
// (healthMeta.NodeMeta). memberlist bounds metadata to 512 bytes.
func parseViews(meta []byte) (map[string]coordinator.ClusterView, error) {
	if len(meta) == 0 {
		return nil, errors.New("agent: gossip metadata is empty: the member's views do not fit or are not known yet")
	}
	var v map[string]coordinator.ClusterView
	if err := json.Unmarshal(meta, &v); err != nil {
		return nil, fmt.Errorf("agent: gossip metadata is not a JSON object of cluster views: %w", err)
	}
	return v, nil
}

func (d *gossipState) NotifyJoin(n *memberlist.Node)   { d.keepMeta(n) }
func (d *gossipState) NotifyUpdate(n *memberlist.Node) { d.keepMeta(n) }
func (d *gossipState) NotifyLeave(n *memberlist.Node) {
	d.mu.Lock()
	delete(d.metas, n.Name)
	delete(d.addrs, n.Name)
	d.mu.Unlock()
	select {
	case d.dead <- n.Name:
	default:
		d.dropped()
	}
}

// healthMeta is the memberlist delegate that carries this agent's view of
// each Kafka cluster in its node metadata, so every agent (the leader
// above all) sees every agent's view without asking etcd. memberlist
// calls NodeMeta from its own goroutines; it reads the prober's snapshot
// and never blocks.
type healthMeta struct {
	views func() map[string]coordinator.ClusterView
}

func (h *healthMeta) NodeMeta(limit int) []byte {
	b, err := json.Marshal(h.views())
	if err != nil || len(b) > limit {
		return nil // too many clusters to fit: the leader treats the views as unknown
	}
	return b
}
func (h *healthMeta) NotifyMsg([]byte)                           {}
func (h *healthMeta) GetBroadcasts(overhead, limit int) [][]byte { return nil }
func (h *healthMeta) LocalState(join bool) []byte                { return nil }
func (h *healthMeta) MergeRemoteState(buf []byte, join bool)     {}

// pushPullInterval is how often each agent exchanges the whole member
// state with one other over TCP (newMemberlist). It bounds how late a
// view reaches the leader when its UDP broadcast is lost, which full
// runs of the agent tests showed for every agent of a test at once (the
// leader seeing only its own view for 2.8-6 s with 5 s here): a failover
// waits for it.
const pushPullInterval = time.Second

// updateWait is how long gossipHealthLoop waits for a metadata broadcast.
const updateWait = 20 * time.Millisecond

// gossipHealthLoop re-announces this agent's metadata when its view of a
// cluster changed, and every interval to refresh latencies.
func (a *Agent) gossipHealthLoop(ctx context.Context, changed <-chan struct{}, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-changed:
		case <-t.C:
		}
		// UpdateNode queues the broadcast at once, then waits until it
		// has been sent its last time (several gossip rounds, about a
		// second): a change must not wait behind the previous update, so
		// the wait is short; the broadcast goes on regardless.
		if err := a.ml.UpdateNode(updateWait); err != nil {
			a.log.Debug("gossip metadata update still being sent", zap.Error(err))
		}
	}
}

// gossipOptions are the settings of this agent's gossip node.
type gossipOptions struct {
	id, bind, advertise string
	// label is sent with every packet and stream and required of every
	// one received: agents of other fleets on the same network never
	// merge with this one.
	label string
	// keys encrypt gossip when set: the first is used to send, every one
	// to receive; unencrypted packets are refused. None: plain gossip
	// (agent.gossip_encryption off).
	keys [][]byte
}

// newMemberlist creates this agent's gossip node, and returns its keyring
// (nil without keys), in which keys can change while it runs. bind and
// advertise are host:port; port 0 binds a free port (the same for TCP and
// UDP).
func newMemberlist(o gossipOptions, mlog *memberlistLog, events memberlist.EventDelegate, meta memberlist.Delegate) (*memberlist.Memberlist, *memberlist.Keyring, error) {
	id, bind, advertise := o.id, o.bind, o.advertise
	c := memberlist.DefaultLANConfig()
	c.Name = id
	c.Events = events
	c.Delegate = meta
	c.Label = o.label
	if len(o.keys) > 0 {
		kr, err := memberlist.NewKeyring(o.keys[1:], o.keys[0])
		if err != nil {
			return nil, nil, fmt.Errorf("agent: gossip keys: %w", err)
		}
		c.Keyring = kr
		c.GossipVerifyIncoming, c.GossipVerifyOutgoing = true, true
	}
	host, port, err := splitHostPort(bind)
	if err != nil {
		return nil, nil, fmt.Errorf("agent: gossip address %q: %w", bind, err)
	}
	c.BindAddr, c.BindPort = host, port
	c.AdvertisePort = port
	if advertise != "" {
		if c.AdvertiseAddr, c.AdvertisePort, err = splitHostPort(advertise); err != nil {
			return nil, nil, fmt.Errorf("agent: gossip advertise address %q: %w", advertise, err)
		}
	}
	// Joins and push/pull go to agents on the same LAN; a dead seed must not
	// hold the join loop for the LAN default of 10 s.
	c.TCPTimeout = 3 * time.Second
	// A view of a cluster travels in UDP broadcasts, which gossip sends a
	// few times and may lose; the periodic TCP push/pull exchange of every
	// member's state heals a lost one. memberlist's LAN default is 30 s
	// (scaled up with the fleet's size past 32 members): longer than a
	// failover may wait for a view. Every second (pushPullInterval) costs
	// each agent one TCP exchange of the members' metadata (a few hundred
	// bytes each) a second.
	c.PushPullInterval = pushPullInterval
	c.Logger = log.New(mlog, "", 0)
	ml, err := memberlist.Create(c)
	if err != nil {
		return nil, nil, fmt.Errorf("agent: start gossip on %s: %w", bind, err)
	}
	return ml, c.Keyring, nil
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

// gossipJoinLoop joins the agents registered in etcd that are not yet
// gossip members: etcd is the seed list, so no static seeds are needed. It
// runs on every registry change and every interval (to heal a partition
// that memberlist alone would not), until ctx ends.
func (a *Agent) gossipJoinLoop(ctx context.Context, interval time.Duration) {
	// Without the fleet's key no member would hear this agent.
	select {
	case <-ctx.Done():
		return
	case <-a.gossipKeyed:
	}
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
		var seeds []string
		for _, r := range a.registry.list() {
			if r.ID != a.id && !a.gossip.alive(r.ID) && r.Gossip != "" {
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

// answerTimeout bounds the HTTP request that confirms a gossip death.
const answerTimeout = time.Second

// answers reports whether agent id's HTTP endpoint, at the address it
// registered, answers a GET of /healthz within answerTimeout, whatever
// the status. HTTPS when this agent serves HTTPS (the fleet's agents
// share their TLS settings); the certificate is not checked: only
// whether something answers there (a TLS alert counts: a listener that
// requires client certificates answers with one), and trusting an answer
// can only keep an agent, never evict it.
func (a *Agent) answers(ctx context.Context, id string) bool {
	r, ok := a.registry.get(id)
	if !ok || r.HTTP == "" {
		return false
	}
	_, _, err := a.getHealthz(ctx, r.HTTP)
	if err != nil {
		// A listener that requires client certificates this agent
		// lacks refuses the handshake with an alert: it answered.
		var alert tls.AlertError
		return errors.As(err, &alert) || strings.Contains(err.Error(), "remote error: tls")
	}
	return true
}

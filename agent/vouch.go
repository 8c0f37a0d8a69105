package agent

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/coordinator"
	"github.com/kswitch/kswitch/internal/notify"
	"github.com/kswitch/kswitch/state"
)

// The leader plans only on registered agents that have shown they are the
// process their registration names (coordinator's silence): a stranger
// with write access to the fleet's prefix can put a registration on any
// live lease, and etcd does not say who wrote it. The proof is asked of
// the agent itself, at the HTTP address it registered: its /healthz names
// its id and the lease of its session, and both must match the
// registration. When that address does not answer, membership of the
// fleet's keyed gossip at the registered gossip address is the proof
// (askProof). A registration whose address does not answer stays
// unproven (the leader plans without it, and names it silent after
// silentAfter); one whose address answers as another agent or lease is
// refuted. An agent that answers over HTTP is still only as good as the
// network path to it: SECURITY.md says what this proves and what it does
// not.

// healthzBody is what /healthz answers: the identity the proof reads.
type healthzBody struct {
	Status string `json:"status"`
	Agent  string `json:"agent"`
	// Lease is the agent's session lease, hexadecimal as etcdctl prints
	// it; empty while it has no session.
	Lease string `json:"lease,omitempty"`
}

// vouchRetry is how long a registration not shown (unknown or refuted)
// waits before it is asked again.
const vouchRetry = 2 * time.Second

// vouchers checks the registrations' proofs while this agent leads and
// keeps the results (they outlive a term: a registration's proof does not
// change while its lease lives). Safe for concurrent use.
type vouchers struct {
	self func() (string, clientv3.LeaseID) // this agent's id and lease
	ask  func(ctx context.Context, r state.Registration) (coordinator.Proof, string)
	log  *zap.Logger

	mu      sync.Mutex
	results map[vouchKey]vouchResult
	changed notify.Subscribers
}

// vouchKey is what a proof is about: one registration.
type vouchKey struct {
	id    string
	lease clientv3.LeaseID
	http  string
}

type vouchResult struct {
	proof coordinator.Proof
	why   string
	at    time.Time
}

// vouched implements coordinator.Membership.Vouched for registration r.
func (v *vouchers) vouched(r state.Registration, ok bool) (coordinator.Proof, string) {
	if !ok {
		return coordinator.ProofUnknown, "not registered"
	}
	if id, lease := v.self(); r.ID == id && r.Lease == lease {
		return coordinator.ProofShown, ""
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	res, seen := v.results[vouchKey{r.ID, r.Lease, r.HTTP}]
	if !seen {
		return coordinator.ProofUnknown, fmt.Sprintf("its HTTP endpoint at %s has not been asked yet", r.HTTP)
	}
	return res.proof, res.why
}

// run asks every registration not shown (again every vouchRetry) until
// ctx ends. regs lists the registrations; wake tells of changes.
func (v *vouchers) run(ctx context.Context, regs func() []state.Registration, wake <-chan struct{}) {
	t := time.NewTicker(vouchRetry)
	defer t.Stop()
	for {
		v.round(ctx, regs())
		select {
		case <-ctx.Done():
			return
		case <-wake:
		case <-t.C:
		}
	}
}

// round asks the registrations due, concurrently, and forgets the results
// of registrations gone.
func (v *vouchers) round(ctx context.Context, regs []state.Registration) {
	now := time.Now()
	id, lease := v.self()
	v.mu.Lock()
	keep := make(map[vouchKey]bool, len(regs))
	var due []state.Registration
	for _, r := range regs {
		k := vouchKey{r.ID, r.Lease, r.HTTP}
		keep[k] = true
		res, seen := v.results[k]
		if (r.ID == id && r.Lease == lease) || seen && (res.proof == coordinator.ProofShown || now.Sub(res.at) < vouchRetry) {
			continue
		}
		due = append(due, r)
	}
	for k := range v.results {
		if !keep[k] {
			delete(v.results, k)
		}
	}
	v.mu.Unlock()
	if len(due) == 0 {
		return
	}
	var wg sync.WaitGroup
	var changed atomic.Bool
	for _, r := range due {
		wg.Go(func() {
			p, why := v.ask(ctx, r)
			if ctx.Err() != nil {
				return
			}
			k := vouchKey{r.ID, r.Lease, r.HTTP}
			v.mu.Lock()
			old, seen := v.results[k]
			v.results[k] = vouchResult{proof: p, why: why, at: time.Now()}
			v.mu.Unlock()
			if !seen || old.proof != p {
				switch p {
				case coordinator.ProofShown:
					v.log.Debug("agent shown to be its registration", zap.String("member", r.ID), zap.String("http", r.HTTP))
				case coordinator.ProofRefuted:
					v.log.Warn("registration refuted by the agent at its address; the leader plans without it",
						zap.String("registration", r.ID), zap.String("why", why))
				}
				changed.Store(true)
			}
		})
	}
	wg.Wait()
	if changed.Load() {
		v.changed.Notify()
	}
}

// selfLease returns this agent's id and the lease of its registration
// (NoLease while it has none).
func (a *Agent) selfLease() (string, clientv3.LeaseID) {
	if s := a.session.Load(); s != nil && s.registered {
		return a.id, s.lease
	}
	return a.id, clientv3.NoLease
}

// askProof asks agent r for its proof: over HTTP (askHTTP), and when its
// endpoint does not answer (or refuses this agent's TLS handshake), in
// gossip: a member of the fleet's keyed gossip named r.ID, gossiping from
// the address r registered, holds the fleet's key, which no stranger
// with only etcd write access to the fleet's prefix has (it is kept
// under a prefix of its own). Plain gossip (agent.gossip_encryption:
// off) proves nothing.
func (a *Agent) askProof(ctx context.Context, r state.Registration) (coordinator.Proof, string) {
	p, why := a.askHTTP(ctx, r)
	if p != coordinator.ProofUnknown || a.cfg.Agent.GossipEncryption == "off" {
		return p, why
	}
	if addr := a.gossip.addrOf(r.ID); addr != "" && addr == r.Gossip {
		return coordinator.ProofShown, ""
	}
	return p, why + ", and it is not in the fleet's keyed gossip at " + r.Gossip
}

// askHTTP asks agent r, at the HTTP address it registered, who it is
// (getHealthz). The server's certificate is not checked: what proves the
// identity is the answer's content matching the registration, which only
// the process holding that lease knows to give together with the id at
// that address.
func (a *Agent) askHTTP(ctx context.Context, r state.Registration) (coordinator.Proof, string) {
	status, data, err := a.getHealthz(ctx, r.HTTP)
	if err != nil {
		return coordinator.ProofUnknown, fmt.Sprintf("its HTTP endpoint at %s does not answer: %v", r.HTTP, err)
	}
	var body healthzBody
	if err := json.Unmarshal(data, &body); err != nil || body.Agent == "" {
		return coordinator.ProofRefuted, fmt.Sprintf("its HTTP endpoint at %s does not answer as a kswitch agent (status %d)", r.HTTP, status)
	}
	lease, err := strconv.ParseInt(body.Lease, 16, 64)
	switch {
	case body.Agent != r.ID:
		return coordinator.ProofRefuted, fmt.Sprintf("its HTTP endpoint at %s says it is agent %q", r.HTTP, body.Agent)
	case body.Lease == "":
		// Between sessions: ask again.
		return coordinator.ProofUnknown, fmt.Sprintf("agent %s at %s has no session now", r.ID, r.HTTP)
	case err != nil || clientv3.LeaseID(lease) != r.Lease:
		return coordinator.ProofRefuted, fmt.Sprintf("agent %s at %s is on lease %s, the registration on lease %x", r.ID, r.HTTP, body.Lease, int64(r.Lease))
	}
	return coordinator.ProofShown, ""
}

// getHealthz GETs /healthz of the agent at addr within answerTimeout and
// returns the status and the body's first 4 KiB. It is HTTPS when this
// agent serves HTTPS (the fleet's agents share their TLS settings),
// presenting this agent's certificate when the listeners require client
// certificates; the server's certificate is not checked (the callers,
// answers and askHTTP, say why that is enough for them).
func (a *Agent) getHealthz(ctx context.Context, addr string) (int, []byte, error) {
	scheme := "http"
	tr := &http.Transport{DisableKeepAlives: true, Proxy: nil}
	if h := a.cfg.Agent.HTTPTLS; h.On() {
		scheme = "https"
		tc := &tls.Config{InsecureSkipVerify: true} //nolint:gosec // see above
		if h.ClientCAFile != "" {
			if cert, err := tls.LoadX509KeyPair(h.CertFile, h.KeyFile); err == nil {
				tc.Certificates = []tls.Certificate{cert}
			}
		}
		tr.TLSClientConfig = tc
	}
	defer tr.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(ctx, answerTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, scheme+"://"+addr+"/healthz", nil)
	if err != nil {
		return 0, nil, err
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	return resp.StatusCode, data, err
}

package agent

import (
	"cmp"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"golang.org/x/net/netutil"

	"github.com/kswitch/kswitch/coordinator"
	"github.com/kswitch/kswitch/fleetview"
	"github.com/kswitch/kswitch/signals"
	"github.com/kswitch/kswitch/state"
)

// LeaderView is the body of GET /leader.
type LeaderView struct {
	// Leader is the leader's agent id; empty when nobody leads.
	Leader string `json:"leader"`
	// Self is true while this agent leads: its leader work runs and etcd's
	// election does not name another agent.
	Self bool `json:"self"`
	// FencingToken is the creation revision of the leader key.
	FencingToken int64 `json:"fencing_token"`
	// Agent is this agent's id.
	Agent string `json:"agent"`
}

// Status is the body of GET /status.
type Status struct {
	Agent       string               `json:"agent"`
	Fleet       string               `json:"fleet"`
	Version     string               `json:"version"`
	Started     time.Time            `json:"started"`
	Ready       bool                 `json:"ready"`
	ReadyReason string               `json:"ready_reason,omitempty"`
	Leader      LeaderView           `json:"leader"`
	Agents      []state.Registration `json:"agents"`
	Gossip      []GossipMember       `json:"gossip"`
	Etcd        EtcdStatus           `json:"etcd"`
	// Clusters is every gossip member's view of each Kafka cluster.
	Clusters coordinator.AgentViews `json:"clusters"`
	// Active is the cluster of the assignment this agent applied.
	Active string `json:"active_cluster,omitempty"`
	// Owned are the partitions this agent consumes on the active cluster;
	// OwnedOn those it consumes on the clusters topics are placed on
	// (Active.Topics), by cluster.
	Owned   []state.TopicPartition            `json:"owned"`
	OwnedOn map[string][]state.TopicPartition `json:"owned_on,omitempty"`
	// Signals are the pause/start signals in force and the refused ones.
	Signals signals.State `json:"signals"`
	// SignalsApplied is the etcd revision of the signals every partition
	// of this agent obeys (Agent.SignalsApplied).
	SignalsApplied int64 `json:"signals_applied"`
	// Handler is what the handler reports (the routing sink: rules
	// version, channels, the last refused version).
	Handler any `json:"handler,omitempty"`
	// Coordinator is the leader's last verdict (only on the leader).
	Coordinator *coordinator.LeaderStatus `json:"coordinator,omitempty"`
	// Config is the dynamic configuration version in force.
	Config ConfigStatus `json:"config"`
	// ConfigDigest is the digest of this agent's fleet-wide
	// configuration; ConfigDisagree the registered agents whose digest
	// differs from the fleet's (CompareConfigs).
	ConfigDigest   state.ConfigDigest         `json:"config_digest"`
	ConfigDisagree []state.ConfigDisagreement `json:"config_disagree,omitempty"`
}

// EtcdStatus is this agent's view of its etcd connection.
type EtcdStatus struct {
	Endpoints []string `json:"endpoints"`
	Reachable bool     `json:"reachable"`
	LastError string   `json:"last_error,omitempty"`
	LeaseID   int64    `json:"lease_id,omitempty"`
}

// The HTTP server's limits. Every endpoint is a small GET answered from
// memory, except /metrics (about 300 KiB at 1 200 partitions) and the
// status page, which reads etcd (4 s bound), each agent's /readyz (1 s)
// and Kafka's end offsets before it answers.
const (
	// httpReadHeaderTimeout bounds reading a request's headers, and so a
	// new connection that sends nothing (slowloris).
	httpReadHeaderTimeout = 5 * time.Second
	// httpReadTimeout bounds reading a whole request; the endpoints take
	// no body.
	httpReadTimeout = 10 * time.Second
	// httpWriteTimeout bounds a response, from the end of its request's
	// headers: the status page's own bounds, and a scraper that reads
	// /metrics slowly, fit well within it.
	httpWriteTimeout = 30 * time.Second
	// httpIdleTimeout closes a keep-alive connection that carries no
	// request for this long. A scraper that scrapes less often opens a
	// new connection per scrape, which costs nothing that matters.
	httpIdleTimeout = 30 * time.Second
	// httpMaxConns caps the open connections (TLS handshakes included):
	// past it, new connections wait in the kernel's accept queue until
	// one closes, so clients that hold connections cannot exhaust the
	// process's file descriptors, which Kafka and etcd need. Scrapers,
	// probes, peers' status pages and operators use a handful.
	httpMaxConns = 256
)

// listenHTTP binds agent.http: at most httpMaxConns open connections,
// in TLS when agent.http_tls is set.
func (a *Agent) listenHTTP() (net.Listener, error) {
	ln, err := net.Listen("tcp", a.cfg.Agent.HTTP)
	if err != nil {
		return nil, fmt.Errorf("agent: listen on agent.http %s: %w (is another agent using this port?)", a.cfg.Agent.HTTP, err)
	}
	// Under TLS: a connection counts from its handshake.
	ln = netutil.LimitListener(ln, cmp.Or(a.opts.hooks.HTTPMaxConns, httpMaxConns))
	return a.httpTLS(ln)
}

// newHTTPServer returns the server of the agent's endpoints (handler),
// with the limits above.
func (a *Agent) newHTTPServer() *http.Server {
	return &http.Server{
		Handler:           a.handler(),
		ReadHeaderTimeout: httpReadHeaderTimeout,
		ReadTimeout:       httpReadTimeout,
		WriteTimeout:      httpWriteTimeout,
		IdleTimeout:       cmp.Or(a.opts.hooks.HTTPIdleTimeout, httpIdleTimeout),
		ErrorLog:          zap.NewStdLog(a.log.Named("http")), // TLS handshake errors and the like
	}
}

// httpTLS wraps the HTTP listener in TLS when agent.http_tls is set, and
// returns ln itself otherwise. On error ln is closed.
func (a *Agent) httpTLS(ln net.Listener) (net.Listener, error) {
	tc, err := a.cfg.Agent.HTTPTLS.ServerConfig("agent.http_tls")
	if err != nil {
		ln.Close()
		return nil, fmt.Errorf("agent: %w", err)
	}
	if tc == nil {
		return ln, nil
	}
	return tls.NewListener(ln, tc), nil
}

// handler serves the agent's read-only HTTP endpoints. No endpoint changes
// fleet state: changes go through etcd and its access control. Only GET
// and HEAD are accepted, on every path; anything else is 405.
func (a *Agent) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		body := healthzBody{Status: "alive", Agent: a.id}
		if s := a.session.Load(); s != nil && s.lease != clientv3.NoLease {
			body.Lease = fmt.Sprintf("%x", int64(s.lease))
		}
		writeJSON(w, http.StatusOK, body)
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		ok, reason := a.Ready()
		body := fleetview.ReadyBody{Status: "ready", Agent: a.id, RecordsPerSecond: strconv.FormatFloat(a.rate.perSecond(), 'f', 1, 64)}
		code := http.StatusOK
		if !ok {
			body.Status, body.Reason, code = "not ready", reason, http.StatusServiceUnavailable
		}
		writeJSON(w, code, body)
	})
	mux.HandleFunc("GET /leader", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, a.LeaderView())
	})
	mux.HandleFunc("GET /status", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, a.Status())
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(a.reg, promhttp.HandlerOpts{}))
	if a.cfg.Agent.Pprof {
		mux.HandleFunc("GET /debug/pprof/", pprof.Index) // heap, goroutine, allocs, block, mutex, ...
		mux.HandleFunc("GET /debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("GET /debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("GET /debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("GET /debug/pprof/trace", pprof.Trace)
	}
	mux.Handle("GET /", fleetview.Page{Self: a.id, Etcd: a.client, Config: a.dyn.current, Handler: a.opts.HandlerStatus,
		Leading: func() *coordinator.LeaderStatus {
			if a.Leading() {
				return a.leader.Status()
			}
			return nil
		}})
	return readOnly(mux)
}

// readOnly refuses every method but GET and HEAD with 405, before h sees
// the request, so that no endpoint added later can change state by
// accident.
func readOnly(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "read-only: the agent's endpoints accept GET and HEAD only; change the fleet through etcd", http.StatusMethodNotAllowed)
			return
		}
		h.ServeHTTP(w, r)
	})
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v) // the client went away; nothing to do
}

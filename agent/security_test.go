package agent_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/fleet"
	"github.com/kswitch/kswitch/internal/etcdclient"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/signals"
	"github.com/kswitch/kswitch/state"
)

// The secure world's users and secrets. The passwords are distinctive so
// that finding one in a log, /status or /metrics cannot be a coincidence.
const (
	fleetUser    = "kswitch-orders"
	fleetPass    = "etcd-pw-Xq7fleet"
	wrongPass    = "etcd-pw-Wr0ngone"
	strangerUser = "kswitch-other"
	strangerPass = "etcd-pw-Str4nger"
	operatorUser = "orders-operator"
	operatorPass = "etcd-pw-0perator"
	// noKeyUser has the fleet's role as it was before the fleet's
	// gossip key: the prefix only.
	noKeyUser     = "kswitch-orders-nokey"
	noKeyPass     = "etcd-pw-N0keyrol"
	kafkaUser     = "kswitch"
	kafkaPass     = "kafka-pw-Scr4mA1"
	kafkaWrong    = "kafka-pw-Wr0ngB2"
	securePartsN  = 4
	secureRecords = 200
)

var allSecrets = []string{fleetPass, wrongPass, strangerPass, operatorPass, noKeyPass, kafkaPass, kafkaWrong}

// secureWorld is an etcd with TLS, client certificates and auth, holding
// the fleet's user (a role limited to /kswitch/orders/, as
// docs/SECURITY.md describes), a stranger (a role on another fleet's
// prefix) and an operator; and a Kafka cluster requiring SASL SCRAM.
type secureWorld struct {
	etcd  *devstack.Etcd
	kafka *devstack.Kafka
	pki   *devstack.PKI
	// agentCert is the agents' etcd client certificate; its common name
	// is the fleet's user, as a deployment would issue it.
	agentCert devstack.Cert
	// httpCert is the agents' HTTPS certificate.
	httpCert devstack.Cert
	dir      string
	logs     *syncBuffer
	// https is a client of the agents' HTTPS endpoints. Its timeout is
	// generous: TLS handshakes under the race detector on a loaded
	// machine took seconds.
	https *http.Client
}

func startSecureWorld(t *testing.T) *secureWorld {
	t.Helper()
	w := &secureWorld{etcd: testenv.StartSecureEtcdT(t), dir: t.TempDir(), logs: &syncBuffer{}}
	w.pki = w.etcd.Security().PKI
	tr := &http.Transport{TLSClientConfig: w.pki.ClientTLS(nil)}
	w.https = &http.Client{Timeout: 10 * time.Second, Transport: tr}
	t.Cleanup(func() {
		tr.CloseIdleConnections()
		if t.Failed() {
			logs := w.logs.Bytes()
			t.Logf("the agents' logs, last 20 KiB:\n%s", logs[max(0, len(logs)-20<<10):])
		}
	})
	prefix := keys.New("orders").Prefix()
	rw := clientv3.PermissionType(clientv3.PermReadWrite)
	read := clientv3.PermissionType(clientv3.PermRead)
	for _, u := range []struct {
		name, pass string
		perms      []devstack.EtcdPermission
	}{
		{fleetUser, fleetPass, []devstack.EtcdPermission{{Key: prefix, Prefix: true, Type: rw}, {Key: keys.New("orders").GossipKey(), Type: rw}}},
		{strangerUser, strangerPass, []devstack.EtcdPermission{{Key: keys.New("other").Prefix(), Prefix: true, Type: rw}}},
		{noKeyUser, noKeyPass, []devstack.EtcdPermission{{Key: prefix, Prefix: true, Type: rw}}},
		{operatorUser, operatorPass, []devstack.EtcdPermission{
			{Key: prefix, Prefix: true, Type: read},
			{Key: prefix + "signals/", Prefix: true, Type: rw},
			{Key: prefix + "control/", Prefix: true, Type: rw},
		}},
	} {
		if err := w.etcd.AddUser(u.name, u.pass, u.perms...); err != nil {
			t.Fatal(err)
		}
	}
	var err error
	if w.agentCert, err = w.pki.Issue("agent", fleetUser); err != nil {
		t.Fatal(err)
	}
	if w.httpCert, err = w.pki.Issue("agent-http", "agent-http"); err != nil {
		t.Fatal(err)
	}
	w.kafka = testenv.StartKafkaT(t, "A", devstack.KafkaOptions{
		Topics: map[string]int32{"orders": securePartsN, "delivered": securePartsN},
		Extra:  devstack.KafkaSASL(config.SASLScramSHA256, kafkaUser, kafkaPass),
	})
	return w
}

// secret writes a password file as a secret mount would: one line.
func (w *secureWorld) secret(t *testing.T, name, pass string) string {
	t.Helper()
	file := filepath.Join(w.dir, name)
	if err := os.WriteFile(file, []byte(pass+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return file
}

// config is an agent's configuration in the secure world: etcd over TLS
// with the agent's certificate, as etcdUser with the password from a
// file; Kafka with SASL SCRAM-SHA-256 and an inline password; HTTPS.
func (w *secureWorld) config(t *testing.T, id, etcdUser, etcdPass, kafkaPassword string) config.Config {
	t.Helper()
	cfg := consumeConfig(w.etcd, w.kafka, id)
	cfg.Etcd.TLS = config.TLS{CAFile: w.pki.CAFile, CertFile: w.agentCert.CertFile, KeyFile: w.agentCert.KeyFile}
	cfg.Etcd.Username, cfg.Etcd.PasswordFile = etcdUser, w.secret(t, id+"-etcd", etcdPass)
	a := cfg.Clusters["A"]
	a.SASL = config.SASL{Mechanism: config.SASLScramSHA256, Username: kafkaUser, Password: config.Secret(kafkaPassword)}
	cfg.Clusters["A"] = a
	cfg.Agent.HTTPTLS = config.ServerTLS{CertFile: w.httpCert.CertFile, KeyFile: w.httpCert.KeyFile}
	cfg.Failover.ProbeInterval = 200 * time.Millisecond
	cfg.Failover.FailureWindow = time.Second
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// logger writes debug and up to the world's log buffer, which the tests
// search for secrets.
func (w *secureWorld) logger(name string) *zap.Logger {
	enc := zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig())
	return zap.New(zapcore.NewCore(enc, zapcore.AddSync(w.logs), zap.DebugLevel)).Named(name)
}

// start starts an agent logging to the world's buffer.
func (w *secureWorld) start(t *testing.T, cfg config.Config, h record.Handler) *agent.Agent {
	t.Helper()
	return startFleetAgent(t, cfg, agent.Options{Logger: w.logger(cfg.Agent.ID), Handler: h})
}

// delivered counts the records in delivered, over SASL.
func (w *secureWorld) delivered(c config.Cluster) (int64, error) {
	cl, err := kafka.NewClient("A", c)
	if err != nil {
		return 0, err
	}
	defer cl.Close()
	var n int64
	for p := range int32(securePartsN) {
		end, err := cl.GetOffset("delivered", p, sarama.OffsetNewest)
		if err != nil {
			return 0, err
		}
		n += end
	}
	return n, nil
}

func (w *secureWorld) get(a *agent.Agent, path string) (int, []byte, error) {
	resp, err := w.https.Get("https://" + a.HTTPAddr() + path)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, body, err
}

func (w *secureWorld) readyz(a *agent.Agent) (int, string, error) {
	code, body, err := w.get(a, "/readyz")
	if err != nil {
		return 0, "", err
	}
	var r map[string]string
	if err := json.Unmarshal(body, &r); err != nil {
		return code, "", err
	}
	return code, r["reason"], nil
}

// produce writes secureRecords records to orders over SASL.
func (w *secureWorld) produce(t *testing.T, c config.Cluster) {
	t.Helper()
	sc, err := kafka.Config(c)
	if err != nil {
		t.Fatal(err)
	}
	sc.Producer.Return.Successes = true
	sc.Producer.Partitioner = sarama.NewRoundRobinPartitioner
	p, err := sarama.NewSyncProducer(c.Brokers, sc)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	msgs := make([]*sarama.ProducerMessage, secureRecords)
	for i := range msgs {
		msgs[i] = &sarama.ProducerMessage{Topic: "orders", Value: sarama.StringEncoder(fmt.Sprint(i))}
	}
	if err := p.SendMessages(msgs); err != nil {
		t.Fatal(err)
	}
}

// noSecrets fails the test if any password shows in what.
func noSecrets(t *testing.T, where string, what []byte) {
	t.Helper()
	for _, s := range allSecrets {
		if i := bytes.Index(what, []byte(s)); i >= 0 {
			t.Errorf("password %q shows in %s: …%s…", s, where, what[max(0, i-200):min(len(what), i+len(s)+50)])
		}
	}
}

// TestSecureFleet: agents against an etcd with client TLS and auth, as a
// user whose role is limited to the fleet's prefix, and a Kafka cluster
// requiring SASL SCRAM, elect a leader, get the partitions, consume every
// record and route it to a channel on that cluster (as 'kswitch agent'
// does: member); their HTTP endpoints are HTTPS. No password shows in the
// logs, /status or /metrics.
func TestSecureFleet(t *testing.T) {
	t.Parallel()
	w := startSecureWorld(t)
	var agents []*agent.Agent
	for _, id := range []string{"s1", "s2"} {
		cfg := w.config(t, id, fleetUser, fleetPass, kafkaPass)
		cfg.Routing = config.Routing{
			Channels: map[string]config.RoutingChannel{"out": {Cluster: "A", Topic: "delivered"}},
			Default:  []string{"out"},
		}
		m, err := fleet.NewMember(cfg, agent.Options{Logger: w.logger(id)})
		if err != nil {
			t.Fatal(err)
		}
		if err := m.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			defer cancel()
			if err := m.Stop(ctx); err != nil {
				t.Error(err)
			}
		})
		agents = append(agents, m.Agent())
	}
	cfg := w.config(t, "producer", fleetUser, fleetPass, kafkaPass)
	w.produce(t, cfg.Clusters["A"])

	wait.For(t, 20*time.Second, "one leader", func() error {
		var leading []string
		for _, a := range agents {
			if a.Leading() {
				leading = append(leading, a.ID())
			}
		}
		if len(leading) != 1 {
			return fmt.Errorf("leading: %v", leading)
		}
		return nil
	})
	waitBalanced(t, securePartsN, agents...)
	waitGossipMembers(t, 20*time.Second, "the agents gossiping with the fleet's key from etcd", agents...)
	wait.For(t, 20*time.Second, "every record consumed and routed", func() error {
		n, err := w.delivered(cfg.Clusters["A"])
		if err == nil && n != secureRecords {
			err = fmt.Errorf("%d of %d records in delivered", n, secureRecords)
		}
		return err
	})
	for _, a := range agents {
		// Readiness is live: a commit that runs late on a loaded
		// machine holds delivery (and readiness) for a moment. The
		// fleet must be ready, not at every instant.
		wait.For(t, 10*time.Second, a.ID()+" ready over HTTPS", func() error {
			code, reason, err := w.readyz(a)
			if err == nil && code != http.StatusOK {
				err = fmt.Errorf("/readyz = %d %q", code, reason)
			}
			return err
		})
		for _, path := range []string{"/status", "/metrics", "/leader", "/healthz"} {
			code, body, err := w.get(a, path)
			if err != nil || code != http.StatusOK {
				t.Errorf("%s %s = %d, %v", a.ID(), path, code, err)
			}
			noSecrets(t, a.ID()+" "+path, body)
		}
		// Plain HTTP gets no answer from the HTTPS listener.
		if code, _, err := getPlain(a); err == nil && code == http.StatusOK {
			t.Errorf("%s answered plain HTTP", a.ID())
		}
	}
	noSecrets(t, "the logs", w.logs.Bytes())
}

func getPlain(a *agent.Agent) (int, []byte, error) {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get("http://" + a.HTTPAddr() + "/status")
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, body, err
}

// TestSecureFleetRefusals: an agent whose etcd password is wrong, or whose
// role does not cover the fleet's prefix, stays unready (503) with a
// reason naming the cause; so does one whose role does not cover the
// fleet's gossip key, saying which grant it needs; an agent whose Kafka password is wrong reports
// the cluster unreachable with the authentication failure as the probe's
// error (in /status), not a timeout. No password shows anywhere.
func TestSecureFleetRefusals(t *testing.T) {
	t.Parallel()
	w := startSecureWorld(t)
	wrongEtcd := w.start(t, w.config(t, "wrong-etcd", fleetUser, wrongPass, kafkaPass), nil)
	stranger := w.start(t, w.config(t, "stranger", strangerUser, strangerPass, kafkaPass), nil)
	wrongKafka := w.start(t, w.config(t, "wrong-kafka", fleetUser, fleetPass, kafkaWrong), nil)
	noKey := w.start(t, w.config(t, "no-key", noKeyUser, noKeyPass, kafkaPass), nil)

	for _, tc := range []struct {
		a    *agent.Agent
		want string
	}{
		{wrongEtcd, `etcd authentication failed for user "kswitch-orders": wrong username or password`},
		{stranger, `etcd permission denied to user "kswitch-other" (read /kswitch/orders/agents/stranger)`},
	} {
		wait.For(t, 30*time.Second, tc.a.ID()+" unready for the right reason", func() error {
			code, reason, err := w.readyz(tc.a)
			if err != nil {
				return err
			}
			if code != http.StatusServiceUnavailable || !strings.Contains(reason, tc.want) {
				return fmt.Errorf("/readyz %d %q", code, reason)
			}
			return nil
		})
		// Refused, it stays refused: never registered.
		if tc.a.Status().Etcd.Reachable || len(tc.a.Registered()) > 0 {
			t.Errorf("%s: etcd reachable %v, registered %v", tc.a.ID(), tc.a.Status().Etcd.Reachable, tc.a.Registered())
		}
	}

	wait.For(t, 30*time.Second, "wrong-kafka reports A unreachable by SASL", func() error {
		code, body, err := w.get(wrongKafka, "/status")
		if err != nil || code != http.StatusOK {
			return fmt.Errorf("/status %d, %v", code, err)
		}
		var st agent.Status
		if err := json.Unmarshal(body, &st); err != nil {
			return err
		}
		v, ok := st.Clusters[wrongKafka.ID()]["A"]
		if !ok || v.Reachable || !strings.Contains(v.Error, "SASL authentication failed") {
			return fmt.Errorf("view of A: %+v", st.Clusters[wrongKafka.ID()])
		}
		return nil
	})
	// The etcd side of wrong-kafka is fine: it registers.
	wait.For(t, 20*time.Second, "wrong-kafka registered", func() error {
		if !slices.ContainsFunc(wrongKafka.Registered(), func(r state.Registration) bool { return r.ID == "wrong-kafka" }) {
			return fmt.Errorf("registered: %v", wrongKafka.Registered())
		}
		return nil
	})
	wait.For(t, 30*time.Second, "no-key unready, naming the grant it needs", func() error {
		code, reason, err := w.readyz(noKey)
		if err == nil && (code != http.StatusServiceUnavailable || !strings.Contains(reason, "grant the fleet's etcd role readwrite on /kswitch-keys/orders/gossip")) {
			err = fmt.Errorf("/readyz %d %q", code, reason)
		}
		return err
	})
	if n := len(noKey.Status().Gossip); n != 1 {
		t.Errorf("no-key, without the fleet's key, sees %d gossip members", n)
	}
	for _, a := range []*agent.Agent{wrongEtcd, stranger, wrongKafka, noKey} {
		for _, path := range []string{"/status", "/metrics", "/readyz"} {
			_, body, err := w.get(a, path)
			if err != nil {
				t.Errorf("%s %s: %v", a.ID(), path, err)
			}
			noSecrets(t, a.ID()+" "+path, body)
		}
	}
	noSecrets(t, "the logs", w.logs.Bytes())
}

// TestOperatorRole: the operator role of docs/SECURITY.md may pause and
// pin (signals/, control/) and read the fleet's state, and nothing else:
// it cannot write the leader's state, registrations, offsets or routes,
// nor another fleet's signals, nor read the fleet's gossip key.
func TestOperatorRole(t *testing.T) {
	t.Parallel()
	w := startSecureWorld(t)
	e := config.Default().Etcd
	e.Endpoints = w.etcd.Endpoints()
	e.TLS = config.TLS{CAFile: w.pki.CAFile, CertFile: w.agentCert.CertFile, KeyFile: w.agentCert.KeyFile}
	e.Username, e.Password = operatorUser, operatorPass
	cli, err := etcdclient.New(context.Background(), e, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	k := keys.New("orders")
	if err := signals.Write(ctx, cli, k, signals.Scope{Kind: signals.Fleet}, true, "maintenance"); err != nil {
		t.Errorf("operator pause: %v", err)
	}
	if _, err := cli.Put(ctx, k.Pin(), "B"); err != nil {
		t.Errorf("operator pin: %v", err)
	}
	if _, err := cli.Get(ctx, k.Prefix(), clientv3.WithPrefix()); err != nil {
		t.Errorf("operator read: %v", err)
	}
	if _, err := cli.Get(ctx, k.GossipKey()); !errors.Is(err, rpctypes.ErrPermissionDenied) {
		t.Errorf("operator read of %s: %v, want permission denied", k.GossipKey(), err)
	}
	for _, key := range []string{k.Active(), k.Assignment(), k.Agent("x"), k.Offset("A", "orders", 0), k.Routes(), keys.New("other").FleetSignal()} {
		if _, err := cli.Put(ctx, key, "x"); !errors.Is(err, rpctypes.ErrPermissionDenied) {
			t.Errorf("operator put %s: %v, want permission denied", key, err)
		}
	}
}

// TestHTTPIsReadOnly: the agent listens on the configured address only,
// answers GET and HEAD, and refuses every other method on every path with
// 405, before any handler runs.
func TestHTTPIsReadOnly(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcdT(t)
	a := startAgent(t, e, "ro")
	host, _, err := net.SplitHostPort(a.HTTPAddr())
	if err != nil || host != "127.0.0.1" {
		t.Errorf("listening on %s, want the configured 127.0.0.1", a.HTTPAddr())
	}
	c := http.Client{Timeout: 2 * time.Second}
	do := func(method, path string) *http.Response {
		t.Helper()
		req, err := http.NewRequest(method, "http://"+a.HTTPAddr()+path, strings.NewReader(`{"pause":true}`))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}
	for _, path := range []string{"/healthz", "/readyz", "/leader", "/status", "/metrics", "/nope"} {
		for _, method := range []string{http.MethodPost, http.MethodPut, http.MethodDelete, http.MethodPatch, http.MethodOptions, "PAUSE"} {
			if resp := do(method, path); resp.StatusCode != http.StatusMethodNotAllowed || resp.Header.Get("Allow") != "GET, HEAD" {
				t.Errorf("%s %s = %d (Allow %q), want 405", method, path, resp.StatusCode, resp.Header.Get("Allow"))
			}
		}
		for _, method := range []string{http.MethodGet, http.MethodHead} {
			code := do(method, path).StatusCode
			ok := code == http.StatusOK || (path == "/readyz" && code == http.StatusServiceUnavailable)
			if path == "/nope" {
				ok = code == http.StatusNotFound
			}
			if !ok {
				t.Errorf("%s %s = %d", method, path, code)
			}
		}
	}
}

// syncBuffer is a bytes.Buffer safe for the loggers of several agents.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) Bytes() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return bytes.Clone(s.b.Bytes())
}

package devstack

import (
	"errors"
	"fmt"
	"net/url"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"

	"github.com/kswitch/kswitch/internal/freeport"
)

const (
	// etcdReadyTimeout bounds how long a start waits for the member to
	// elect itself and serve. Generous: the machines running tests are
	// small and noisy.
	etcdReadyTimeout = 30 * time.Second

	// startAttempts is how often a first start tries fresh ports when the
	// ones it picked were taken before the server bound them.
	startAttempts = 5

	// restartBindTimeout bounds how long Restart keeps retrying when its
	// fixed ports are still (or again) in use.
	restartBindTimeout = 10 * time.Second
)

// ErrStopped is returned by operations that need a running service.
var ErrStopped = errors.New("devstack: stopped")

// Etcd is a single-member etcd server running in this process on loopback
// ports, with its data in a directory the caller owns.
//
// The client and peer ports are chosen once, by StartEtcd, and kept for the
// life of the value: Endpoints stays valid across Stop and Restart, so
// clients made before a Stop reconnect by themselves after a Restart (the
// etcd client retries its connection with backoff; requests made while
// stopped fail when their context ends).
//
// A client's reconnection follows its gRPC backoff, so how soon it notices a
// Restart depends on how long the server was down; see Client.
//
// All methods are safe for concurrent use; Stop and Restart are serialised.
type Etcd struct {
	dir        string
	logger     *zap.Logger // nil: defaultEtcdLogger
	clientPort int
	peerPort   int
	// secure, when set, serves TLS with client certificates (secure.go).
	secure *EtcdSecurity
	// compaction, when positive, is the periodic auto-compaction's
	// retention.
	compaction time.Duration

	mu  sync.Mutex
	run *etcdRun // nil while stopped
}

// etcdRun is one start of the server.
type etcdRun struct {
	srv *embed.Etcd
	// stopping is set just before Close, so the logger can drop the
	// errors etcd logs for its own listeners being closed.
	stopping *atomic.Bool
}

// StartEtcd starts a single-member etcd cluster with its data in dir
// (created if missing; an existing etcd data dir is reused with its data) on
// two free loopback ports, and blocks until the member serves requests or
// about 30 seconds pass.
//
// logger receives etcd's logs; nil means errors only, as JSON on stderr.
// Either way, the errors etcd logs for its own listeners closing during Stop
// are dropped. The caller must call Stop when done.
//
// Lease TTLs below 2 s are raised to 2 s by this server (default election
// timing); use longer TTLs in tests.
func StartEtcd(dir string, logger *zap.Logger) (*Etcd, error) {
	return startEtcd(dir, logger, nil, 0)
}

// StartEtcdCompacting is StartEtcd with etcd's periodic auto-compaction
// keeping retention of history (--auto-compaction-mode=periodic
// --auto-compaction-retention), as a production cluster of kswitch runs.
func StartEtcdCompacting(dir string, logger *zap.Logger, retention time.Duration) (*Etcd, error) {
	if retention <= 0 {
		return nil, fmt.Errorf("devstack: etcd auto-compaction retention %v must be positive", retention)
	}
	return startEtcd(dir, logger, nil, retention)
}

func startEtcd(dir string, logger *zap.Logger, secure *EtcdSecurity, compaction time.Duration) (*Etcd, error) {
	var lastErr error
	for range startAttempts {
		ports, err := freeport.Ports(2)
		if err != nil {
			return nil, err
		}
		e := &Etcd{dir: dir, logger: logger, clientPort: ports[0], peerPort: ports[1], secure: secure, compaction: compaction}
		run, err := e.start()
		if err == nil {
			e.run = run
			return e, nil
		}
		lastErr = err
		if !freeport.IsBindError(err) {
			break
		}
	}
	return nil, lastErr
}

// Endpoints returns the client endpoints ("127.0.0.1:PORT"), in the form
// clientv3.Config.Endpoints accepts. They do not change across Restart.
func (e *Etcd) Endpoints() []string {
	return []string{hostPort(e.clientPort)}
}

// Dir returns the data directory.
func (e *Etcd) Dir() string { return e.dir }

// Client returns a new client for this server. It does not block on the
// connection, so it also succeeds while the server is stopped. The caller
// must Close it.
//
// Unlike a client with default options, it retries its connection at least
// every second (gRPC's default backoff grows to 120 s: after a 10 s outage a
// default client took about 5 s to notice the restarted server). Code under
// test that makes its own clients gets the default; a test can hurry such a
// client with client.ActiveConnection().ResetConnectBackoff().
func (e *Etcd) Client() (*clientv3.Client, error) {
	lg := e.logger
	if lg == nil {
		lg = zap.NewNop()
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   e.Endpoints(),
		DialTimeout: 5 * time.Second,
		Logger:      lg,
		TLS:         e.clientTLS(),
		DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff: backoff.Config{
				BaseDelay:  100 * time.Millisecond,
				Multiplier: 1.6,
				Jitter:     0.2,
				MaxDelay:   time.Second,
			},
			MinConnectTimeout: 5 * time.Second,
		})},
	})
	if err != nil {
		return nil, fmt.Errorf("devstack: etcd client for %v: %w", e.Endpoints(), err)
	}
	return cli, nil
}

// Running reports whether the server is started (not stopped).
func (e *Etcd) Running() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.run != nil
}

// Stop shuts the server down and returns once it has stopped: listeners are
// closed, in-flight requests cancelled, and the server's goroutines have
// exited. Clients then fail their requests until Restart. Stop is
// idempotent and may be called on a stopped server.
func (e *Etcd) Stop() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.run == nil {
		return
	}
	e.run.stop()
	e.run = nil
}

// Restart starts a stopped server again on the same ports and the same data
// directory, so everything written before Stop is still there, and blocks
// until it serves (about 30 s at most). If a port is briefly still in use it
// retries for up to 10 s. Restarting a running server is an error.
func (e *Etcd) Restart() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.run != nil {
		return fmt.Errorf("devstack: etcd %s: restart: already running", e.Endpoints()[0])
	}
	deadline := time.Now().Add(restartBindTimeout)
	for {
		run, err := e.start()
		if err == nil {
			e.run = run
			return nil
		}
		if !freeport.IsBindError(err) || time.Now().After(deadline) {
			return err
		}
		time.Sleep(100 * time.Millisecond) // waiting for a port to be released; nothing to poll
	}
}

// start runs one embedded etcd on e's ports and waits until it is ready.
func (e *Etcd) start() (*etcdRun, error) {
	cfg := embed.NewConfig()
	cfg.Name = "testenv"
	cfg.Dir = e.dir
	curl := url.URL{Scheme: "http", Host: hostPort(e.clientPort)}
	purl := url.URL{Scheme: "http", Host: hostPort(e.peerPort)}
	cfg.ListenClientUrls = []url.URL{curl}
	cfg.AdvertiseClientUrls = []url.URL{curl}
	cfg.ListenPeerUrls = []url.URL{purl}
	cfg.AdvertisePeerUrls = []url.URL{purl}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.InitialClusterToken = "testenv"
	// Tests neither need the HTTP/JSON gateway nor survive power loss:
	// skipping fsync only risks data on a machine crash, not on Stop.
	cfg.EnableGRPCGateway = false
	cfg.UnsafeNoFsync = true
	if e.secure != nil {
		e.secure.apply(cfg)
	}
	if e.compaction > 0 {
		cfg.AutoCompactionMode = embed.CompactorModePeriodic
		cfg.AutoCompactionRetention = e.compaction.String()
	}
	lg := e.logger
	if lg == nil {
		var err error
		if lg, err = defaultEtcdLogger(); err != nil {
			return nil, fmt.Errorf("devstack: etcd %s: logger: %w", curl.Host, err)
		}
	}
	stopping := new(atomic.Bool)
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(lg.WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core {
		return shutdownNoiseFilter{Core: c, stopping: stopping}
	})))

	srv, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, fmt.Errorf("devstack: etcd %s: start: %w", curl.Host, err)
	}
	run := &etcdRun{srv: srv, stopping: stopping}
	timer := time.NewTimer(etcdReadyTimeout)
	defer timer.Stop()
	select {
	case <-srv.Server.ReadyNotify():
		return run, nil
	case err := <-srv.Err():
		run.stop()
		return nil, fmt.Errorf("devstack: etcd %s: start: %w", curl.Host, err)
	case <-srv.Server.StopNotify():
		run.stop()
		return nil, fmt.Errorf("devstack: etcd %s: start: server stopped before ready", curl.Host)
	case <-timer.C:
		run.stop()
		return nil, fmt.Errorf("devstack: etcd %s: start: not ready after %v", curl.Host, etcdReadyTimeout)
	}
}

// stop closes the server and waits for it. Close itself stops the server
// and waits for the serving goroutines (it closes Err() when they are done);
// StopNotify confirms the raft loop has finished.
func (r *etcdRun) stop() {
	r.stopping.Store(true)
	r.srv.Close()
	<-r.srv.Server.StopNotify()
	for range r.srv.Err() { // closed by Close; drain what was reported
	}
}

// defaultEtcdLogger is etcd's logger when the caller gives none: JSON on
// stderr, errors only.
func defaultEtcdLogger() (*zap.Logger, error) {
	cfg := zap.NewProductionConfig()
	cfg.Level = zap.NewAtomicLevelAt(zap.ErrorLevel)
	cfg.Sampling = nil
	return cfg.Build()
}

// etcdServeFailedMsg is what embed logs, at error level, when a serving
// goroutine returns, which every Close makes them do ("http: Server closed",
// "use of closed network connection"...).
const etcdServeFailedMsg = "setting up serving from embedded etcd failed."

// shutdownNoiseFilter drops etcdServeFailedMsg once a stop has begun, so a
// normal Stop does not print errors. Before that the message is a real error
// and passes.
type shutdownNoiseFilter struct {
	zapcore.Core
	stopping *atomic.Bool
}

func (f shutdownNoiseFilter) With(fields []zapcore.Field) zapcore.Core {
	return shutdownNoiseFilter{Core: f.Core.With(fields), stopping: f.stopping}
}

func (f shutdownNoiseFilter) Check(ent zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if ent.Message == etcdServeFailedMsg && f.stopping.Load() {
		return ce
	}
	if f.Enabled(ent.Level) {
		return ce.AddCore(ent, f)
	}
	return ce
}

// Package etcdclient opens every etcd client of kswitch (the agent's, the
// routing sink's, the operator commands') from the etcd section of the
// configuration: endpoints, timeouts, TLS and credentials, in one place.
package etcdclient

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/kswitch/kswitch/config"
)

// authenticateMethod is the gRPC method clientv3 calls to exchange a user
// and password for a token.
const authenticateMethod = "/etcdserverpb.Auth/Authenticate"

// New opens a client for the etcd section e. It does not wait for etcd,
// not even with a username and password: an agent started while etcd is
// down, or while etcd refuses its credentials, must run and report why it
// is not ready rather than fail to start (see deferAuth). The first request
// then fails with the reason: etcd unreachable, or "authentication failed".
//
// ctx becomes the client's context (clientv3.Config.Context); log receives
// the client's own logs at error level only (the callers report etcd
// trouble themselves, once).
func New(ctx context.Context, e config.Etcd, log *zap.Logger) (*clientv3.Client, error) {
	cfg, err := Config(e)
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = zap.NewNop()
	}
	cfg.Context = ctx
	cfg.Logger = log.Named("etcd").WithOptions(zap.IncreaseLevel(zap.ErrorLevel))
	var d *deferAuth
	if cfg.Username != "" {
		d = &deferAuth{}
		d.constructing.Store(true)
		cfg.DialOptions = append(cfg.DialOptions, grpc.WithChainUnaryInterceptor(d.intercept))
	}
	c, err := clientv3.New(cfg)
	if d != nil {
		d.constructing.Store(false)
	}
	if err != nil {
		return nil, fmt.Errorf("etcd: client for %v: %w", e.Endpoints, err)
	}
	return c, nil
}

// Config returns the clientv3 configuration of e: endpoints, dial timeout,
// TLS (when e.TLS is on or an endpoint is https://) and credentials (the
// password read from its file now). It has no Context, Logger or dial
// options; New sets them.
func Config(e config.Etcd) (clientv3.Config, error) {
	cfg := clientv3.Config{Endpoints: e.Endpoints, DialTimeout: e.DialTimeout}
	t := e.TLS
	if !t.On() && hasHTTPS(e.Endpoints) {
		t.Enabled = true
	}
	tc, err := t.ClientConfig("etcd.tls")
	if err != nil {
		return cfg, err
	}
	cfg.TLS = tc
	user, pass, err := e.Credentials()
	if err != nil {
		return cfg, err
	}
	if user != "" {
		cfg.Username, cfg.Password = user, pass.Reveal()
	}
	return cfg, nil
}

func hasHTTPS(endpoints []string) bool {
	for _, ep := range endpoints {
		if strings.HasPrefix(ep, "https://") {
			return true
		}
	}
	return false
}

// deferAuth moves a client's authentication from clientv3.New to its first
// request. clientv3.New authenticates before it returns and fails when it
// cannot, so a client could not even be made while etcd is down or refuses
// the password. deferAuth answers the Authenticate call New makes with
// "authentication is not enabled" (New then returns with no token), and
// answers every other request with "user name is empty" until an
// Authenticate has succeeded: on that error clientv3's retry interceptor
// authenticates (for real: deferAuth lets it through) and retries the
// request, or returns the authentication error. Streams (watches, lease
// keep-alives) authenticate by themselves when they open. A request is
// never sent to etcd without a token, so with client-certificate auth etcd
// does not fall back to the certificate's name for a wrong password.
//
// It is a unary interceptor chained after clientv3's own (retrying) one.
type deferAuth struct {
	constructing  atomic.Bool // set while clientv3.New runs
	authenticated atomic.Bool // an Authenticate succeeded
}

func (d *deferAuth) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if method == authenticateMethod {
		if d.constructing.Load() {
			return rpctypes.ErrGRPCAuthNotEnabled
		}
		err := invoker(ctx, method, req, reply, cc, opts...)
		if err == nil || errors.Is(rpctypes.Error(err), rpctypes.ErrAuthNotEnabled) {
			d.authenticated.Store(true)
		}
		return err
	}
	if !d.authenticated.Load() {
		return rpctypes.ErrGRPCUserEmpty
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}

// Explain turns an etcd error that is about access, not reachability, into
// one that says what is wrong and what to do: wrong credentials
// ("authentication failed") or a role without access ("permission denied")
// while doing what (e.g. "read /kswitch/orders/agents/a1"). It returns
// other errors (and nil) unchanged.
func Explain(err error, e config.Etcd, what string) error {
	if err == nil {
		return nil
	}
	who := "this client"
	if e.Username != "" {
		who = fmt.Sprintf("user %q", e.Username)
	} else if e.TLS.CertFile != "" {
		who = "the user named by the client certificate's common name"
	}
	switch {
	case is(err, rpctypes.ErrAuthFailed):
		return fmt.Errorf("etcd authentication failed for %s: wrong username or password; check etcd.username and etcd.password_file (%w)", who, err)
	case is(err, rpctypes.ErrPermissionDenied):
		return fmt.Errorf("etcd permission denied to %s (%s): its role needs readwrite on the fleet's prefix, see docs/SECURITY.md (%w)", who, what, err)
	case is(err, rpctypes.ErrUserEmpty), is(err, rpctypes.ErrUserNotFound):
		return fmt.Errorf("etcd has auth enabled and no user for %s (%s): set etcd.username and etcd.password_file (%w)", who, what, err)
	}
	return err
}

// AccessDenied reports whether err is etcd refusing the client's
// credentials or its access: retrying will not help until an operator
// acts.
func AccessDenied(err error) bool {
	return is(err, rpctypes.ErrAuthFailed) || is(err, rpctypes.ErrPermissionDenied) ||
		is(err, rpctypes.ErrUserEmpty) || is(err, rpctypes.ErrUserNotFound)
}

// is reports whether err, a clientv3 error or a gRPC status, possibly
// wrapped, is the etcd error target.
func is(err, target error) bool {
	return errors.Is(err, target) || errors.Is(rpctypes.Error(err), target)
}

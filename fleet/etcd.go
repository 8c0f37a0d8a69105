package fleet

import (
	"context"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/etcdclient"
)

// OpenEtcd opens an etcd client from c as the agent and the commands do:
// its endpoints, TLS (etcd.tls), user and password (etcd.username,
// etcd.password_file) and dial timeout. It makes no request: a refused
// credential is found by the first one, whose error etcdclient explains
// (what was refused, and which setting to check). log, when not nil,
// receives the client's errors. The caller closes the client.
func OpenEtcd(ctx context.Context, c config.Etcd, log *zap.Logger) (*clientv3.Client, error) {
	if log == nil {
		log = zap.NewNop()
	}
	return etcdclient.New(ctx, c, log)
}

package agent

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"time"

	"github.com/hashicorp/memberlist"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
)

// gossipKeySize is the size of the fleet key an agent creates: AES-256.
const gossipKeySize = 32

// newGossipKey returns gossipKeySize random bytes.
func newGossipKey() ([]byte, error) {
	k := make([]byte, gossipKeySize)
	if _, err := rand.Read(k); err != nil {
		return nil, fmt.Errorf("agent: make a gossip key: %w", err)
	}
	return k, nil
}

// fleetGossipKeys returns the fleet's gossip keys kept in etcd at key
// (keys.Fleet.GossipKey), the first being the one to send with. When
// there is none it creates one, with a transaction that writes only if
// the key has never been created, so agents starting at once agree on
// the first one written; created says whether it was this call's. A key
// that exists is read first with a plain Get, so a role granted only the
// reading of it (an operator who writes the key himself) suffices.
func fleetGossipKeys(ctx context.Context, cli *clientv3.Client, key string) (keys [][]byte, created bool, err error) {
	defer func() {
		if errors.Is(err, rpctypes.ErrPermissionDenied) {
			err = fmt.Errorf("%w: grant the fleet's etcd role readwrite on %s (docs/SECURITY.md, \"Gossip\")", err, key)
		}
	}()
	resp, err := cli.Get(ctx, key)
	if err != nil {
		return nil, false, fmt.Errorf("agent: read the fleet's gossip key %s: %w", key, err)
	}
	if len(resp.Kvs) > 0 {
		keys, err := parseFleetGossipKeys(key, resp.Kvs[0].Value)
		return keys, false, err
	}
	fresh, err := newGossipKey()
	if err != nil {
		return nil, false, err
	}
	txn, err := cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
		Then(clientv3.OpPut(key, base64.StdEncoding.EncodeToString(fresh)+"\n")).
		Else(clientv3.OpGet(key)).
		Commit()
	if err != nil {
		return nil, false, fmt.Errorf("agent: create the fleet's gossip key %s: %w", key, err)
	}
	if txn.Succeeded {
		return [][]byte{fresh}, true, nil
	}
	kvs := txn.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 0 {
		return nil, false, fmt.Errorf("agent: the fleet's gossip key %s was created and deleted while this agent read it: delete it only while every agent is stopped", key)
	}
	keys, err = parseFleetGossipKeys(key, kvs[0].Value)
	return keys, false, err
}

func parseFleetGossipKeys(key string, val []byte) ([][]byte, error) {
	keys, err := config.ParseGossipKeys(val, "etcd key "+key)
	if err != nil {
		return nil, fmt.Errorf("agent: the fleet's gossip key: %w; write it as agent.gossip_key_file is written, or delete it while every agent is stopped (the first to start creates another)", err)
	}
	return keys, nil
}

// gossipKeyLoop reads (or creates) the fleet's gossip keys in etcd until
// it has them or ctx ends, then puts them in the keyring in place of
// placeholder, the key nobody else has that the agent's gossip started
// with (so that it heard and said nothing until then), and closes
// a.gossipKeyed. Until then a failure is readiness's reason.
func (a *Agent) gossipKeyLoop(ctx context.Context, kr *memberlist.Keyring, placeholder []byte) {
	key := a.keys.GossipKey()
	backoff := 100 * time.Millisecond
	for {
		rctx, cancel := context.WithTimeout(ctx, a.cfg.Etcd.RequestTimeout)
		keys, created, err := fleetGossipKeys(rctx, a.client, key)
		cancel()
		if err == nil {
			err = installGossipKeys(kr, keys, placeholder)
		}
		if err == nil {
			none := ""
			a.gossipKeyErr.Store(&none)
			close(a.gossipKeyed)
			a.log.Info("gossip encrypted with the fleet's key from etcd", zap.String("key", key), zap.Bool("created", created), zap.Int("keys", len(keys)))
			return
		}
		if ctx.Err() != nil {
			return
		}
		why := "gossip: " + err.Error()
		if prev := a.gossipKeyErr.Load(); prev == nil || *prev != why {
			a.log.Warn("cannot read the fleet's gossip key: not joining gossip until it can", zap.String("key", key), zap.Error(err))
		}
		a.gossipKeyErr.Store(&why)
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
}

// installGossipKeys makes keys[0] the key gossip sends with, every key one
// it accepts, and drops placeholder.
func installGossipKeys(kr *memberlist.Keyring, keys [][]byte, placeholder []byte) error {
	for _, k := range keys {
		if err := kr.AddKey(k); err != nil {
			return fmt.Errorf("agent: gossip keyring: %w", err)
		}
	}
	if err := kr.UseKey(keys[0]); err != nil {
		return fmt.Errorf("agent: gossip keyring: %w", err)
	}
	if err := kr.RemoveKey(placeholder); err != nil {
		return fmt.Errorf("agent: gossip keyring: %w", err)
	}
	return nil
}

package agent

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/hashicorp/memberlist"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/etcdwatch"
	"github.com/kswitch/kswitch/internal/refused"
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
// it has them or ctx ends, then puts them in the keyring in place of the
// placeholder, the key nobody else has that the agent's gossip started
// with (so that it heard and said nothing until then), closes
// a.gossipKeyed, and follows the key until ctx ends: a rotation written
// there is applied at once (docs/SECURITY.md, "Gossip"). Until the keys
// are in, a failure is readiness's reason.
func (a *Agent) gossipKeyLoop(ctx context.Context, kr *memberlist.Keyring) {
	key := a.keys.GossipKey()
	backoff := 100 * time.Millisecond
	for {
		rctx, cancel := context.WithTimeout(ctx, a.cfg.Etcd.RequestTimeout)
		keys, created, err := fleetGossipKeys(rctx, a.client, key)
		cancel()
		if err == nil {
			err = useGossipKeys(kr, keys)
		}
		if err == nil {
			none := ""
			a.gossipKeyErr.Store(&none)
			close(a.gossipKeyed)
			a.log.Info("gossip encrypted with the fleet's key from etcd", zap.String("key", key), zap.Bool("created", created),
				zap.Strings("keys", keyIDs(keys)))
			break
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
	f := &gossipKeyFollower{a: a, kr: kr, key: key}
	_ = etcdwatch.Follow(ctx, a.client, etcdwatch.Target{Key: key, Timeout: a.cfg.Etcd.RequestTimeout, OnError: func(err error) {
		a.log.Debug("following the fleet's gossip key: watch broken, reading it again", zap.Error(err))
	}}, f)
}

// gossipKeyFollower applies the changes of the fleet's gossip key to the
// keyring (etcdwatch.Follower: called from one goroutine).
type gossipKeyFollower struct {
	a   *Agent
	kr  *memberlist.Keyring
	key string
}

func (f *gossipKeyFollower) Reset(kvs []*mvccpb.KeyValue, _ int64) {
	if len(kvs) == 0 {
		f.apply(nil)
		return
	}
	f.apply(kvs[0].Value)
}

func (f *gossipKeyFollower) Apply(events []*clientv3.Event) {
	ev := events[len(events)-1]
	if ev.Type == clientv3.EventTypeDelete {
		f.apply(nil)
		return
	}
	f.apply(ev.Kv.Value)
}

// apply makes val's keys the keyring's, unless val is absent (nil) or
// not keys: then the keys in use stay (logged; a malformed value is
// counted as refused).
func (f *gossipKeyFollower) apply(val []byte) {
	log := f.a.log.With(zap.String("key", f.key))
	if val == nil {
		log.Warn("the fleet's gossip key was deleted from etcd: gossip keeps its keys until the next agent to start creates another, which every agent then takes")
		return
	}
	keys, err := parseFleetGossipKeys(f.key, val)
	if err != nil {
		log.Error("the fleet's gossip key in etcd is refused: gossip keeps its keys", zap.Error(err))
		f.a.metrics.badValues.WithLabelValues(refused.GossipKey).Inc()
		return
	}
	if slices.EqualFunc(keys, f.kr.GetKeys(), bytes.Equal) {
		return
	}
	if err := useGossipKeys(f.kr, keys); err != nil {
		log.Error("cannot use the fleet's new gossip keys", zap.Error(err))
		return
	}
	log.Info("gossip keys changed in etcd: in use", zap.Strings("keys", keyIDs(keys)))
}

// useGossipKeys makes keys[0] the key gossip sends with, every key one it
// accepts, and drops every other key (the placeholder gossip started
// with, a key rotated out).
func useGossipKeys(kr *memberlist.Keyring, keys [][]byte) error {
	for _, k := range keys {
		if err := kr.AddKey(k); err != nil {
			return fmt.Errorf("agent: gossip keyring: %w", err)
		}
	}
	if err := kr.UseKey(keys[0]); err != nil {
		return fmt.Errorf("agent: gossip keyring: %w", err)
	}
	for _, k := range slices.Clone(kr.GetKeys()) {
		if !slices.ContainsFunc(keys, func(want []byte) bool { return bytes.Equal(want, k) }) {
			if err := kr.RemoveKey(k); err != nil {
				return fmt.Errorf("agent: gossip keyring: %w", err)
			}
		}
	}
	return nil
}

// keyIDs names keys in logs without showing them: the first 4 bytes of
// each one's SHA-256, in hex.
func keyIDs(keys [][]byte) []string {
	out := make([]string, len(keys))
	for i, k := range keys {
		sum := sha256.Sum256(k)
		out[i] = hex.EncodeToString(sum[:4])
	}
	return out
}

// startingGossipKeys returns the keys gossip starts with: the key file's;
// none with agent.gossip_encryption off; else (fromEtcd) a placeholder
// alone, a key nobody else has, until gossipKeyLoop puts the fleet's key
// from etcd in its place. It makes a.gossipKeyed, closed unless the
// fleet's key is still to be read.
func (a *Agent) startingGossipKeys() (keys [][]byte, fromEtcd bool, err error) {
	a.gossipKeyed = make(chan struct{})
	switch keys, err = a.cfg.Agent.GossipKeys(); {
	case err != nil:
		return nil, false, err
	case keys != nil:
	case a.cfg.Agent.GossipEncryption == "off":
		a.log.Warn("gossip is not encrypted (agent.gossip_encryption: off): whoever reaches the gossip port can forge views and deaths")
	default:
		placeholder, err := newGossipKey()
		if err != nil {
			return nil, false, err
		}
		return [][]byte{placeholder}, true, nil
	}
	close(a.gossipKeyed)
	return keys, false, nil
}

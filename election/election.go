// Package election elects one leader among the agents of a fleet.
//
// It is a thin layer over go.etcd.io/etcd/client/v3/concurrency that adds
// what kswitch needs on top of a plain campaign:
//
//   - leadership is a context: leader work runs under a ctx that is cancelled
//     the moment the etcd session ends (lease expired, revoked, or etcd
//     unreachable past the TTL) or the caller stops, and Campaign waits for
//     that work to return before it resigns;
//   - a fencing token (the creation revision of the leader key) and fenced
//     writes: a Term's Txn only commits while its leader key still exists
//     with that revision, so a deposed leader cannot write, whatever it
//     believes locally;
//   - an Observer that reports who leads to every agent, leader or not.
package election

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"
)

// ErrNotLeader is returned by a fenced write whose term has ended: the
// leader key it was elected with is gone or was re-created.
var ErrNotLeader = errors.New("election: not the leader (term ended)")

// ErrConditionFailed is returned by a fenced write whose term is still valid
// but whose own extra comparisons did not hold.
var ErrConditionFailed = errors.New("election: transaction condition failed")

// Config configures a Candidate.
type Config struct {
	// Prefix is the election prefix, e.g. keys.Fleet.Election(). Required;
	// must end in "/".
	Prefix string
	// ID is the value written into the leader key: the agent id. Required.
	ID string
	// ResignTimeout bounds the resign request after leadership ends. The
	// lease revocation that follows a clean stop would end the term anyway;
	// resigning just lets a successor take over without waiting.
	// Default 2s.
	ResignTimeout time.Duration
	// Logger receives state changes. Default: no logging.
	Logger *zap.Logger
}

// Validate checks the config and fills defaults.
func (c *Config) Validate() error {
	if c.Prefix == "" || c.Prefix[len(c.Prefix)-1] != '/' {
		return fmt.Errorf("election: prefix %q must be non-empty and end in '/'", c.Prefix)
	}
	if c.ID == "" {
		return errors.New("election: candidate id is required")
	}
	if c.ResignTimeout <= 0 {
		c.ResignTimeout = 2 * time.Second
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return nil
}

// Candidate campaigns for leadership on behalf of one agent. Its methods
// other than Campaign may be called concurrently from any goroutine;
// Campaign must not be called concurrently with itself.
type Candidate struct {
	cfg     Config
	leading atomic.Bool
	terms   atomic.Int64
}

// NewCandidate returns a candidate. The config is copied.
func NewCandidate(cfg Config) (*Candidate, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Candidate{cfg: cfg}, nil
}

// Leading reports whether this candidate is inside a term right now, i.e.
// its leader work is running. It turns false before the resign request is
// sent, and at once when the session ends.
func (c *Candidate) Leading() bool { return c.leading.Load() }

// Terms returns how many terms this candidate has won.
func (c *Candidate) Terms() int64 { return c.terms.Load() }

// Campaign blocks until this candidate leads or ctx or the session ends.
// Once elected it calls lead with a context that is cancelled when ctx is
// cancelled or the session ends, waits for lead to return, then resigns
// (if the session still lives) and returns nil. It returns ctx.Err() when
// ctx ended before election, and ErrSessionDone when the session ended.
//
// lead must return promptly once its context is cancelled: until it
// returns, no successor can be elected on a clean stop.
func (c *Candidate) Campaign(ctx context.Context, s *concurrency.Session, lead func(context.Context, Term)) error {
	log := c.cfg.Logger
	// Campaign and leader work both end when either the caller's ctx or
	// the session ends.
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(s.Ctx(), cancel)
	defer stop()

	e := concurrency.NewElection(s, c.cfg.Prefix)
	if err := e.Campaign(wctx, c.cfg.ID); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if s.Ctx().Err() != nil {
			return ErrSessionDone
		}
		return fmt.Errorf("election: campaign for %s: %w", c.cfg.Prefix, err)
	}
	term := Term{ID: c.cfg.ID, Key: e.Key(), Rev: e.Rev(), Lease: s.Lease(), client: s.Client()}
	n := c.terms.Add(1)
	log.Info("elected leader", zap.String("leader_key", term.Key), zap.Int64("fencing_token", term.Rev), zap.Int64("term", n))

	c.leading.Store(true)
	lead(wctx, term)
	c.leading.Store(false)

	if s.Ctx().Err() != nil {
		log.Warn("leadership lost: etcd session ended", zap.Int64("fencing_token", term.Rev))
		return ErrSessionDone
	}
	// The term ends by our choice: resign so a successor need not wait for
	// the lease to expire. The caller's ctx may be cancelled already, so
	// the resign gets a context of its own.
	rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.ResignTimeout)
	defer rcancel()
	if err := e.Resign(rctx); err != nil {
		log.Warn("resign failed; the lease TTL will end the term", zap.Error(err))
		return nil
	}
	log.Info("resigned leadership", zap.Int64("fencing_token", term.Rev))
	return nil
}

// ErrSessionDone is returned by Campaign when the etcd session ended: the
// lease expired or was revoked, or etcd was unreachable past the TTL.
var ErrSessionDone = errors.New("election: etcd session ended")

// Term is one period of leadership. It is a value; it stays safe to use
// after the term ended because every write it makes is fenced.
type Term struct {
	// ID is the leader's agent id.
	ID string
	// Key is the leader key in etcd.
	Key string
	// Rev is the fencing token: the creation revision of Key. It grows with
	// every new term in the fleet.
	Rev int64
	// Lease is the session lease the leader key is attached to.
	Lease clientv3.LeaseID

	client *clientv3.Client
}

// Txn commits ops only while this term is current and every cmp holds.
// It returns ErrNotLeader when the term has ended, ErrConditionFailed when
// only the caller's comparisons failed, and the etcd error otherwise.
func (t Term) Txn(ctx context.Context, cmps []clientv3.Cmp, ops ...clientv3.Op) (*clientv3.TxnResponse, error) {
	if t.client == nil {
		return nil, ErrNotLeader
	}
	fence := clientv3.Compare(clientv3.CreateRevision(t.Key), "=", t.Rev)
	all := append([]clientv3.Cmp{fence}, cmps...)
	resp, err := t.client.Txn(ctx).If(all...).Then(ops...).Else(clientv3.OpGet(t.Key)).Commit()
	if err != nil {
		return nil, fmt.Errorf("election: fenced write (token %d): %w", t.Rev, err)
	}
	if resp.Succeeded {
		return resp, nil
	}
	kvs := resp.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 0 || kvs[0].CreateRevision != t.Rev {
		return resp, fmt.Errorf("%w: fencing token %d is no longer current", ErrNotLeader, t.Rev)
	}
	return resp, ErrConditionFailed
}

// Put is a fenced put of one key.
func (t Term) Put(ctx context.Context, key, val string, opts ...clientv3.OpOption) error {
	_, err := t.Txn(ctx, nil, clientv3.OpPut(key, val, opts...))
	return err
}

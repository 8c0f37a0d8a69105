package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/config"
	"github.com/kswitch/kswitch/internal/etcdwatch"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/keys"
)

// Membership is what the leader needs to know of the fleet's agents.
type Membership interface {
	// Live returns the ids of the agents that are registered and ready.
	Live() []string
	// Subscribe returns a channel that receives a value after Live
	// changed (coalesced), until ctx ends.
	Subscribe(ctx context.Context) <-chan struct{}
	// Dead receives the ids of agents that gossip declared dead.
	Dead() <-chan string
	// GossipAlive reports whether gossip considers the agent alive now.
	GossipAlive(id string) bool
}

// Leader is the leader's work for one term: it discovers the source
// partitions, plans the assignment over the live agents and publishes
// each generation with a fenced write. It owns no state across terms:
// a new leader reads state/assignment and the acknowledgements from etcd.
type Leader struct {
	cfg     config.Config
	keys    keys.Fleet
	etcd    *clientv3.Client
	members Membership
	log     *zap.Logger
	// OnPublish, when set, is called after each generation is written.
	OnPublish func(Assignment)

	regex *regexp.Regexp
	// bg owns the goroutines that talk to Kafka. They may outlive a term
	// by the length of one Kafka call (bounded by the client's timeouts),
	// so that a dead cluster never delays the end of a term; the caller
	// waits for bg when it shuts down.
	bg *sync.WaitGroup
}

// NewLeader returns the leader work of a fleet. cfg must be validated. bg
// must outlive every Run: the caller waits for it after the last term.
func NewLeader(cfg config.Config, c *clientv3.Client, m Membership, bg *sync.WaitGroup, log *zap.Logger) (*Leader, error) {
	l := &Leader{cfg: cfg, keys: keys.New(cfg.Fleet), etcd: c, members: m, bg: bg, log: log}
	if cfg.Source.TopicRegex != "" {
		re, err := regexp.Compile(cfg.Source.TopicRegex)
		if err != nil {
			return nil, fmt.Errorf("coordinator: source.topic_regex: %w", err)
		}
		l.regex = re
	}
	return l, nil
}

// acks follows acks/: agent id → generation it has applied.
type acks struct {
	keys    keys.Fleet
	log     *zap.Logger
	mu      sync.Mutex
	gens    map[string]int64
	changed chan struct{}
}

func (a *acks) Reset(kvs []*mvccpb.KeyValue, _ int64) {
	m := map[string]int64{}
	for _, kv := range kvs {
		a.put(m, kv)
	}
	a.mu.Lock()
	a.gens = m
	a.mu.Unlock()
	a.notify()
}

func (a *acks) Apply(evs []*clientv3.Event) {
	a.mu.Lock()
	for _, ev := range evs {
		if ev.Type == clientv3.EventTypeDelete {
			delete(a.gens, strings.TrimPrefix(string(ev.Kv.Key), a.keys.Acks()))
			continue
		}
		a.put(a.gens, ev.Kv)
	}
	a.mu.Unlock()
	a.notify()
}

func (a *acks) put(m map[string]int64, kv *mvccpb.KeyValue) {
	id := strings.TrimPrefix(string(kv.Key), a.keys.Acks())
	g, err := strconv.ParseInt(strings.TrimSpace(string(kv.Value)), 10, 64)
	if err != nil || g < 0 {
		a.log.Warn("ignoring malformed acknowledgement", zap.String("key", string(kv.Key)), zap.ByteString("value", kv.Value))
		return
	}
	m[id] = g
}

func (a *acks) notify() {
	select {
	case a.changed <- struct{}{}:
	default:
	}
}

func (a *acks) snapshot() map[string]int64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make(map[string]int64, len(a.gens))
	for k, v := range a.gens {
		out[k] = v
	}
	return out
}

// Run does the leader's work until ctx ends (leadership ended). Every
// write goes through term, so a deposed leader's plan never lands.
func (l *Leader) Run(ctx context.Context, term election.Term) error {
	log := l.log.With(zap.Int64("fencing_token", term.Rev))
	ak := &acks{keys: l.keys, log: log, gens: map[string]int64{}, changed: make(chan struct{}, 1)}
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = etcdwatch.Follow(ctx, l.etcd, l.keys.Acks(), true, l.cfg.Etcd.RequestTimeout, ak, nil)
	}()
	memberCh := l.members.Subscribe(ctx)

	// Discovery talks to Kafka in a goroutine of its own: a dead or hung
	// cluster delays the partition list, never the leader's loop or the
	// end of its term.
	cluster, _ := l.cfg.Primary()
	found := make(chan []TopicPartition, 1)
	l.bg.Add(1)
	go func() {
		defer l.bg.Done()
		l.discoverLoop(ctx, cluster, log, found)
	}()

	current, rev, err := l.readAssignment(ctx, ak)
	for err != nil {
		log.Warn("cannot read state/assignment; retrying", zap.Error(err))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
		current, rev, err = l.readAssignment(ctx, ak)
	}

	var partitions []TopicPartition // nil until the first discovery succeeds
	for {
		if partitions != nil {
			next, changed := Plan(PlanInput{
				Current: current, Partitions: partitions, Cluster: cluster,
				Live: l.members.Live(), Acks: ak.snapshot(),
			})
			if changed {
				next.Leader, next.Token, next.Published = term.ID, term.Rev, time.Now().UTC()
				newRev, err := l.publish(ctx, term, next, rev)
				switch {
				case errors.Is(err, election.ErrNotLeader):
					log.Warn("leadership lost while publishing", zap.Error(err))
					return err
				case errors.Is(err, election.ErrConditionFailed):
					log.Warn("state/assignment changed under the leader; re-reading it")
					if c, r, err := l.readAssignment(ctx, ak); err == nil {
						current, rev = c, r
					}
					continue
				case err != nil:
					log.Warn("cannot publish assignment; retrying", zap.Error(err))
				default:
					current, rev = next, newRev
					log.Info("published assignment", zap.Int64("generation", next.Generation),
						zap.Int("agents", len(next.Owned)), zap.Int("revoking", len(next.Revoking)))
					if l.OnPublish != nil {
						l.OnPublish(next)
					}
				}
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-memberCh:
		case <-ak.changed:
		case id := <-l.members.Dead():
			l.evict(ctx, term, id, log)
		case ps := <-found:
			if !slices.Equal(ps, partitions) {
				log.Info("source partitions", zap.String("cluster", cluster), zap.Int("partitions", len(ps)))
			}
			partitions = ps
		}
	}
}

// evict frees the partitions of an agent that gossip declared dead without
// waiting for its session lease to expire: the leader deletes its
// registration (fenced: only while this term lasts and the registration is
// still on the lease it had) and revokes that lease. An agent that is in
// fact alive sees its lease gone, stops consuming at once, and registers
// again.
func (l *Leader) evict(ctx context.Context, term election.Term, id string, log *zap.Logger) {
	if id == term.ID || l.members.GossipAlive(id) {
		return // a stale notice: the agent is back in gossip
	}
	key := l.keys.Agent(id)
	rctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := l.etcd.Get(rctx, key)
	if err != nil || len(resp.Kvs) == 0 || resp.Kvs[0].Lease == 0 {
		return // gone already (its lease expired) or unreadable: the TTL frees it
	}
	lease := clientv3.LeaseID(resp.Kvs[0].Lease)
	_, err = term.Txn(rctx, []clientv3.Cmp{clientv3.Compare(clientv3.LeaseValue(key), "=", lease)}, clientv3.OpDelete(key))
	if err != nil {
		log.Debug("not evicting agent", zap.String("dead_agent", id), zap.Error(err))
		return
	}
	if _, err := l.etcd.Revoke(rctx, lease); err != nil {
		log.Warn("deleted the registration of an agent gossip declared dead, but could not revoke its lease; its commits are refused anyway",
			zap.String("dead_agent", id), zap.Error(err))
		return
	}
	log.Info("gossip declared an agent dead; revoked its lease so its partitions move now",
		zap.String("dead_agent", id), zap.String("lease", fmt.Sprintf("%x", int64(lease))))
}

// discoverLoop lists the source partitions now and every refresh interval,
// and hands each successful result to found (keeping only the latest).
func (l *Leader) discoverLoop(ctx context.Context, cluster string, log *zap.Logger, found chan []TopicPartition) {
	d := &discovery{leader: l, cluster: cluster, log: log}
	defer d.close()
	t := time.NewTicker(l.cfg.Source.RefreshInterval)
	defer t.Stop()
	for {
		ps, err := d.partitions(ctx)
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			log.Warn("topic discovery failed; keeping the last known partitions", zap.String("cluster", cluster), zap.Error(err))
		default:
			select {
			case <-found: // drop a result the loop has not taken yet
			default:
			}
			found <- ps
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// readAssignment reads state/assignment and its revision. A value that
// does not parse is replaced by the next publication; its generation is
// taken past every acknowledged one so agents never see a generation go
// backwards.
func (l *Leader) readAssignment(ctx context.Context, ak *acks) (Assignment, int64, error) {
	rctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := l.etcd.Get(rctx, l.keys.Assignment())
	if err != nil {
		return Assignment{}, 0, err
	}
	if len(resp.Kvs) == 0 {
		return Assignment{}, 0, nil
	}
	kv := resp.Kvs[0]
	a, err := ParseAssignment(kv.Value)
	if err != nil {
		l.log.Warn("state/assignment is malformed; the next generation replaces it", zap.Error(err))
		var maxGen int64
		for _, g := range ak.snapshot() {
			maxGen = max(maxGen, g)
		}
		return Assignment{Generation: maxGen}, kv.ModRevision, nil
	}
	return a, kv.ModRevision, nil
}

// publish writes a, fenced by the term and by the revision of the value it
// replaces, and returns the new revision.
func (l *Leader) publish(ctx context.Context, term election.Term, a Assignment, rev int64) (int64, error) {
	val, err := json.Marshal(a)
	if err != nil {
		return 0, err
	}
	pctx, cancel := context.WithTimeout(ctx, l.cfg.Etcd.RequestTimeout)
	defer cancel()
	resp, err := term.Txn(pctx, []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(l.keys.Assignment()), "=", rev)},
		clientv3.OpPut(l.keys.Assignment(), string(val)))
	if err != nil {
		return 0, err
	}
	return resp.Header.Revision, nil
}

// discovery lists the source partitions of one cluster.
type discovery struct {
	leader  *Leader
	cluster string
	log     *zap.Logger
	client  sarama.Client
	missing map[string]bool // configured topics reported missing, to warn once
}

func (d *discovery) close() {
	if d.client != nil {
		_ = d.client.Close()
	}
}

// partitions returns the partitions of the configured topics and of the
// topics matching the regex, sorted. The Kafka calls are bounded by the
// client's timeouts (internal/kafka).
func (d *discovery) partitions(ctx context.Context) ([]TopicPartition, error) {
	if d.client == nil {
		c, err := kafka.NewClient(d.cluster, d.leader.cfg.Clusters[d.cluster])
		if err != nil {
			return nil, err
		}
		d.client = c
		d.missing = map[string]bool{}
	}
	if err := d.client.RefreshMetadata(); err != nil {
		return nil, fmt.Errorf("coordinator: metadata of cluster %s: %w", d.cluster, err)
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	all, err := d.client.Topics()
	if err != nil {
		return nil, fmt.Errorf("coordinator: topics of cluster %s: %w", d.cluster, err)
	}
	want := map[string]bool{}
	for _, t := range d.leader.cfg.Source.Topics {
		want[t] = false
	}
	var out []TopicPartition
	for _, t := range all {
		_, listed := want[t]
		internal := strings.HasPrefix(t, "__")
		if !listed && (d.leader.regex == nil || internal || !d.leader.regex.MatchString(t)) {
			continue
		}
		want[t] = true
		ps, err := d.client.Partitions(t)
		if err != nil {
			return nil, fmt.Errorf("coordinator: partitions of %s on cluster %s: %w", t, d.cluster, err)
		}
		for _, p := range ps {
			out = append(out, TopicPartition{Topic: t, Partition: p})
		}
	}
	for t, found := range want {
		if !found && !d.missing[t] {
			d.log.Warn("configured source topic does not exist on the cluster", zap.String("topic", t), zap.String("cluster", d.cluster))
		}
		d.missing[t] = !found
	}
	slices.SortFunc(out, TopicPartition.Compare)
	return out, nil
}

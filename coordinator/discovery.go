package coordinator

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/state"
)

// discoverLoop lists the source partitions now, every refresh interval
// and when the source changes, and hands each result that differs from
// the last to found (keeping only the latest), telling listed. It records
// the lifecycle events of the topics it lists (lifecycle.go) under
// history/topics/, fenced by the term.
func (r *leaderRun) discoverLoop(ctx context.Context, cluster string, log *zap.Logger, found chan []state.TopicPartition, listed chan<- struct{}) {
	d := &discovery{leader: r.Leader, cluster: cluster, log: log, term: r.t.Term}
	defer d.close()
	t := time.NewTicker(r.cfg.Source.RefreshInterval)
	defer t.Stop()
	rediscover := r.rediscover.Subscribe(ctx)
	var last []state.TopicPartition
	for {
		ps, err := d.partitions(ctx, r.conf())
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			log.Warn("topic discovery failed; keeping the last known partitions", zap.String("cluster", cluster), zap.Error(err))
		case last != nil && slices.Equal(ps, last):
			// Unchanged: the loop turns on its own every probe interval.
		default:
			last = ps
			select {
			case <-found: // drop a result the loop has not taken yet
			default:
			}
			found <- ps
			select {
			case listed <- struct{}{}:
			default:
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-rediscover:
		}
	}
}

// discovery lists the source partitions of one cluster.
type discovery struct {
	leader  *Leader
	cluster string
	log     *zap.Logger
	client  sarama.Client
	def     config.Cluster  // the definition client was opened with
	missing map[string]bool // configured topics reported missing, to warn once
	// term fences the lifecycle events written to history/; topics are
	// the listed topics as last seen, to tell their changes (lifecycle).
	term   election.Term
	topics map[string]TopicMeta
}

func (d *discovery) close() {
	if d.client != nil {
		_ = d.client.Close()
	}
}

// partitions returns the partitions of the configured topics and of the
// topics matching the regex, sorted. The Kafka calls are bounded by the
// client's timeouts (internal/kafka).
func (d *discovery) partitions(ctx context.Context, conf *dynamic) ([]state.TopicPartition, error) {
	def := conf.clusters[d.cluster]
	if d.client != nil && !reflect.DeepEqual(def, d.def) {
		d.log.Info("cluster definition changed; discovery reconnects", zap.String("cluster", d.cluster))
		d.close()
		d.client = nil
	}
	if d.client == nil {
		c, err := kafka.NewClientWith(d.cluster, def, kafka.Options{Dialer: d.leader.dialer(d.cluster)})
		if err != nil {
			return nil, err
		}
		d.client, d.def = c, def
		d.missing = map[string]bool{}
	}
	// One Metadata request for every topic, with their ids: the same
	// request a probe sends (agent/probe.go) twice a second per agent.
	all, err := DescribeTopics(d.client, nil)
	if err != nil {
		return nil, fmt.Errorf("coordinator: topics of cluster %s: %w", d.cluster, err)
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	// Topics are chosen by their logical name, so every physical copy of
	// a logical topic is found by the same topics and regex: orders and
	// B.orders on the primary, A.orders and orders on a standby filled
	// with the prefix policy.
	want := map[string]bool{}
	for _, t := range conf.source.Topics {
		want[t] = false
	}
	var out []state.TopicPartition
	listed := map[string]TopicMeta{}
	for t, meta := range all {
		if !conf.naming.Copy(d.cluster, t) {
			continue // a second copy of a stream, by a longer path
		}
		logical := conf.naming.Logical(d.cluster, t)
		_, named := want[logical]
		internal := strings.HasPrefix(logical, "__")
		if !named && (conf.regex == nil || internal || !conf.regex.MatchString(logical)) {
			continue
		}
		want[logical] = true
		listed[t] = meta
		for _, p := range meta.Partitions {
			out = append(out, state.TopicPartition{Topic: t, Partition: p})
		}
	}
	d.lifecycle(ctx, listed)
	for t := range d.missing {
		if _, still := want[t]; !still {
			delete(d.missing, t) // no longer configured
		}
	}
	for t, found := range want {
		if !found && !d.missing[t] {
			d.log.Warn("configured source topic does not exist on the cluster", zap.String("topic", t), zap.String("cluster", d.cluster))
		}
		d.missing[t] = !found
	}
	slices.SortFunc(out, state.TopicPartition.Compare)
	return out, nil
}

// lifecycle compares the topics just listed with those listed before:
// a topic whose id changed was deleted and created again, and one whose
// partition count changed grew (or, re-created, shrank). Each change is
// logged, counted and recorded under history/topics/. A topic missing
// from one listing (being deleted) keeps its last metadata, so that its
// re-creation is seen however short the gap; the first listing of a term
// records nothing (it has nothing to compare with: the agents' positions,
// which carry the topic id, tell a re-creation missed meanwhile).
func (d *discovery) lifecycle(ctx context.Context, listed map[string]TopicMeta) {
	first := d.topics == nil
	if first {
		d.topics = map[string]TopicMeta{}
	}
	for t, now := range listed {
		before, seen := d.topics[t]
		d.topics[t] = now
		if first || !seen {
			continue
		}
		ev := state.TopicEvent{At: time.Now(), Cluster: d.cluster, Topic: t, OldID: before.ID, NewID: now.ID,
			OldPartitions: len(before.Partitions), NewPartitions: len(now.Partitions), Leader: d.leader.cfg.Agent.ID}
		switch {
		case !record.SameTopic(before.ID, now.ID):
			ev.Kind = state.TopicRecreated
			d.log.Warn("source topic was deleted and created again: its partitions are consumed from their start",
				zap.String("cluster", d.cluster), zap.String("topic", t), zap.String("old_id", before.ID), zap.String("new_id", now.ID),
				zap.Int("old_partitions", ev.OldPartitions), zap.Int("new_partitions", ev.NewPartitions))
			if m := d.leader.metrics; m != nil {
				m.recreated.WithLabelValues(d.cluster, t).Inc()
			}
		case len(now.Partitions) != len(before.Partitions):
			change := "added"
			ev.Kind = state.TopicPartitionsAdded
			if len(now.Partitions) < len(before.Partitions) {
				ev.Kind, change = state.TopicPartitionsRemoved, "removed"
			}
			d.log.Info("source topic's partitions changed", zap.String("cluster", d.cluster), zap.String("topic", t),
				zap.Int("old_partitions", ev.OldPartitions), zap.Int("new_partitions", ev.NewPartitions))
			if m := d.leader.metrics; m != nil {
				m.partitionsChanged.WithLabelValues(d.cluster, t, change).Inc()
			}
		default:
			continue
		}
		wctx, cancel := context.WithTimeout(ctx, d.leader.cfg.Etcd.RequestTimeout)
		err := writeTopicEvent(wctx, d.term, d.leader.keys, ev)
		cancel()
		if err != nil && ctx.Err() == nil {
			d.log.Warn("cannot record the topic's change in history/topics/", zap.String("topic", t), zap.String("kind", ev.Kind), zap.Error(err))
		}
	}
}

// discoveryRun is the discovery of one cluster's partitions.
type discoveryRun struct {
	found chan []state.TopicPartition
	stop  context.CancelFunc
}

// discoverInUse follows the partitions of every cluster the fleet uses
// now (inUse) and of no other: a cluster no longer in use loses its list.
// Discovery talks to Kafka in a goroutine of its own (on bg): a dead or
// hung cluster delays the partition list, never the loop or the end of
// the term.
func (r *leaderRun) discoverInUse(ctx context.Context) {
	use := inUse(r.t.active)
	for c, d := range r.disc {
		if !slices.Contains(use, c) {
			d.stop()
			delete(r.disc, c)
			delete(r.lists, c)
		}
	}
	for _, c := range use {
		if r.disc[c] != nil {
			continue
		}
		dctx, dcancel := context.WithCancel(ctx)
		d := &discoveryRun{found: make(chan []state.TopicPartition, 1), stop: dcancel}
		r.disc[c] = d
		r.bg.Add(1)
		go func() {
			defer r.bg.Done()
			r.discoverLoop(dctx, c, r.log, d.found, r.listed)
		}()
	}
}

// stopDiscoveries ends every discovery of the term.
func (r *leaderRun) stopDiscoveries() {
	for _, d := range r.disc {
		d.stop()
	}
}

// takeLists takes the lists the discoveries have found since the last
// call.
func (r *leaderRun) takeLists() {
	for c, d := range r.disc {
		select {
		case ps := <-d.found:
			if !slices.Equal(ps, r.lists[c]) {
				r.log.Info("source partitions", zap.String("cluster", c), zap.Int("partitions", len(ps)))
			}
			r.lists[c] = ps
		default:
		}
	}
}

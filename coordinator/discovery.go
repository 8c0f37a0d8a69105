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
	"github.com/kswitch/kswitch/internal/kafka"
)

// discoverLoop lists the source partitions now, every refresh interval
// and when the source changes, and hands each successful result to found
// (keeping only the latest), telling listed.
func (l *Leader) discoverLoop(ctx context.Context, cluster string, log *zap.Logger, found chan []TopicPartition, listed chan<- struct{}) {
	d := &discovery{leader: l, cluster: cluster, log: log}
	defer d.close()
	t := time.NewTicker(l.cfg.Source.RefreshInterval)
	defer t.Stop()
	rediscover := l.rediscover.Subscribe(ctx)
	for {
		ps, err := d.partitions(ctx, l.conf())
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
}

func (d *discovery) close() {
	if d.client != nil {
		_ = d.client.Close()
	}
}

// partitions returns the partitions of the configured topics and of the
// topics matching the regex, sorted. The Kafka calls are bounded by the
// client's timeouts (internal/kafka).
func (d *discovery) partitions(ctx context.Context, conf *dynamic) ([]TopicPartition, error) {
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
	// Topics are chosen by their logical name, so every physical copy of
	// a logical topic is found by the same topics and regex: orders and
	// B.orders on the primary, A.orders and orders on a standby filled
	// with the prefix policy.
	want := map[string]bool{}
	for _, t := range conf.source.Topics {
		want[t] = false
	}
	var out []TopicPartition
	for _, t := range all {
		logical := conf.naming.Logical(d.cluster, t)
		_, listed := want[logical]
		internal := strings.HasPrefix(logical, "__")
		if !listed && (conf.regex == nil || internal || !conf.regex.MatchString(logical)) {
			continue
		}
		want[logical] = true
		ps, err := d.client.Partitions(t)
		if err != nil {
			return nil, fmt.Errorf("coordinator: partitions of %s on cluster %s: %w", t, d.cluster, err)
		}
		for _, p := range ps {
			out = append(out, TopicPartition{Topic: t, Partition: p})
		}
	}
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
	slices.SortFunc(out, TopicPartition.Compare)
	return out, nil
}

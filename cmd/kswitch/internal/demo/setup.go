package demo

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/devstack/mirror"
	"github.com/kswitch/kswitch/fleet"
)

// setUp starts what the outage story runs on: etcd, Kafka A and B with
// topic orders, C with the channel's topic, mirrors both ways, the fleet
// and the producer.
func (d *demo) setUp(ctx context.Context) error {
	if err := d.startEtcd(); err != nil {
		return err
	}
	var err error
	if d.a, err = startKafka(d.dir, "A", topic); err != nil {
		return err
	}
	if d.b, err = startKafka(d.dir, "B", topic); err != nil {
		return err
	}
	if d.c, err = startKafka(d.dir, "C", outTopic); err != nil {
		return err
	}
	d.say("etcd %s; Kafka A %s and B %s (topic %s on each, %d partitions), C %s (topic %s)",
		d.etcd.Endpoints()[0], d.a.Brokers()[0], d.b.Brokers()[0], topic, partitions, d.c.Brokers()[0], outTopic)
	if d.ab, err = d.startMirror(ctx, d.a, d.b, 100); err != nil {
		return err
	}
	if d.ba, err = d.startMirror(ctx, d.b, d.a, 50); err != nil {
		return err
	}
	d.say("mirrors both ways, like MirrorMaker 2 for a data-centre outage: A's %s is A.%s on B (offsets 100 ahead), B's %s is B.%s on A (50 ahead); the fleet consumes both copies on the active cluster",
		topic, topic, topic, topic)
	return d.startFleet(ctx)
}

// startEtcd makes the demo's directory and starts etcd and a client.
func (d *demo) startEtcd() error {
	var err error
	if d.dir, err = os.MkdirTemp("", "kswitch-demo-"); err != nil {
		return fmt.Errorf("demo: temp dir: %w", err)
	}
	if d.etcd, err = devstack.StartEtcd(d.dir+"/etcd", d.o.Logger.Named("etcd")); err != nil {
		return fmt.Errorf("demo: start embedded etcd: %w", err)
	}
	d.cli, err = d.etcd.Client()
	return err
}

// startKafka starts cluster name in dir with topic (partitions), or none
// when topic is empty.
func startKafka(dir, name, topic string) (*devstack.Kafka, error) {
	o := devstack.KafkaOptions{DataDir: dir + "/" + name}
	if topic != "" {
		o.Topics = map[string]int32{topic: partitions}
	}
	k, err := devstack.StartKafka(name, o)
	if err != nil {
		return nil, fmt.Errorf("demo: start Kafka %s: %w", name, err)
	}
	return k, nil
}

// startMirror copies src's topic to dst as <src>.<topic>, like MirrorMaker
// 2, with dst's offsets prefill ahead and the offset-syncs on dst.
func (d *demo) startMirror(ctx context.Context, src, dst *devstack.Kafka, prefill int) (*mirror.Mirror, error) {
	from := src.Name()
	m, err := mirror.Start(ctx, mirror.Config{
		Source: src.Brokers(), Target: dst.Brokers(), SourceName: from, TargetName: dst.Name(),
		Topics: []string{topic}, RemoteTopic: func(t string) string { return from + "." + t },
		TargetPrefill: prefill, OffsetSyncsTopic: "mm2-offset-syncs." + from + ".internal", OffsetSyncsOnTarget: true,
		Logger: d.o.Logger.Named("mirror-" + from + "-" + dst.Name()),
	})
	if err != nil {
		return nil, fmt.Errorf("demo: start the mirror %s → %s: %w", from, dst.Name(), err)
	}
	return m, nil
}

// startFleet starts the reader of C, the members and the producer to A.
func (d *demo) startFleet(ctx context.Context) error {
	var err error
	if d.c2, err = startReader(d.c.Brokers(), outTopic, partitions); err != nil {
		return err
	}
	r := d.config("").Routing
	d.say("routing: rule %q (%s) → channel %s = C/%s, keyed by %s, so that C shows where each record was consumed",
		r.Rules[0].Name, r.Rules[0].Match, channel, outTopic, r.Channels[channel].Key)
	for i := range d.o.Agents {
		if err := d.startMember(ctx, fmt.Sprintf("agent-%d", i+1)); err != nil {
			return err
		}
	}
	d.prod = startProducer("A", d.a.Brokers(), d.o.Rate, 0)
	d.say("producer: %d records/s to A, numbered from 0", d.o.Rate)
	return nil
}

// config is the configuration of agent id.
func (d *demo) config(id string) config.Config {
	cfg := config.Default()
	cfg.Fleet = fleetName
	cfg.Agent.ID = id
	cfg.Agent.HTTP = "127.0.0.1:0"
	cfg.Agent.Gossip = "127.0.0.1:0"
	cfg.Etcd.Endpoints = d.etcd.Endpoints()
	cfg.Etcd.SessionTTL = 2 * time.Second
	cfg.Etcd.RequestTimeout = time.Second
	cfg.Clusters = map[string]config.Cluster{
		// Both flows keep their offset-syncs on their target, readable
		// while the source is down.
		"A": {Brokers: d.a.Brokers(), Role: config.RolePrimary, OffsetSyncsOn: "target"},
		"B": {Brokers: d.b.Brokers(), Role: config.RoleStandby, OffsetSyncsOn: "target"},
		"C": {Brokers: d.c.Brokers(), Role: config.RoleSink},
	}
	if d.far != nil {
		d.chainClusters(&cfg)
	}
	if d.o.ExactlyOnce {
		c := cfg.Clusters["C"]
		c.Delivery = config.ExactlyOnce
		cfg.Clusters["C"] = c
	}
	cfg.Source.Topics = []string{topic}
	cfg.Source.Group = fleetName
	cfg.Source.CommitInterval = 200 * time.Millisecond
	cfg.Failover.ProbeInterval = 250 * time.Millisecond
	cfg.Failover.ProbeTimeout = 500 * time.Millisecond
	cfg.Failover.FailureWindow = 1500 * time.Millisecond
	cfg.Failover.FailbackStable = 3 * time.Second
	cfg.Routing = config.Routing{
		Rules: []config.RoutingRule{{Name: "orders", Match: `topic == "orders"`, Channels: []string{channel}}},
		Channels: map[string]config.RoutingChannel{
			channel: {Cluster: "C", Topic: outTopic, Key: `key + "@" + cluster`},
		},
	}
	return cfg
}

func (d *demo) startMember(ctx context.Context, id string) error {
	m, err := fleet.NewMember(d.config(id), agent.Options{Logger: d.o.Logger.Named(id)})
	if err != nil {
		return err
	}
	f := &fleetMember{m: m}
	if err := m.Start(ctx); err != nil {
		return err
	}
	d.fleet = append(d.fleet, f)
	d.say("%s up: http://%s/status (also /leader /readyz /metrics)", id, f.agent().HTTPAddr())
	return nil
}

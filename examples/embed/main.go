// Command embed runs a kswitch fleet member inside a program of its own: an
// agent whose records go through kswitch's routing sink, wired as
// `kswitch agent` wires them (fleet.Member). It is a module of its own, so
// it can only use kswitch's public API: config, agent and fleet, and
// devstack for an etcd and a Kafka cluster in process.
//
//	go run . -records 200
//
// It writes the records to topic orders of cluster A, starts one member of
// fleet "embed" whose routing rule sends every record to channel out
// (topic orders-out on A), and exits 0 once every record is on orders-out,
// or 1 after -timeout. Against a real fleet, fill config.Config from your
// own settings (or config.Load a kswitch.yaml) and leave devstack out. To
// handle records with code of your own instead of the routing sink, build
// the agent alone: agent.New(cfg, agent.Options{Handler: yours}).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/fleet"
)

func main() {
	records := flag.Int("records", 200, "records to write and then consume through the agent")
	timeout := flag.Duration("timeout", time.Minute, "give up after this long")
	flag.Parse()
	if *records < 1 {
		fmt.Fprintf(os.Stderr, "embed: -records %d: write at least one record\n", *records)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	if err := run(ctx, *records); err != nil {
		fmt.Fprintln(os.Stderr, "embed:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, n int) error {
	dir, err := os.MkdirTemp("", "kswitch-embed-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	etcd, err := devstack.StartEtcd(filepath.Join(dir, "etcd"), nil)
	if err != nil {
		return err
	}
	defer etcd.Stop()
	kafka, err := devstack.StartKafka("A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 4, "orders-out": 4}})
	if err != nil {
		return err
	}
	defer kafka.Stop()
	if err := produce(kafka.Brokers(), n); err != nil {
		return err
	}
	began := time.Now()

	// The wiring: a configuration with a routing section, and a member.
	cfg := config.Default()
	cfg.Fleet = "embed"
	cfg.Agent.ID = "embed-1"
	cfg.Agent.HTTP = "127.0.0.1:0"
	cfg.Agent.Gossip = "127.0.0.1:0"
	cfg.Etcd.Endpoints = etcd.Endpoints()
	cfg.Clusters = map[string]config.Cluster{"A": {Brokers: kafka.Brokers(), Role: config.RolePrimary}}
	cfg.Source.Topics = []string{"orders"}
	cfg.Source.Group = "embed"
	cfg.Routing = config.Routing{
		Rules:    []config.RoutingRule{{Name: "all", Channels: []string{"out"}}},
		Channels: map[string]config.RoutingChannel{"out": {Cluster: "A", Topic: "orders-out"}},
	}
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("configuration: %w", err)
	}
	m, err := fleet.NewMember(cfg, agent.Options{})
	if err != nil {
		return err
	}
	if err := m.Start(ctx); err != nil {
		return err
	}
	got, waitErr := awaitAll(ctx, kafka.Brokers(), n)
	sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer scancel()
	stopErr := m.Stop(sctx)
	if waitErr != nil {
		return fmt.Errorf("%d of %d records on orders-out: %w", got, n, errors.Join(waitErr, stopErr))
	}
	fmt.Printf("embed: member %s routed all %d records of orders to orders-out in %v\n", m.Agent().ID(), n, time.Since(began).Round(time.Millisecond))
	return stopErr
}

// awaitAll reads orders-out until it holds records 0 to n-1 (each counted
// once), and returns how many it saw.
func awaitAll(ctx context.Context, brokers []string, n int) (int, error) {
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	c, err := sarama.NewConsumer(brokers, sc)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	// One goroutine per partition hands its values over until awaitAll
	// returns: then the partition consumers close, done is closed, and
	// awaitAll waits for the goroutines to end.
	values, done := make(chan string), make(chan struct{})
	var wg sync.WaitGroup
	defer wg.Wait()
	defer close(done)
	for p := range int32(4) {
		pc, err := c.ConsumePartition("orders-out", p, sarama.OffsetOldest)
		if err != nil {
			return 0, err
		}
		defer pc.Close()
		wg.Go(func() {
			for msg := range pc.Messages() {
				select {
				case values <- string(msg.Value):
				case <-done:
					return
				}
			}
		})
	}
	seen := map[string]bool{}
	for len(seen) < n {
		select {
		case v := <-values:
			if i, err := strconv.Atoi(v); err == nil && i >= 0 && i < n {
				seen[v] = true
			}
		case <-ctx.Done():
			return len(seen), ctx.Err()
		}
	}
	return len(seen), nil
}

// produce writes n records to orders.
func produce(brokers []string, n int) error {
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	sc.Producer.Return.Successes = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	p, err := sarama.NewSyncProducer(brokers, sc)
	if err != nil {
		return err
	}
	defer p.Close()
	for i := range n {
		v := sarama.StringEncoder(strconv.Itoa(i))
		if _, _, err := p.SendMessage(&sarama.ProducerMessage{Topic: "orders", Key: v, Value: v}); err != nil {
			return fmt.Errorf("record %d: %w", i, err)
		}
	}
	return nil
}

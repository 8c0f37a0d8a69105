// Command embed runs a kswitch agent inside a program of its own, with its
// own record handler instead of kswitch's routing sink. It is a module of
// its own, so it can only use kswitch's public API: the packages config,
// agent and record, and devstack for an etcd and a Kafka cluster in
// process.
//
//	go run . -records 200
//
// It writes the records to topic orders of cluster A, starts one agent of
// fleet "embed" whose handler counts them, and exits 0 once every record
// was handled and acknowledged, or 1 after -timeout. Against a real fleet,
// fill config.Config from your own settings (or config.Load a kswitch.yaml)
// and leave devstack out.
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
	"github.com/kswitch/kswitch/record"
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

// counter is the program's own handler: it counts each record once by
// partition and offset, and acknowledges it, which lets the agent commit
// past it.
type counter struct {
	want int
	done chan struct{}

	mu   sync.Mutex
	seen map[string]bool
}

func (c *counter) Handle(_ context.Context, r *record.Record) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seen[fmt.Sprintf("%s/%d@%d", r.Topic, r.Partition, r.Offset)] = true
	if len(c.seen) == c.want {
		close(c.done)
	}
	r.Ack()
	return nil
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
	kafka, err := devstack.StartKafka("A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 4}})
	if err != nil {
		return err
	}
	defer kafka.Stop()
	if err := produce(kafka.Brokers(), n); err != nil {
		return err
	}

	cfg := config.Default()
	cfg.Fleet = "embed"
	cfg.Agent.ID = "embed-1"
	cfg.Agent.HTTP = "127.0.0.1:0"
	cfg.Agent.Gossip = "127.0.0.1:0"
	cfg.Etcd.Endpoints = etcd.Endpoints()
	cfg.Clusters = map[string]config.Cluster{"A": {Brokers: kafka.Brokers(), Role: config.RolePrimary}}
	cfg.Source.Topics = []string{"orders"}
	cfg.Source.Group = "embed"
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("configuration: %w", err)
	}
	h := &counter{want: n, done: make(chan struct{}), seen: map[string]bool{}}
	a, err := agent.New(cfg, agent.Options{Handler: h})
	if err != nil {
		return err
	}
	if err := a.Start(ctx); err != nil {
		return err
	}
	began := time.Now()
	select {
	case <-h.done:
	case <-ctx.Done():
	}
	sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer scancel()
	stopErr := a.Stop(sctx)
	select {
	case <-h.done:
	default:
		h.mu.Lock()
		defer h.mu.Unlock()
		return fmt.Errorf("handled %d of %d records: %w", len(h.seen), n, errors.Join(ctx.Err(), stopErr))
	}
	fmt.Printf("embed: agent %s handled all %d records of orders on A in %v\n", a.ID(), n, time.Since(began).Round(time.Millisecond))
	return stopErr
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

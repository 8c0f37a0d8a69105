// Command relayloop is the baseline of kswitch's relay benchmarks (make
// bench, integration/bench_test.go): the least a Go program needs to relay
// one Kafka topic to another with sarama, at-least-once. A consumer group
// reads the source from its oldest records; every record goes to an
// asynchronous producer, into the same partition of the destination topic,
// with the key, value, timestamp and headers it had; a record's offset is
// marked (and committed every -commit-interval) once the destination
// acknowledged it.
//
// The producer has exactly kswitch's settings for a channel with the
// default acks and compression (routing.ProducerConfig: idempotent, acks
// all, one request in flight per broker) and the consumer kswitch's client
// settings (internal/kafka.Config), so that a benchmark compares kswitch's
// own work (etcd coordination, routing, commits) and not two
// configurations. It runs until SIGTERM or SIGINT, or exits 1 on the first
// produce error. With -client franz-go it is the strongest Go baseline
// instead: franz-go tuned for throughput (franz.go).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/routing"
)

func main() {
	var (
		from     = flag.String("from", "", "source brokers host:port,… (required)")
		topic    = flag.String("topic", "", "source topic (required)")
		group    = flag.String("group", "", "consumer group (required)")
		to       = flag.String("to", "", "destination brokers host:port,… (required)")
		dest     = flag.String("dest", "", "destination topic, with at least the source's partitions (required)")
		version  = flag.String("version", config.DefaultKafkaVersion, "Kafka protocol version of both clusters")
		interval = flag.Duration("commit-interval", 500*time.Millisecond, "how often marked offsets are committed (kswitch's source.commit_interval)")
		client   = flag.String("client", "sarama", "sarama (kswitch's producer settings) or franz-go (tuned for throughput, see franz.go)")
	)
	flag.Parse()
	if *from == "" || *topic == "" || *group == "" || *to == "" || *dest == "" {
		fmt.Fprintln(os.Stderr, "relayloop: -from, -topic, -group, -to and -dest are required")
		flag.Usage()
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	src := config.Cluster{Brokers: strings.Split(*from, ","), Version: *version, ClientID: "relayloop"}
	dst := config.Cluster{Brokers: strings.Split(*to, ","), Version: *version, ClientID: "relayloop"}
	relay := run
	switch *client {
	case "sarama":
	case "franz-go":
		relay = runFranz
	default:
		fmt.Fprintf(os.Stderr, "relayloop: -client %q is not sarama or franz-go\n", *client)
		os.Exit(2)
	}
	if err := relay(ctx, src, dst, *topic, *group, *dest, *interval); err != nil {
		fmt.Fprintln(os.Stderr, "relayloop:", err)
		os.Exit(1)
	}
}

// pending is a record handed to the producer: marked in its session once
// the destination has it.
type pending struct {
	sess sarama.ConsumerGroupSession
	msg  *sarama.ConsumerMessage
}

func run(ctx context.Context, src, dst config.Cluster, topic, group, dest string, interval time.Duration) error {
	pc, err := routing.ProducerConfig(dst, "", "")
	if err != nil {
		return err
	}
	// The router picks the partition itself (manual-same-partition).
	pc.Producer.Partitioner = sarama.NewManualPartitioner
	producer, err := sarama.NewAsyncProducer(dst.Brokers, pc)
	if err != nil {
		return fmt.Errorf("producer to %v: %w", dst.Brokers, err)
	}
	cc, err := kafka.Config(src)
	if err != nil {
		return err
	}
	cc.Consumer.Offsets.Initial = sarama.OffsetOldest
	cc.Consumer.Offsets.AutoCommit.Enable = true
	cc.Consumer.Offsets.AutoCommit.Interval = interval
	cg, err := sarama.NewConsumerGroup(src.Brokers, group, cc)
	if err != nil {
		producer.Close()
		return fmt.Errorf("consumer group %s on %v: %w", group, src.Brokers, err)
	}

	ctx, cancel := context.WithCancelCause(ctx)
	acked := make(chan struct{})
	go func() { // the producer's results: mark what was acknowledged
		defer close(acked)
		succ, errs := producer.Successes(), producer.Errors()
		for succ != nil || errs != nil {
			select {
			case m, ok := <-succ:
				if !ok {
					succ = nil
					continue
				}
				p := m.Metadata.(pending)
				p.sess.MarkMessage(p.msg, "")
			case e, ok := <-errs:
				if !ok {
					errs = nil
					continue
				}
				cancel(fmt.Errorf("produce to %s/%d: %w", dest, e.Msg.Partition, e.Err))
			}
		}
	}()
	h := handler{producer: producer, dest: dest}
	for ctx.Err() == nil {
		if err := cg.Consume(ctx, []string{topic}, h); err != nil && !errors.Is(err, sarama.ErrClosedConsumerGroup) {
			cancel(fmt.Errorf("consume %s: %w", topic, err))
		}
	}
	// Deliver what is in flight, then commit what it acknowledged.
	producer.AsyncClose()
	<-acked
	if err := cg.Close(); err != nil {
		return fmt.Errorf("close consumer group %s: %w", group, err)
	}
	if err := context.Cause(ctx); !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

// handler relays each claimed partition's records in offset order.
type handler struct {
	producer sarama.AsyncProducer
	dest     string
}

func (handler) Setup(sarama.ConsumerGroupSession) error   { return nil }
func (handler) Cleanup(sarama.ConsumerGroupSession) error { return nil }

func (h handler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	for {
		select {
		case <-sess.Context().Done():
			return nil
		case msg, ok := <-claim.Messages():
			if !ok {
				return nil
			}
			m := &sarama.ProducerMessage{Topic: h.dest, Partition: msg.Partition, Timestamp: msg.Timestamp,
				Metadata: pending{sess: sess, msg: msg}}
			if msg.Key != nil {
				m.Key = sarama.ByteEncoder(msg.Key)
			}
			if msg.Value != nil {
				m.Value = sarama.ByteEncoder(msg.Value)
			}
			for _, hd := range msg.Headers {
				m.Headers = append(m.Headers, sarama.RecordHeader{Key: hd.Key, Value: hd.Value})
			}
			select {
			case h.producer.Input() <- m:
			case <-sess.Context().Done():
				return nil
			}
		}
	}
}

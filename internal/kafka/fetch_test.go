package kafka_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testenv"
)

// closeBound bounds how long a Close of something blocked on a hung broker
// may take. What it waits for is local: the socket is closed under sarama,
// whose reader fails at once, and goroutines return. sarama's read timeout
// (5 s) is what a Close that waited on the network would take; 1 s is far
// below it and far above a scheduling delay on 2 loaded cores under -race.
const closeBound = time.Second

func clusterConf(k *devstack.Kafka) config.Cluster {
	return config.Cluster{Brokers: k.Brokers(), Version: config.DefaultKafkaVersion}
}

// TestConnFloor: a dedicated connection negotiates Fetch as min(our
// ceiling, the broker's maximum) and refuses a version below the floor,
// saying what to change.
func TestConnFloor(t *testing.T) {
	k := testenv.StartKafkaT(t, "F", devstack.KafkaOptions{Topics: map[string]int32{"t": 1}})
	conf, err := kafka.Config(clusterConf(k))
	if err != nil {
		t.Fatal(err)
	}
	c, err := kafka.DialConn(t.Context(), conf, k.Brokers()[0])
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ceiling := kafka.FetchVersion(conf.Version)
	if v, err := c.Negotiate(kafka.APIKeyFetch, ceiling, 4); err != nil || v != ceiling {
		t.Errorf("Negotiate(Fetch, %d, 4) = %d, %v; want %d (kfake serves up to 18)", ceiling, v, err, ceiling)
	}
	if _, err := c.Negotiate(kafka.APIKeyFetch, kafka.FetchVersion(sarama.V0_10_2_0), 4); err == nil || !strings.Contains(err.Error(), "raise the cluster's version") {
		t.Errorf("Negotiate(Fetch) for Kafka 0.10.2: %v, want a refusal naming the version setting", err)
	}
	if _, err := c.Negotiate(kafka.APIKey(1000), 1, 0); err == nil || !strings.Contains(err.Error(), "does not serve") {
		t.Errorf("Negotiate(an unknown key): %v, want does not serve", err)
	}
}

// TestConnCloseDoesNotWait: a Fetch that the broker never answers ends as
// soon as the Conn is closed, not after sarama's read timeout; so does a
// Conn whose context ends.
func TestConnCloseDoesNotWait(t *testing.T) {
	k := testenv.StartKafkaT(t, "F", devstack.KafkaOptions{Topics: map[string]int32{"t": 1}})
	arrived := make(chan struct{}, 4)
	k.Cluster().ControlKey(int16(kmsg.Fetch), func(kmsg.Request) (kmsg.Response, error, bool) {
		k.Cluster().KeepControl()
		arrived <- struct{}{}
		return nil, nil, true // never answered
	})
	conf, err := kafka.Config(clusterConf(k))
	if err != nil {
		t.Fatal(err)
	}
	for _, how := range []string{"Close", "ctx"} {
		ctx, cancel := context.WithCancel(t.Context())
		c, err := kafka.DialConn(ctx, conf, k.Brokers()[0])
		if err != nil {
			t.Fatal(err)
		}
		req := &sarama.FetchRequest{Version: 4, MaxWaitTime: 100, MinBytes: 1, MaxBytes: 1 << 20}
		req.AddBlock("t", 0, 0, 1<<20, -1)
		done := make(chan error, 1)
		go func() {
			_, err := c.Broker().Fetch(req)
			done <- err
		}()
		<-arrived
		start := time.Now()
		if how == "Close" {
			c.Close()
		} else {
			cancel()
		}
		err = <-done
		if took := time.Since(start); err == nil || took > closeBound {
			t.Errorf("%s: the hung Fetch returned %v after %v, want an error within %v", how, err, took, closeBound)
		}
		c.Close()
		c.Close() // twice: fine
		cancel()
	}
}

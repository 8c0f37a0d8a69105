// Package kafka builds the sarama clients of kswitch from its cluster
// configuration, with timeouts on everything: a dead cluster's calls must
// fail in seconds, never block a control loop.
package kafka

import (
	"fmt"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/internal/config"
)

// Config returns the sarama configuration for cluster c.
func Config(c config.Cluster) (*sarama.Config, error) {
	sc := sarama.NewConfig()
	v, err := sarama.ParseKafkaVersion(c.Version)
	if err != nil {
		return nil, fmt.Errorf("kafka: version %q: %w", c.Version, err)
	}
	sc.Version = v
	if c.ClientID != "" {
		sc.ClientID = c.ClientID
	}
	sc.Net.DialTimeout = 3 * time.Second
	sc.Net.ReadTimeout = 5 * time.Second
	sc.Net.WriteTimeout = 5 * time.Second
	sc.Metadata.Retry.Max = 2
	sc.Metadata.Retry.Backoff = 200 * time.Millisecond
	sc.Metadata.Timeout = 5 * time.Second
	// kswitch decides which topics to read; never create one by asking.
	sc.Metadata.AllowAutoTopicCreation = false
	sc.Consumer.Return.Errors = true
	sc.Consumer.MaxWaitTime = 250 * time.Millisecond
	sc.Consumer.Offsets.AutoCommit.Enable = false
	return sc, nil
}

// NewClient connects to cluster name. It fails when no broker answers
// within the dial and metadata timeouts.
func NewClient(name string, c config.Cluster) (sarama.Client, error) {
	sc, err := Config(c)
	if err != nil {
		return nil, err
	}
	cl, err := sarama.NewClient(c.Brokers, sc)
	if err != nil {
		return nil, fmt.Errorf("kafka: connect to cluster %s %v: %w", name, c.Brokers, err)
	}
	return cl, nil
}

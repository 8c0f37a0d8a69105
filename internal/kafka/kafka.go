// Package kafka builds the sarama clients of kswitch from its cluster
// configuration, with timeouts on everything: a dead cluster's calls must
// fail in seconds, never block a control loop.
package kafka

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/IBM/sarama"
	"golang.org/x/net/proxy"

	"github.com/kswitch/kswitch/config"
)

// Config returns the sarama configuration for cluster c, with its TLS and
// SASL settings (security.go).
func Config(c config.Cluster) (*sarama.Config, error) {
	sc, _, err := configTraced(c)
	return sc, err
}

// configTraced is Config, with the trace of the client's SASL exchanges.
func configTraced(c config.Cluster) (*sarama.Config, *saslTrace, error) {
	sc := sarama.NewConfig()
	v, err := sarama.ParseKafkaVersion(c.Version)
	if err != nil {
		return nil, nil, fmt.Errorf("kafka: version %q: %w", c.Version, err)
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
	trace, err := applySecurity(sc, c)
	if err != nil {
		return nil, nil, err
	}
	if err := applyProxy(sc, c); err != nil {
		return nil, nil, err
	}
	return sc, trace, nil
}

// applyProxy sends every connection of sc through cluster c's SOCKS5
// proxy, if it has one. sarama dials each broker through Net.Proxy.Dialer,
// the bootstrap brokers and the addresses they advertise alike, and puts
// TLS on top of the connection it returns. An Options.Dialer replaces it.
func applyProxy(sc *sarama.Config, c config.Cluster) error {
	if c.Proxy == "" {
		return nil
	}
	addr, user, pass, err := c.Proxy.SOCKS5()
	if err != nil {
		return fmt.Errorf("proxy: %w", err)
	}
	var auth *proxy.Auth
	if user != "" {
		auth = &proxy.Auth{User: user, Password: pass.Reveal()}
	}
	d, err := proxy.SOCKS5("tcp", addr, auth, &net.Dialer{KeepAlive: sc.Net.KeepAlive})
	if err != nil {
		return fmt.Errorf("proxy %s: %w", c.Proxy, err)
	}
	cd, ok := d.(proxy.ContextDialer)
	if !ok {
		return fmt.Errorf("proxy %s: x/net's SOCKS5 dialer takes no context", c.Proxy)
	}
	sc.Net.Proxy.Enable = true
	sc.Net.Proxy.Dialer = socksDialer{sc: sc, d: cd}
	return nil
}

// socksDialer bounds a dial through a SOCKS5 proxy by sc.Net.DialTimeout
// as it is when the dial starts (NewClientWith's Options.Timeout changes
// it after Config): the connection to the proxy and the handshake, which
// waits for the proxy's own connection to the broker. sarama applies no
// timeout to a dialer it is given, and x/net's SOCKS5 dialer none to its
// handshake without a context deadline: a proxy that cannot reach a
// broker would hold the dial for good.
type socksDialer struct {
	sc *sarama.Config
	d  proxy.ContextDialer
}

func (s socksDialer) Dial(network, addr string) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), s.sc.Net.DialTimeout)
	defer cancel()
	return s.d.DialContext(ctx, network, addr)
}

// Dialer opens connections to brokers. Tests inject one to cut the link
// between one agent and one cluster; it replaces the cluster's proxy.
type Dialer interface {
	Dial(network, addr string) (net.Conn, error)
}

// Options adjust a client for one use.
type Options struct {
	// Dialer, when set, opens the broker connections.
	Dialer Dialer
	// Timeout, when set, bounds dialing, each read and each write, and
	// turns off metadata retries: for probes, which must answer within
	// their own interval.
	Timeout time.Duration
}

// NewClient connects to cluster name. It fails when no broker answers
// within the dial and metadata timeouts.
func NewClient(name string, c config.Cluster) (sarama.Client, error) {
	return NewClientWith(name, c, Options{})
}

// NewClientWith is NewClient with options.
func NewClientWith(name string, c config.Cluster, o Options) (sarama.Client, error) {
	sc, trace, err := configTraced(c)
	if err != nil {
		return nil, fmt.Errorf("kafka: cluster %s: %w", name, err)
	}
	if o.Dialer != nil {
		sc.Net.Proxy.Enable = true
		sc.Net.Proxy.Dialer = o.Dialer
	}
	if o.Timeout > 0 {
		sc.Net.DialTimeout, sc.Net.ReadTimeout, sc.Net.WriteTimeout = o.Timeout, o.Timeout, o.Timeout
		sc.Metadata.Retry.Max = 0
		sc.Metadata.Timeout = o.Timeout
	}
	// Every socket through a dialer of the client's own, so that Close
	// can close them under sarama (client).
	socks := &sockets{}
	next := dialerOf(sc)
	sc.Net.Proxy.Enable = true
	sc.Net.Proxy.Dialer = socketDialer{next: next, socks: socks}
	cl, err := sarama.NewClient(c.Brokers, sc)
	if err != nil {
		if why := explain(err, trace, name, c); why != "" {
			return nil, fmt.Errorf("kafka: %s: %w", why, err)
		}
		return nil, fmt.Errorf("kafka: connect to cluster %s %v: %w", name, c.Brokers, err)
	}
	return &client{Client: cl, socks: socks}, nil
}

// TopicPartition names one partition for EndOffsets.
type TopicPartition struct {
	Topic     string
	Partition int32
}

// EndOffsets returns the end offset (high-water mark) of each of tps,
// asking each partition's leader once for all of its partitions: one
// request per broker, whatever the number of partitions. A partition whose
// leader is unknown or that the broker reports an error for is left out;
// the error joins what went wrong.
func EndOffsets(client sarama.Client, tps []TopicPartition) (map[TopicPartition]int64, error) {
	reqs := map[*sarama.Broker]*sarama.OffsetRequest{}
	var errs []error
	for _, tp := range tps {
		leader, err := client.Leader(tp.Topic, tp.Partition)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s/%d: %w", tp.Topic, tp.Partition, err))
			continue
		}
		if reqs[leader] == nil {
			reqs[leader] = &sarama.OffsetRequest{Version: 1}
		}
		reqs[leader].AddBlock(tp.Topic, tp.Partition, sarama.OffsetNewest, 1)
	}
	out := make(map[TopicPartition]int64, len(tps))
	for leader, req := range reqs {
		resp, err := leader.GetAvailableOffsets(req)
		if err != nil {
			errs = append(errs, fmt.Errorf("broker %d: %w", leader.ID(), err))
			continue
		}
		for topic, parts := range resp.Blocks {
			for p, b := range parts {
				if !errors.Is(b.Err, sarama.ErrNoError) {
					errs = append(errs, fmt.Errorf("%s/%d: %w", topic, p, b.Err))
					continue
				}
				out[TopicPartition{topic, p}] = b.Offset
			}
		}
	}
	return out, errors.Join(errs...)
}

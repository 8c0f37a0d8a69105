package kafka

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"

	"github.com/IBM/sarama"
)

// APIKey is a Kafka request type, as ApiVersions lists them.
type APIKey int16

// The request types whose versions kswitch checks at a connection's open.
const (
	APIKeyProduce        APIKey = 0
	APIKeyFetch          APIKey = 1
	APIKeyInitProducerID APIKey = 22
)

func (k APIKey) String() string {
	switch k {
	case APIKeyProduce:
		return "Produce"
	case APIKeyFetch:
		return "Fetch"
	case APIKeyInitProducerID:
		return "InitProducerID"
	}
	return fmt.Sprintf("api key %d", int16(k))
}

// Conn is a dedicated connection to one broker: a sarama.Broker of its own,
// not the one a sarama.Client shares between metadata, offsets and group
// requests, so that a long-polling fetch or a hung broker delays nothing
// else. It is opened with the TLS, SASL, dialer or proxy and timeouts of
// the sarama.Config it is given (Config, NewClientWith's Client.Config()).
//
// Close never waits on the network: it closes the socket under sarama, so
// that a request in flight fails at once, whatever sarama's read timeout.
// A Conn is used by one goroutine at a time (its requests are sent one
// after the other); Close may be called from any goroutine, any number of
// times.
type Conn struct {
	addr   string
	broker *sarama.Broker
	// read counts the bytes read from the socket (under TLS: the
	// encrypted bytes), so that a caller sending one request at a time
	// knows the size of each response.
	read     atomic.Int64
	versions map[APIKey]sarama.ApiVersionsResponseKey

	mu     sync.Mutex
	closed bool
	socks  []net.Conn  // every socket dialled for this Conn
	stop   func() bool // unregisters the ctx watch
}

// DialConn connects to the broker at addr with conf and asks which request
// versions it serves. The end of ctx closes the connection, interrupting
// the dial, the handshakes and any request in flight; after DialConn
// returns the caller still owns the Conn and must Close it. conf is not
// modified.
//
// A dial through a Dialer that takes no context (Options.Dialer) is not
// interrupted by ctx; it ends within its own timeout.
func DialConn(ctx context.Context, conf *sarama.Config, addr string) (*Conn, error) {
	c := &Conn{addr: addr}
	cc := *conf
	// Metrics of our own: a broker's Close unregisters what it
	// registered, which would remove the client's shared meters.
	cc.MetricRegistry = sarama.NewConfig().MetricRegistry
	cc.Net.Proxy.Enable = true
	cc.Net.Proxy.Dialer = connDialer{c: c, ctx: ctx, next: dialerOf(conf)}
	c.broker = sarama.NewBroker(addr)
	stop := context.AfterFunc(ctx, c.Close)
	c.mu.Lock()
	c.stop = stop
	c.mu.Unlock()
	if err := c.broker.Open(&cc); err != nil {
		c.Close()
		return nil, fmt.Errorf("kafka: broker %s: %w", addr, err)
	}
	// Connected waits for the dial, sarama's ApiVersions and SASL.
	if ok, err := c.broker.Connected(); !ok {
		c.Close()
		if err == nil || ctx.Err() != nil {
			err = errors.Join(ctx.Err(), sarama.ErrNotConnected)
		}
		return nil, fmt.Errorf("kafka: connect to broker %s: %w", addr, err)
	}
	// sarama clamps each request to the broker's versions but keeps them
	// to itself; ask again for the floor checks.
	resp, err := c.broker.ApiVersions(&sarama.ApiVersionsRequest{Version: 3, ClientSoftwareName: "kswitch", ClientSoftwareVersion: "1"})
	if err == nil && resp.ErrorCode != 0 {
		err = sarama.KError(resp.ErrorCode)
	}
	if err != nil {
		c.Close()
		if ctx.Err() != nil {
			err = errors.Join(ctx.Err(), err)
		}
		return nil, fmt.Errorf("kafka: ApiVersions of broker %s: %w", addr, err)
	}
	c.versions = make(map[APIKey]sarama.ApiVersionsResponseKey, len(resp.ApiKeys))
	for _, k := range resp.ApiKeys {
		c.versions[APIKey(k.ApiKey)] = k
	}
	return c, nil
}

// Negotiate returns the version of key to send on c: min(ceiling, the
// broker's maximum), the ceiling being what kswitch encodes for the
// cluster's configured version (FetchVersion, ProduceVersion). It fails
// when that is below floor, the first version whose encoding kswitch
// relies on (record batches: Fetch 4, Produce 3), or when the broker does
// not serve key at all.
func (c *Conn) Negotiate(key APIKey, ceiling, floor int16) (int16, error) {
	if ceiling < floor {
		return 0, fmt.Errorf("kafka: the configured Kafka version sends %s v%d; kswitch needs v%d or later (Kafka 0.11 and later): raise the cluster's version", key, ceiling, floor)
	}
	r, ok := c.versions[key]
	if !ok {
		return 0, fmt.Errorf("kafka: broker %s does not serve %s requests", c.addr, key)
	}
	v := min(ceiling, r.MaxVersion)
	if v < floor || v < r.MinVersion {
		return 0, fmt.Errorf("kafka: broker %s serves %s v%d-v%d; kswitch needs v%d or later (Kafka 0.11 and later)", c.addr, key, r.MinVersion, r.MaxVersion, floor)
	}
	return v, nil
}

// Broker is the connection's sarama.Broker, for its request methods. Do
// not Open or Close it: Close the Conn.
func (c *Conn) Broker() *sarama.Broker { return c.broker }

// Addr is the broker's address.
func (c *Conn) Addr() string { return c.addr }

// BytesRead is the number of bytes read from the socket so far.
func (c *Conn) BytesRead() int64 { return c.read.Load() }

// Close closes the connection. A request in flight fails at once with a
// closed-connection error; a dial in flight is abandoned (see DialConn).
// It never waits on the network.
func (c *Conn) Close() {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	c.closed = true
	socks, stop := c.socks, c.stop
	c.socks = nil
	c.mu.Unlock()
	if stop != nil {
		stop()
	}
	// Closing the sockets first makes sarama's reader fail, which
	// releases the broker's lock that a request in flight holds; then
	// the broker's Close only waits for that reader to return.
	for _, s := range socks {
		_ = s.Close()
	}
	_ = c.broker.Close() // ErrNotConnected when the open failed: fine
}

// dialerOf is the dialer sarama would use for conf; for a client's
// configuration (NewClientWith), the one beneath the client's own socket
// keeping, whose Close must not close the Conns dialled from it.
func dialerOf(conf *sarama.Config) Dialer {
	if d, ok := conf.Net.Proxy.Dialer.(socketDialer); ok && conf.Net.Proxy.Enable {
		return d.next
	}
	if conf.Net.Proxy.Enable && conf.Net.Proxy.Dialer != nil {
		return conf.Net.Proxy.Dialer
	}
	return &net.Dialer{Timeout: conf.Net.DialTimeout, KeepAlive: conf.Net.KeepAlive, LocalAddr: conf.Net.LocalAddr}
}

// connDialer dials for one Conn: through the dialer sarama would have used,
// interrupted by the Conn's ctx where that dialer takes one, and keeping
// the socket so that Close can close it under sarama.
type connDialer struct {
	c    *Conn
	ctx  context.Context
	next Dialer
}

func (d connDialer) Dial(network, addr string) (net.Conn, error) {
	var s net.Conn
	var err error
	switch next := d.next.(type) {
	case *net.Dialer:
		s, err = next.DialContext(d.ctx, network, addr)
	case socksDialer:
		ctx, cancel := context.WithTimeout(d.ctx, next.sc.Net.DialTimeout)
		s, err = next.d.DialContext(ctx, network, addr)
		cancel()
	default:
		s, err = next.Dial(network, addr)
	}
	if err != nil {
		return nil, err
	}
	d.c.mu.Lock()
	defer d.c.mu.Unlock()
	if d.c.closed {
		_ = s.Close()
		return nil, net.ErrClosed
	}
	cs := &countingConn{Conn: s, n: &d.c.read}
	d.c.socks = append(d.c.socks, cs)
	return cs, nil
}

// countingConn counts the bytes read from a socket.
type countingConn struct {
	net.Conn
	n *atomic.Int64
}

func (c *countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.n.Add(int64(n))
	return n, err
}

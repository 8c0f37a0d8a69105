package devstack_test

import (
	"errors"
	"net"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
)

// A devstack.Link is what the agent tests' Hooks.KafkaDialer hands out.
var _ kafka.Dialer = (*devstack.Link)(nil)

func linkedClient(t *testing.T, k *devstack.Kafka, l *devstack.Link) sarama.Client {
	t.Helper()
	cfg := saramaConfig()
	cfg.Net.Proxy.Enable = true
	cfg.Net.Proxy.Dialer = l
	cfg.Net.ReadTimeout = time.Second
	cfg.Metadata.Retry.Max = 0
	return newSaramaClient(t, k, cfg)
}

func TestLinkCutAndHeal(t *testing.T) {
	t.Parallel()
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 1}})
	l := devstack.NewLink()
	linked := linkedClient(t, k, l)
	direct := newSaramaClient(t, k, nil)
	if err := linked.RefreshMetadata(); err != nil {
		t.Fatalf("metadata through a healed link: %v", err)
	}
	if l.Conns() == 0 || l.Dials() == 0 {
		t.Fatalf("the client's connections did not go through the link: %d open, %d dialled", l.Conns(), l.Dials())
	}

	l.Cut()
	if !l.IsCut() || l.Conns() != 0 {
		t.Fatalf("after Cut: cut=%v, %d connections open", l.IsCut(), l.Conns())
	}
	// Requests fail at once (closed connection, refused reconnect), not
	// after a timeout.
	err := within(t, 2*time.Second, "metadata through a cut link", func() error { return linked.RefreshMetadata() })
	if err == nil {
		t.Fatal("metadata through a cut link succeeded")
	}
	if _, err := l.Dial("tcp", k.Brokers()[0]); !errors.Is(err, devstack.ErrLinkCut) {
		t.Fatalf("Dial on a cut link: %v, want devstack.ErrLinkCut", err)
	}
	var op *net.OpError
	if _, err := l.Dial("tcp", k.Brokers()[0]); !errors.As(err, &op) {
		t.Fatalf("Dial on a cut link: %T, want a *net.OpError as a refused dial gives", err)
	}
	// Only this link is cut: the cluster serves everyone else.
	if err := direct.RefreshMetadata(); err != nil {
		t.Fatalf("a client outside the link: %v", err)
	}
	l.Cut() // idempotent

	l.Heal()
	waitFor(t, 5*time.Second, "metadata through the healed link", func() error {
		if err := linked.RefreshMetadata(); err != nil {
			return err
		}
		_, err := linked.GetOffset("orders", 0, sarama.OffsetNewest)
		return err
	})
	l.Heal() // idempotent
	if l.Conns() == 0 {
		t.Fatal("no connection open through the healed link")
	}
}

func TestLinkClosesConnectionsDialledDuringACut(t *testing.T) {
	t.Parallel()
	// A listener that accepts but never answers: a dial through the link
	// completes, Cut must still close the connection it made.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 4)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				close(accepted)
				return
			}
			accepted <- c
		}
	}()
	l := devstack.NewLink()
	c, err := l.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server := <-accepted
	defer server.Close()
	l.Cut()
	// The server sees the connection closed.
	_ = server.SetReadDeadline(time.Now().Add(2 * time.Second))
	_, err = server.Read(make([]byte, 1))
	var ne net.Error
	switch {
	case err == nil:
		t.Fatal("server read data after Cut, want EOF")
	case errors.As(err, &ne) && ne.Timeout():
		t.Fatal("the connection stayed open after Cut")
	}
	// The client's own Close after Cut is harmless.
	_ = c.Close()
	if n := l.Conns(); n != 0 {
		t.Fatalf("%d connections after Cut", n)
	}
	ln.Close()
	for c := range accepted {
		c.Close()
	}
}

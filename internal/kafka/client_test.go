package kafka_test

import (
	"errors"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// TestClientCloseDoesNotWaitForAHungBroker: a client's Close with a
// request in flight to a hung broker ends that request at once. sarama
// closes its brokers asynchronously once their requests end, so the
// request went on for the read timeout and its retries, and whoever
// waited for it (an agent stopping on a hung cluster) waited that long.
func TestClientCloseDoesNotWaitForAHungBroker(t *testing.T) {
	t.Parallel()
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 1}})
	c, err := kafka.NewClient("A", cluster(k))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetOffset("orders", 0, sarama.OffsetNewest); err != nil {
		t.Fatalf("list offsets of a healthy cluster: %v", err)
	}
	k.Hang()
	defer k.Recover()
	before := k.Swallowed()
	asked := make(chan error, 1)
	go func() {
		_, err := c.GetOffset("orders", 0, sarama.OffsetOldest)
		asked <- err
	}()
	wait.For(t, 5*time.Second, "the request swallowed by the hung broker", func() error {
		if k.Swallowed() == before {
			return errors.New("not yet")
		}
		return nil
	})
	began := time.Now()
	if err := c.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	closed := time.Since(began)
	select {
	case err := <-asked:
		if err == nil {
			t.Fatal("the request in flight to the hung broker succeeded")
		}
		t.Logf("Close took %v; the request in flight ended with %v", closed, err)
	case <-time.After(2 * time.Second):
		t.Fatalf("the request in flight did not end within 2 s of Close (which took %v)", closed)
	}
	if closed > time.Second {
		t.Errorf("Close took %v with a request in flight to a hung broker, want at once", closed)
	}
}

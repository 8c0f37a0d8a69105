package notify

import (
	"context"
	"fmt"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kswitch/kswitch/internal/testkit/wait"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestNotifyCoalescesAndEndsWithTheContext: notifications coalesce into
// one pending value, one channel can follow two sets, and a subscriber
// whose context ended is told nothing more.
func TestNotifyCoalescesAndEndsWithTheContext(t *testing.T) {
	var a, b Subscribers
	ctx, cancel := context.WithCancel(context.Background())
	ch := a.Subscribe(ctx)
	b.Attach(ctx, ch)
	a.Notify()
	a.Notify() // never blocks: the buffer is full
	b.Notify()
	if n := len(ch); n != 1 {
		t.Fatalf("%d values pending after three notifications, want 1", n)
	}
	<-ch
	b.Notify()
	select {
	case <-ch:
	default:
		t.Fatal("the second set's change did not reach the attached channel")
	}
	cancel()
	// AfterFunc unsubscribes in a goroutine of its own.
	wait.For(t, 5*time.Second, "the subscriptions end with their context", func() error {
		if n := a.Len() + b.Len(); n != 0 {
			return fmt.Errorf("%d subscriptions left", n)
		}
		return nil
	})
	a.Notify()
	b.Notify()
	if n := len(ch); n != 0 {
		t.Fatalf("%d values after the subscription ended, want 0", n)
	}
}

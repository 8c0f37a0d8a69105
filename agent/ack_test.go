package agent_test

import (
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// TestAFailedAckIsWrittenAgain: an agent whose acknowledgement of a
// generation fails (etcd refused the write) writes it again at the next
// commit ticks, so the leader does not wait for the next generation to
// learn it was applied (and never takes it for silent).
func TestAFailedAckIsWrittenAgain(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	cli := testenv.EtcdClientT(t, d.etcd)
	l, agents, p := flowingFleet(t, d)
	var failed atomic.Int64
	joiner := startFleetAgent(t, d.config("agent-4"), agent.WithHooks(agent.Options{Handler: l.handler("agent-4")}, agent.Hooks{
		AckFails: func(gen int64) error {
			if failed.CompareAndSwap(0, gen) {
				return errors.New("etcd refused the write (test)")
			}
			return nil
		},
	}))
	agents = append(agents, joiner)
	waitBalanced(t, failoverPartitions, agents...)
	wait.For(t, 10*time.Second, "agent-4's failed ack written again", func() error {
		if failed.Load() == 0 {
			return errors.New("no ack failed yet")
		}
		resp, err := cli.Get(t.Context(), fleetKeys.Ack("agent-4"))
		if err != nil {
			return err
		}
		if len(resp.Kvs) == 0 {
			return errors.New("acks/agent-4 absent")
		}
		if g, _ := strconv.ParseInt(string(resp.Kvs[0].Value), 10, 64); g < failed.Load() {
			return fmt.Errorf("acks/agent-4 = %d, the failed ack was of %d", g, failed.Load())
		}
		return nil
	})
	p.halt()
	waitAllHandled(t, l, p.written(), 20*time.Second)
	l.check(t)
}

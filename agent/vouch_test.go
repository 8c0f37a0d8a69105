package agent_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// TestMembershipShownInKeyedGossip: agents whose HTTPS endpoints require
// client certificates from a CA the leader's own certificate is not from
// cannot show who they are over HTTP (the handshake is refused). They
// speak the fleet's keyed gossip from the addresses they registered:
// that is their proof, and the leader plans on all three.
func TestMembershipShownInKeyedGossip(t *testing.T) {
	t.Parallel()
	d := startDC(t)
	pki, err := devstack.NewPKI(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	other, err := devstack.NewPKI(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	cert, err := pki.Issue("agent-http", "agent-http")
	if err != nil {
		t.Fatal(err)
	}
	l := newLedger()
	var agents []*agent.Agent
	for _, id := range []string{"agent-1", "agent-2", "agent-3"} {
		cfg := d.config(id)
		cfg.Agent.HTTPTLS = config.ServerTLS{CertFile: cert.CertFile, KeyFile: cert.KeyFile, ClientCAFile: other.CAFile}
		agents = append(agents, startConsumer(t, cfg, l.handler(id)))
	}
	waitBalanced(t, failoverPartitions, agents...)
	p := startProducer(t, d.a.Brokers(), "orders", 0)
	wait.For(t, 10*time.Second, "records handled", func() error {
		if n := l.count(); n < 100 {
			return fmt.Errorf("%d handled", n)
		}
		return nil
	})
	p.halt()
	waitAllHandled(t, l, p.written(), 20*time.Second)
	l.check(t)
}

package routing

import (
	"errors"
	"maps"
	"testing"
	"time"

	"github.com/kswitch/kswitch/internal/wait"
)

// TestClusterRedefinedDuringAnOutageKeepsSourceOrder: the definition of
// the channel's cluster changes (its client id: another producer) while
// the cluster refuses connections and records wait inside the producer.
// On the direct path the retired producer never gives a record up by
// itself: it is closed (retireWait), what it did not finish is held and
// sent again, in source order, through the new producer once the cluster
// is back. On both paths every record is acknowledged and each source
// partition reaches the channel in order.
func TestClusterRedefinedDuringAnOutageKeepsSourceOrder(t *testing.T) {
	w, r, f := orderedWorld(t, nil, nil)
	c := w.kafkas["C"]
	c.Fail()
	waitFailing(t, r, "c")
	clusters := maps.Clone(w.cfg.Clusters)
	cl := clusters["C"]
	cl.ClientID = "kswitch-redefined"
	clusters["C"] = cl
	r.SetClusters(clusters)
	if r.opts.Produce == ProduceDirect {
		// The outage outlasts the retired producer: what it held comes
		// back to the router, to be sent again through the new one.
		ds := r.cur.Load().channels["c"].ds
		wait.For(t, retireWait+5*time.Second, "the retired producer's records held", func() error {
			r.mu.Lock()
			defer r.mu.Unlock()
			if n := len(ds.rec.held); n == 0 {
				return errors.New("none held")
			}
			return nil
		})
	}
	c.Recover()
	late, counted := w.orderAfterRecovery(r, f, "redefined")
	requireCounted(t, r, late)
	requireInOrderOnDirect(t, r, late)
	if late > 0 {
		t.Errorf("%d records reached the channel after a later one of their partition (%v counted by the router)", late, counted)
	}
}

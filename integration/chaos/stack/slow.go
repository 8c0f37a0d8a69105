//go:build chaos

package main

import (
	"math/rand/v2"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kswitch/kswitch/devstack"
)

// slowMax bounds the delay of a slowed cluster's requests: each waits a
// uniform draw in [0, slowMax) before the cluster handles it. Requests
// on one connection are answered in order, so a client that pipelines
// waits for the sum.
const slowMax = 400 * time.Millisecond

// slowFault slows one cluster: a kfake control that sleeps every request
// (SleepControl, which lets the cluster serve other connections
// meanwhile), then leaves it to the cluster. The control is installed on
// the kfake cluster running when the fault is turned on; a restart makes a
// new cluster without it, and the restart installs it again
// (installSlow). A fault turned on while the cluster is stopped (another
// fault holds it) takes effect when it starts again. on and off are called
// under the stack's mu; the control runs on kfake's goroutines.
type slowFault struct {
	installed *kfake.Cluster

	mu     sync.Mutex
	on     bool
	healed chan struct{} // closed by off: sleeping requests go on at once
}

// slowOn slows cluster name (k), now or, stopped, from its restart.
func (s *stack) slowOn(name string, k *devstack.Kafka) {
	if s.slow == nil {
		s.slow = map[string]*slowFault{}
	}
	f := s.slow[name]
	if f == nil {
		f = &slowFault{}
		s.slow[name] = f
	}
	f.mu.Lock()
	f.on, f.healed = true, make(chan struct{})
	f.mu.Unlock()
	s.installSlow(name, k)
}

// installSlow installs name's slow control, if it has one, on k's running
// cluster (once per cluster: a restarted cluster is a new one). The
// control does nothing while the fault is off.
func (s *stack) installSlow(name string, k *devstack.Kafka) {
	f := s.slow[name]
	c := k.Cluster()
	if f == nil || c == nil || f.installed == c {
		return
	}
	c.Control(f.control(c))
	f.installed = c
}

// slowOff lifts name's slowness, if any: requests sleeping go on.
func (s *stack) slowOff(name string) {
	f := s.slow[name]
	if f == nil {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.on {
		f.on = false
		close(f.healed)
	}
}

// control is the kfake control of f on c. It never handles a request
// (returns false): kfake keeps it installed and serves the request after
// the sleep, unless an earlier control (devstack's fail, hang, starve)
// handled it.
func (f *slowFault) control(c *kfake.Cluster) func(kmsg.Request) (kmsg.Response, error, bool) {
	return func(kmsg.Request) (kmsg.Response, error, bool) {
		f.mu.Lock()
		on, healed := f.on, f.healed
		f.mu.Unlock()
		if !on {
			return nil, nil, false
		}
		d := rand.N(slowMax)
		c.SleepControl(func() {
			t := time.NewTimer(d)
			defer t.Stop()
			select {
			case <-t.C:
			case <-healed:
			}
		})
		return nil, nil, false
	}
}

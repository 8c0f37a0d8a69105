//go:build chaos

package main

import (
	"fmt"
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
// new cluster without it, and the next on installs it again. on and off
// are called under the stack's mu; the control runs on kfake's goroutines.
type slowFault struct {
	installed *kfake.Cluster

	mu     sync.Mutex
	on     bool
	healed chan struct{} // closed by off: sleeping requests go on at once
}

// slowOn slows cluster name (k).
func (s *stack) slowOn(name string, k *devstack.Kafka) error {
	c := k.Cluster()
	if c == nil {
		return fmt.Errorf("%s: slow: the cluster is stopped", name)
	}
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
	if f.installed != c {
		c.Control(f.control(c))
		f.installed = c
	}
	return nil
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

// Package refused counts the values kswitch finds under a fleet's etcd
// prefix (and in gossip) and refuses: malformed, oversized, or naming what
// does not exist. Whoever refuses a value logs the key, the reason and what
// stays in force instead, and counts it here, so one metric,
// kswitch_refused_values_total{kind}, shows a stranger writing to the
// fleet's keys whichever part of an agent reads them.
package refused

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// The kinds of values, the values of the kind label.
const (
	Signal       = "signal"       // signals/…
	Pin          = "pin"          // control/pin
	Stages       = "stages"       // control/stages
	Assignment   = "assignment"   // state/assignment
	Active       = "active"       // state/active
	Offset       = "offset"       // offsets/…
	Registration = "registration" // agents/<id>
	Routes       = "routes"       // routes (and a routing version that does not compile)
	Channel      = "channel"      // channels/<name>
	History      = "history"      // history/<epoch>
	Gossip       = "gossip"       // another agent's gossip metadata
	GossipKey    = "gossip_key"   // /kswitch-keys/<fleet>/gossip
	Config       = "config"       // state/config (a version this agent cannot apply)
	Ack          = "ack"          // acks/<id>
)

// Name is the metric's name.
const Name = "kswitch_refused_values_total"

// Counter returns the counter of refused values registered on reg,
// registering it the first time: the parts of an agent that share a
// registry (the agent, its leader, its router) share the counter.
func Counter(reg prometheus.Registerer) (*prometheus.CounterVec, error) {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: Name,
		Help: "Values found under the fleet's etcd prefix (or in gossip) and refused as malformed, oversized or naming what does not exist, by kind; the last good state stayed in force.",
	}, []string{"kind"})
	err := reg.Register(c)
	var dup prometheus.AlreadyRegisteredError
	if errors.As(err, &dup) {
		if existing, ok := dup.ExistingCollector.(*prometheus.CounterVec); ok {
			return existing, nil
		}
	}
	if err != nil {
		return nil, err
	}
	return c, nil
}

// Truncate cuts a refused value to at most n bytes for a log line or a
// status page, marking the cut, without splitting a UTF-8 sequence.
func Truncate(v []byte, n int) string {
	if len(v) <= n {
		return string(v)
	}
	i := n
	for i > 0 && v[i]&0xC0 == 0x80 {
		i--
	}
	return string(v[:i]) + "…"
}

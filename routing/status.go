package routing

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"
)

// closeProducersTimeout bounds closing the producers in Close.
const closeProducersTimeout = 5 * time.Second

// RouterStatus is what a router reports for /status.
type RouterStatus struct {
	// Ready is false until etcd's routes and channels have been read.
	Ready bool `json:"ready"`
	// Version is the number of the version in force (see Version.Number),
	// Since when it is in force, Source where it came from.
	Version int64     `json:"version"`
	Since   time.Time `json:"since"`
	Source  string    `json:"source"`
	Mode    string    `json:"mode"`
	// Rules are the rules' names, in order.
	Rules      []string        `json:"rules"`
	Default    []string        `json:"default"`
	DeadLetter string          `json:"dead_letter,omitempty"`
	Channels   []ChannelStatus `json:"channels"`
	// Producers are the producers open, by cluster.
	Producers []string `json:"producers"`
	// InFlight counts the produces not yet acknowledged.
	InFlight int64 `json:"in_flight"`
	// LastRefusal is the last version refused, if any.
	LastRefusal *Refusal `json:"last_refusal,omitempty"`
	// ExactlyOnce summarises the transactional producers, by
	// exactly_once cluster that has any.
	ExactlyOnce []TxnClusterStatus `json:"exactly_once,omitempty"`
}

// TxnClusterStatus is the state of a router's transactional producers on
// one exactly_once cluster.
type TxnClusterStatus struct {
	Cluster string `json:"cluster"`
	// Producers open, one per source stream partition owned.
	Producers int `json:"producers"`
	// Open counts the records in open transactions, Queued those waiting
	// for a commit to end, Held those held while a copy is aligned.
	Open   int `json:"open"`
	Queued int `json:"queued"`
	Held   int `json:"held"`
	// Broken lists the streams whose producer is being opened again after
	// a failure, with the failure.
	Broken []string `json:"broken,omitempty"`
}

// ChannelStatus is one channel of the version in force.
type ChannelStatus struct {
	Name    string `json:"name"`
	Cluster string `json:"cluster"`
	Topic   string `json:"topic"`
	// Paused is true while a channel signal holds its records.
	Paused bool `json:"paused"`
	// InFlight counts its produces not yet acknowledged.
	InFlight int64 `json:"in_flight"`
	// Failing is the last produce error while the destination fails (its
	// records wait), since FailingSince; empty while it works.
	Failing      string     `json:"failing,omitempty"`
	FailingSince *time.Time `json:"failing_since,omitempty"`
}

// Status returns the router's state: the version in force, its channels
// and their health, and the last refusal.
func (r *Router) Status() RouterStatus {
	v := r.cur.Load()
	st := RouterStatus{
		Version: v.Number, Since: v.Since, Source: v.Source, Mode: v.Mode(),
		Rules: v.RuleNames(), Default: slices.Clone(v.spec.Default), DeadLetter: v.DeadLetter(),
		InFlight: r.inFlight(), Channels: []ChannelStatus{}, Producers: []string{},
	}
	select {
	case <-r.ready:
		st.Ready = true
	default:
	}
	sig := r.signals()
	for _, name := range v.ChannelNames() {
		ch := v.channels[name]
		cs := ChannelStatus{Name: name, Cluster: ch.Cluster, Topic: ch.Topic, Paused: sig.ChannelPaused(name)}
		if ds := ch.ds; ds != nil {
			cs.InFlight = ds.inFlight.Load()
			if f := ds.failing.Load(); f != nil {
				since := f.since
				cs.Failing, cs.FailingSince = f.err.Error(), &since
			}
		}
		st.Channels = append(st.Channels, cs)
	}
	for _, k := range r.pool.keys() {
		st.Producers = append(st.Producers, k.String())
	}
	slices.Sort(st.Producers)
	r.mu.Lock()
	if r.refusal != nil {
		ref := *r.refusal
		st.LastRefusal = &ref
	}
	r.mu.Unlock()
	st.ExactlyOnce = r.txns.status()
	return st
}

// Close stops the router: Handle refuses records from now on; the
// produces in flight are given until ctx ends to be acknowledged (failed
// ones are still sent again meanwhile); then the producers are closed.
// Records not acknowledged by then are not: the partition's next owner
// consumes them again. Close waits for the router's goroutines (or ctx)
// and is safe to call twice; stop the agent first, so that nothing is
// handed to a closing router. Run should have returned or be ending.
func (r *Router) Close(ctx context.Context) error {
	r.closeOnce.Do(func() {
		r.closed.Store(true)
		tick := time.NewTicker(10 * time.Millisecond)
	drain:
		for r.inFlight() > 0 {
			select {
			case <-ctx.Done():
				break drain
			case <-tick.C:
			}
		}
		tick.Stop()
		left := r.inFlight()
		r.loopCancel()
		ran := true
		r.loopOnce.Do(func() { ran = false }) // Run never started the loop: nobody will
		if ran {
			<-r.loopDone
		} else {
			r.settleWaiting()
		}
		var errs []error
		if left > 0 {
			errs = append(errs, fmt.Errorf("routing: %d produce(s) not acknowledged when closing: their records are consumed again by the next owner", left))
		}
		// Closing the producers gets its own few seconds even when the
		// drain used all of ctx: each producer gives back what it
		// holds (Unfinished) before it closes.
		pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), closeProducersTimeout)
		defer cancel()
		if err := r.pool.close(pctx); err != nil {
			errs = append(errs, err)
		}
		r.txns.close()
		r.closeErr = errors.Join(errs...)
	})
	return r.closeErr
}

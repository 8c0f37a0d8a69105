// Package notify keeps the subscribers of a piece of state that changes:
// each is told of a change by a value on a channel with a buffer of one,
// so notifications coalesce and the notifier never blocks.
package notify

import (
	"context"
	"slices"
	"sync"
)

// Subscribers is a set of channels told of changes. The zero value is
// ready; it is safe for concurrent use.
type Subscribers struct {
	mu   sync.Mutex
	subs []chan<- struct{}
}

// Subscribe returns a channel that receives a value after each Notify
// (coalesced: the buffer holds one) until ctx ends. It is not closed.
func (s *Subscribers) Subscribe(ctx context.Context) chan struct{} {
	ch := make(chan struct{}, 1)
	s.Attach(ctx, ch)
	return ch
}

// Attach makes ch receive a value after each Notify, without blocking,
// until ctx ends: one channel can follow several sets.
func (s *Subscribers) Attach(ctx context.Context, ch chan<- struct{}) {
	s.mu.Lock()
	s.subs = append(s.subs, ch)
	s.mu.Unlock()
	context.AfterFunc(ctx, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		s.subs = slices.DeleteFunc(s.subs, func(c chan<- struct{}) bool { return c == ch })
	})
}

// Notify sends a value to every subscriber whose buffer has room.
func (s *Subscribers) Notify() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ch := range s.subs {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

// Len returns the number of subscribers.
func (s *Subscribers) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.subs)
}

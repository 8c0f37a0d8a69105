package kafka

import (
	"sync"
	"sync/atomic"
)

// Budget bounds bytes held, shared by goroutines: every method is safe for
// concurrent use and none blocks. ByteBudget implements it.
type Budget interface {
	// Charge takes n bytes, beyond the bound if need be.
	Charge(n int64)
	// Give gives n bytes back.
	Give(n int64)
	// Room returns nil when at least n bytes are free; otherwise a channel
	// closed by a later Give (which may not free n bytes: ask again).
	Room(n int64) <-chan struct{}
	// Free returns the bytes free now (0 or less when none are): a
	// request asks for no more, on the wire, than Free divided by how
	// much more the last response weighed decoded.
	Free() int64
}

// ByteBudget is a Budget of max bytes.
type ByteBudget struct {
	max     int64
	used    atomic.Int64
	waiting atomic.Bool // a Room found too little since the last Give
	mu      sync.Mutex
	room    chan struct{} // closed by the next Give after a Room found too little
}

// NewByteBudget returns a budget of max bytes.
func NewByteBudget(max int64) *ByteBudget { return &ByteBudget{max: max} }

// Charge implements Budget.
func (b *ByteBudget) Charge(n int64) { b.used.Add(n) }

// Give implements Budget.
func (b *ByteBudget) Give(n int64) {
	b.used.Add(-n)
	if !b.waiting.Load() {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.waiting.Store(false)
	if b.room != nil {
		close(b.room)
		b.room = nil
	}
}

// Room implements Budget.
func (b *ByteBudget) Room(n int64) <-chan struct{} {
	if b.used.Load()+n <= b.max {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.room == nil {
		b.room = make(chan struct{})
	}
	b.waiting.Store(true)
	// A Give between the first look and waiting's store found nobody
	// waiting: look again, now that a Give will close room.
	if b.used.Load()+n <= b.max {
		return nil
	}
	return b.room
}

// Free implements Budget.
func (b *ByteBudget) Free() int64 { return b.max - b.used.Load() }

// InUse returns the bytes charged and not given back.
func (b *ByteBudget) InUse() int64 { return b.used.Load() }

// Max returns the bound.
func (b *ByteBudget) Max() int64 { return b.max }

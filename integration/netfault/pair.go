package netfault

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"time"
)

// pair is a client connection and its upstream, joined across a link.
type pair struct {
	link             *Link
	client, upstream net.Conn
	done             chan struct{} // closed by close
	once             sync.Once
}

func newPair(l *Link, client, upstream net.Conn) *pair {
	return &pair{link: l, client: client, upstream: upstream, done: make(chan struct{})}
}

// close closes both connections; the pipes end. Safe to call twice.
func (p *pair) close() {
	p.once.Do(func() {
		close(p.done)
		p.client.Close()
		p.upstream.Close()
	})
}

// run copies bytes both ways under the link's fault until both
// directions have ended (a clean end of one is passed on as a half-close)
// or the pair is closed, then closes the pair. It returns when every
// goroutine it started has returned.
func (p *pair) run() {
	var wg sync.WaitGroup
	wg.Go(func() { p.pipe(p.upstream, p.client) })
	p.pipe(p.client, p.upstream)
	wg.Wait()
	p.close()
}

// chunk is bytes read from one side, due on the other at due.
type chunk struct {
	b   []byte
	due time.Time
}

// pipe copies src to dst: this goroutine reads and stamps each chunk with
// the time it is due, a writer goroutine delivers it then. It returns
// when src has ended and everything read was written (dst half-closed),
// or after closing the pair on any other error.
func (p *pair) pipe(dst, src net.Conn) {
	q := make(chan chunk, 64)
	wrote := make(chan bool, 1)
	go func() { wrote <- p.write(dst, q) }() // pipe waits for it below
	err := p.read(src, q)
	close(q)
	if !errors.Is(err, io.EOF) {
		p.close()
		<-wrote
		return
	}
	if !<-wrote {
		p.close()
		return
	}
	if cw, ok := dst.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
}

// read reads src into q until an error: io.EOF when src ended cleanly.
// While the link is blackholed it holds what it read and reads no more,
// so the sender's socket buffers fill as they would with no
// acknowledgements coming back.
func (p *pair) read(src net.Conn, q chan<- chunk) error {
	buf := make([]byte, 32<<10)
	var last time.Time // the previous chunk's due time: order is kept
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if !p.link.admit(p.done) {
				return net.ErrClosed // cut, or closed
			}
			f := p.link.Fault()
			due := time.Now()
			if f.delayed() {
				due = due.Add(delay(f))
			}
			if due.Before(last) {
				due = last
			}
			last = due
			select {
			case q <- chunk{bytes.Clone(buf[:n]), due}:
			case <-p.done:
				return net.ErrClosed
			}
		}
		if err != nil {
			return err
		}
	}
}

// delay draws a chunk's latency: Latency ± Jitter, at least 0.
func delay(f Fault) time.Duration {
	d := f.Latency
	if f.Jitter > 0 {
		d += time.Duration(rand.Int64N(int64(2*f.Jitter)+1)) - f.Jitter
	}
	return max(d, 0)
}

// write delivers q's chunks to dst when due, at most Bandwidth bytes a
// second; a chunk due while the link is blackholed waits for its end. It
// reports whether it wrote everything up to q's close.
func (p *pair) write(dst net.Conn, q <-chan chunk) bool {
	var next time.Time // when the bandwidth cap lets the next piece go
	for c := range q {
		if !p.sleepUntil(c.due) || !p.link.admit(p.done) {
			return false
		}
		f := p.link.Fault()
		for b := c.b; len(b) > 0; {
			n := len(b)
			if f.Bandwidth > 0 {
				// Pieces of 50 ms of the cap, each sent when the bytes
				// before it have had their time.
				n = min(n, int(max(1, f.Bandwidth/20)))
				if now := time.Now(); next.Before(now) {
					next = now
				}
				if !p.sleepUntil(next) {
					return false
				}
				next = next.Add(time.Duration(int64(n) * int64(time.Second) / f.Bandwidth))
			}
			if _, err := dst.Write(b[:n]); err != nil {
				p.close()
				return false
			}
			b = b[n:]
		}
	}
	return true
}

// sleepUntil waits until t, or returns false when the pair closes first.
func (p *pair) sleepUntil(t time.Time) bool {
	d := time.Until(t)
	if d <= 0 {
		return true
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return true
	case <-p.done:
		return false
	}
}

package kafka

// ProducerDone is closed once p's resolver and count refresher
// goroutines have returned, after Close: Close returns at its deadline
// while they may still be in a metadata call bounded by the client's
// timeouts.
func ProducerDone(p *Producer) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		<-p.resolved
		<-p.topics.done
		close(done)
	}()
	return done
}

// TxnStreamDone is closed once s's goroutine has returned.
func TxnStreamDone(s *TxnStream) <-chan struct{} { return s.done }

// MaxPartitionInFlight is the most batches one partition of p has had in
// flight at once.
func MaxPartitionInFlight(p *Producer) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.maxPartInflight
}

package kafka

// ProducerDone is closed once p's resolver goroutine has returned, after
// Close: Close returns at its deadline while the resolver may still be in
// a metadata call bounded by the client's timeouts.
func ProducerDone(p *Producer) <-chan struct{} { return p.resolved }

// MaxPartitionInFlight is the most batches one partition of p has had in
// flight at once.
func MaxPartitionInFlight(p *Producer) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.maxPartInflight
}

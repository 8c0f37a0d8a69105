package kafka

// ProducerDone is closed once p's resolver goroutine has returned, after
// Close: Close returns at its deadline while the resolver may still be in
// a metadata call bounded by the client's timeouts.
func ProducerDone(p *Producer) <-chan struct{} { return p.resolved }

package demo

import (
	"strconv"
	"sync"
	"time"

	"github.com/IBM/sarama"
)

// producer writes numbered records (key and value: the number) to the
// topic on one cluster at a steady rate, retrying while the cluster is
// unreachable, and remembers which numbers it acknowledged. It owns one
// goroutine, ended by stop.
type producer struct {
	cluster string
	mu      sync.Mutex
	acked   []int64
	after   int64 // the number after the last acknowledged
	quit    chan struct{}
	done    chan struct{}
	once    sync.Once
}

// startProducer writes to cluster from number from on.
func startProducer(cluster string, brokers []string, rate int, from int64) *producer {
	p := &producer{cluster: cluster, quit: make(chan struct{}), done: make(chan struct{}), after: from}
	go func() {
		defer close(p.done)
		p.run(brokers, rate, from)
	}()
	return p
}

func (p *producer) run(brokers []string, rate int, next int64) {
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	sc.Producer.Return.Successes = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Retry.Max = 0
	sc.Producer.Partitioner = sarama.NewRoundRobinPartitioner
	sc.Net.DialTimeout, sc.Net.ReadTimeout, sc.Net.WriteTimeout = time.Second, time.Second, time.Second
	sc.Metadata.Retry.Max = 0
	var sp sarama.SyncProducer
	defer func() {
		if sp != nil {
			sp.Close()
		}
	}()
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	for {
		select {
		case <-p.quit:
			return
		case <-tick.C:
		}
		if sp == nil {
			var err error
			if sp, err = sarama.NewSyncProducer(brokers, sc); err != nil {
				sp = nil
				continue
			}
		}
		v := strconv.FormatInt(next, 10)
		if _, _, err := sp.SendMessage(&sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder(v), Value: sarama.StringEncoder(v)}); err != nil {
			// A is unreachable: start afresh when it is back. The
			// number is not counted as produced; it is written again.
			sp.Close()
			sp = nil
			continue
		}
		p.mu.Lock()
		p.acked = append(p.acked, next)
		p.after = next + 1
		p.mu.Unlock()
		next++
	}
}

// stop ends the producer and waits for it. Safe to call twice.
func (p *producer) stop() {
	p.once.Do(func() { close(p.quit) })
	<-p.done
}

// count returns how many records the cluster acknowledged.
func (p *producer) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.acked)
}

// ids returns the numbers the cluster acknowledged.
func (p *producer) ids() []int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]int64(nil), p.acked...)
}

// next returns the number after the last one the cluster acknowledged.
func (p *producer) next() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.after
}

//go:build chaos

// Command stack serves the infrastructure of a chaos run (make chaos,
// integration/chaos) from one process: an embedded etcd, kfake clusters A
// and B with topic orders and the in-process mirrors both ways (A's orders
// is A.orders on B, B's orders is B.orders on A, offset-syncs on the
// target), a sink cluster C with the channel topic out, and a producer
// writing numbered records at a steady rate. The chaos driver injects
// faults through a control API on loopback HTTP:
//
//	GET  /info                        endpoints and topics (JSON)
//	POST /fault?target=A&action=fail  A|B|C: stop restart fail hang starve slow recover
//	POST /fault?target=etcd&action=stop|restart
//	POST /fault?target=mirror-AB&action=hold|release   (mirror-BA too)
//	POST /producer?action=stop        the producer stops for good
//	GET  /produced                    what the producer sent (JSON)
//	POST /partitions?topic=orders&add=2   partitions added to orders on the
//	                                  cluster the producer writes to (JSON)
//
// The producer writes to A's orders; a fault that takes A away (stop,
// fail, hang) moves it to B's orders, as producers move in a data-centre
// outage, and A's return (restart, recover) moves it back. Each source
// partition (origin cluster, partition) numbers its records from 0:
// key and value "<origin>:<partition>:<seq>", the value followed by
// ":<unix ms>" of the send. A number whose send failed is not used again
// (its outcome is unknown: it may be on the cluster), so a number is on
// its source partition at most once.
//
// Partitions added to orders (POST /partitions) are written to from then
// on, round-robin with the others; the mirrors look for added partitions
// every second and create and copy them on the other cluster, as
// MirrorMaker 2 does. out on C has -out-partitions partitions from the
// start (manual-same-partition: source partition N goes to out/N), and
// orders grows to that count at most.
//
// The program writes the control address to the file named by -ready once
// everything serves, and runs until SIGTERM or SIGINT.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/devstack/mirror"
)

const (
	topic    = "orders"
	outTopic = "out"
)

func main() { os.Exit(run()) }

func run() int {
	var (
		dir        = flag.String("dir", "", "directory for etcd's and the clusters' data (required)")
		ready      = flag.String("ready", "", "file to write the control address to once everything serves (required)")
		rate       = flag.Int("rate", 200, "records per second the producer writes")
		partitions = flag.Int("partitions", 4, "partitions of orders on A and B at the start")
		outParts   = flag.Int("out-partitions", 8, "partitions of out on C: as many as orders may grow to")
	)
	flag.Parse()
	if *dir == "" || *ready == "" || *rate <= 0 || *partitions <= 0 || *outParts < *partitions {
		fmt.Fprintln(os.Stderr, "stack: -dir and -ready are required; -rate and -partitions must be positive, -out-partitions at least -partitions")
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	logger, _ := zap.NewProduction()
	defer logger.Sync() //nolint:errcheck // stderr
	s := &stack{log: logger, partitions: int32(*partitions), outParts: int32(*outParts)}
	defer s.close()
	if err := s.start(ctx, *dir); err != nil {
		logger.Error("start", zap.Error(err))
		return 1
	}
	s.prod = startProducer(s, *rate)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		logger.Error("control listener", zap.Error(err))
		return 1
	}
	srv := &http.Server{Handler: s.mux(), ReadHeaderTimeout: 5 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	if err := os.WriteFile(*ready, []byte(ln.Addr().String()), 0o600); err != nil {
		logger.Error("ready file", zap.Error(err))
		srv.Close()
		<-served
		return 1
	}
	logger.Info("serving", zap.String("control", ln.Addr().String()))
	select {
	case <-ctx.Done():
	case err := <-served:
		logger.Error("control server", zap.Error(err))
	}
	shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = srv.Shutdown(shut)
	<-served
	return 0
}

// stack is the infrastructure. Faults are applied by HTTP handlers, one at
// a time (mu).
type stack struct {
	log        *zap.Logger
	partitions int32 // of orders at the start
	outParts   int32 // of out on C, the most orders grows to

	mu      sync.Mutex
	etcd    *devstack.Etcd
	kafka   map[string]*devstack.Kafka
	mirrors map[string]*mirror.Mirror // "mirror-AB", "mirror-BA"
	holds   sync.WaitGroup            // Hold calls under way
	slow    map[string]*slowFault     // clusters slowed once (slow.go)
	prod    *producer
}

func (s *stack) start(ctx context.Context, dir string) error {
	var err error
	if s.etcd, err = devstack.StartEtcd(filepath.Join(dir, "etcd"), s.log.Named("etcd").WithOptions(zap.IncreaseLevel(zap.ErrorLevel))); err != nil {
		return err
	}
	s.kafka = map[string]*devstack.Kafka{}
	for _, name := range []string{"A", "B", "C"} {
		t, n := topic, s.partitions
		if name == "C" {
			t, n = outTopic, s.outParts
		}
		k, err := devstack.StartKafka(name, devstack.KafkaOptions{DataDir: filepath.Join(dir, name), Topics: map[string]int32{t: n}})
		if err != nil {
			return err
		}
		s.kafka[name] = k
	}
	s.mirrors = map[string]*mirror.Mirror{}
	for _, flow := range [][2]string{{"A", "B"}, {"B", "A"}} {
		from, to := flow[0], flow[1]
		m, err := mirror.Start(ctx, mirror.Config{
			Source: s.kafka[from].Brokers(), Target: s.kafka[to].Brokers(), SourceName: from, TargetName: to,
			Topics: []string{topic}, RemoteTopic: func(t string) string { return from + "." + t },
			TargetPrefill: 50, OffsetSyncsTopic: "mm2-offset-syncs." + from + ".internal", OffsetSyncsOnTarget: true,
			PartitionRefresh: time.Second,
			Logger:           s.log.Named("mirror-" + from + to).WithOptions(zap.IncreaseLevel(zap.WarnLevel)),
		})
		if err != nil {
			return fmt.Errorf("mirror %s → %s: %w", from, to, err)
		}
		s.mirrors["mirror-"+from+to] = m
	}
	return nil
}

// close stops everything in reverse order.
func (s *stack) close() {
	if s.prod != nil {
		s.prod.stop()
	}
	for _, m := range s.mirrors {
		m.Stop()
	}
	s.holds.Wait()
	for _, k := range s.kafka {
		k.Stop()
	}
	if s.etcd != nil {
		s.etcd.Stop()
	}
}

// info is the body of GET /info.
type info struct {
	Etcd       []string            `json:"etcd"`
	Clusters   map[string][]string `json:"clusters"`
	Topic      string              `json:"topic"`
	OutTopic   string              `json:"out_topic"`
	Partitions int32               `json:"partitions"` // of orders at the start
	// OutPartitions are out's on C; orders grows to that many at most.
	OutPartitions int32 `json:"out_partitions"`
}

func (s *stack) mux() *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /info", func(w http.ResponseWriter, _ *http.Request) {
		in := info{Etcd: s.etcd.Endpoints(), Clusters: map[string][]string{}, Topic: topic, OutTopic: outTopic, Partitions: s.partitions, OutPartitions: s.outParts}
		for n, k := range s.kafka {
			in.Clusters[n] = k.Brokers()
		}
		writeJSON(w, in)
	})
	mux.HandleFunc("POST /fault", func(w http.ResponseWriter, r *http.Request) {
		target, action := r.URL.Query().Get("target"), r.URL.Query().Get("action")
		if err := s.fault(target, action); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		s.log.Info("fault", zap.String("target", target), zap.String("action", action))
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("POST /producer", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("action") != "stop" {
			http.Error(w, "action: stop", http.StatusBadRequest)
			return
		}
		s.prod.stop()
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /produced", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, s.prod.report())
	})
	mux.HandleFunc("POST /partitions", func(w http.ResponseWriter, r *http.Request) {
		add, err := strconv.Atoi(r.URL.Query().Get("add"))
		if t := r.URL.Query().Get("topic"); t != topic || err != nil || add <= 0 {
			http.Error(w, "partitions: topic=orders&add=N (N > 0)", http.StatusBadRequest)
			return
		}
		res, err := s.addPartitions(int32(add))
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		s.log.Info("partitions", zap.String("cluster", res.Cluster), zap.Int32("before", res.Before), zap.Int32("after", res.After))
		writeJSON(w, res)
	})
	return mux
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

// fault applies one fault or its healing.
func (s *stack) fault(target, action string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if target == "etcd" {
		switch action {
		case "stop":
			s.etcd.Stop()
			return nil
		case "restart":
			if !s.etcd.Running() {
				return s.etcd.Restart()
			}
			return nil
		}
		return fmt.Errorf("etcd: unknown action %q", action)
	}
	if m, ok := s.mirrors[target]; ok {
		switch action {
		case "hold":
			// Hold takes effect at once but returns only when the round
			// under way ends: a request's timeout while a cluster hangs.
			// Nothing waits for that but close.
			s.holds.Go(m.Hold)
			return nil
		case "release":
			m.Release()
			return nil
		}
		return fmt.Errorf("%s: unknown action %q", target, action)
	}
	k, ok := s.kafka[target]
	if !ok {
		return fmt.Errorf("unknown target %q", target)
	}
	switch action {
	case "stop":
		k.Stop()
	case "restart":
		if !k.Running() {
			if err := k.Restart(); err != nil {
				return err
			}
			s.installSlow(target, k)
		}
	case "fail":
		k.Fail()
	case "hang":
		k.Hang()
	case "starve":
		k.Starve()
	case "slow":
		s.slowOn(target, k)
	case "recover":
		k.Recover()
		s.slowOff(target)
	default:
		return fmt.Errorf("%s: unknown action %q", target, action)
	}
	if target == "A" {
		// The producers move to B while A is away and back when it returns.
		switch action {
		case "stop", "fail", "hang":
			s.prod.moveTo("B")
		case "restart", "recover":
			s.prod.moveTo("A")
		}
	}
	return nil
}

// grown is the answer of POST /partitions.
type grown struct {
	Cluster string `json:"cluster"`
	Before  int32  `json:"before"`
	After   int32  `json:"after"`
}

// addPartitions adds add partitions to orders on the cluster the producer
// writes to, up to out's count, and has the producer write to them.
func (s *stack) addPartitions(add int32) (grown, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	cluster, before := s.prod.partitionsNow()
	g := grown{Cluster: cluster, Before: before, After: min(before+add, s.outParts)}
	if g.After == before {
		return g, nil
	}
	if err := s.kafka[cluster].AddPartitions(topic, g.After); err != nil {
		return g, err
	}
	s.prod.setPartitions(cluster, g.After)
	return g, nil
}

// producer writes numbered records to orders on one cluster at a steady
// rate, round-robin over the partitions. It owns one goroutine, ended by
// stop.
type producer struct {
	s    *stack
	rate int
	quit chan struct{}
	done chan struct{}
	once sync.Once

	mu      sync.Mutex
	target  string
	parts   map[string]int32   // partitions of orders by cluster
	grown   map[string]bool    // clusters whose orders grew since their client was made
	sources map[string]*source // by "<origin>:<partition>"
}

// source is what the producer sent to one source partition.
type source struct {
	Origin    string  `json:"origin"`
	Partition int32   `json:"partition"`
	Next      int64   `json:"next"`    // numbers [0, Next) were sent
	Unknown   []int64 `json:"unknown"` // of them, those whose send failed
}

func startProducer(s *stack, rate int) *producer {
	p := &producer{s: s, rate: rate, quit: make(chan struct{}), done: make(chan struct{}), target: "A",
		parts: map[string]int32{"A": s.partitions, "B": s.partitions}, grown: map[string]bool{}, sources: map[string]*source{}}
	go func() {
		defer close(p.done)
		p.run()
	}()
	return p
}

func (p *producer) moveTo(cluster string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.target = cluster
}

// partitionsNow returns the cluster the producer writes to and the
// partitions of its orders.
func (p *producer) partitionsNow() (string, int32) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.target, p.parts[p.target]
}

// setPartitions has the producer write to n partitions of cluster's
// orders from its next record on, with a client that knows them.
func (p *producer) setPartitions(cluster string, n int32) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.parts[cluster] = n
	p.grown[cluster] = true
}

func (p *producer) run() {
	clients := map[string]sarama.SyncProducer{}
	defer func() {
		for _, c := range clients {
			c.Close()
		}
	}()
	tick := time.NewTicker(time.Second / time.Duration(p.rate))
	defer tick.Stop()
	var part int32
	for {
		select {
		case <-p.quit:
			return
		case <-tick.C:
		}
		p.mu.Lock()
		target, parts, grown := p.target, p.parts[p.target], p.grown[p.target]
		p.grown[target] = false
		p.mu.Unlock()
		if sp := clients[target]; sp != nil && grown {
			sp.Close() // its metadata has the partitions before
			delete(clients, target)
		}
		sp := clients[target]
		if sp == nil {
			var err error
			if sp, err = sarama.NewSyncProducer(p.s.kafka[target].Brokers(), producerConfig()); err != nil {
				continue
			}
			clients[target] = sp
		}
		part = (part + 1) % parts
		src := p.source(target, part)
		seq := src.Next
		id := target + ":" + strconv.Itoa(int(part)) + ":" + strconv.FormatInt(seq, 10)
		_, _, err := sp.SendMessage(&sarama.ProducerMessage{
			Topic: topic, Partition: part, Key: sarama.StringEncoder(id),
			Value: sarama.StringEncoder(id + ":" + strconv.FormatInt(time.Now().UnixMilli(), 10)),
		})
		p.mu.Lock()
		src.Next++
		if err != nil {
			src.Unknown = append(src.Unknown, seq)
		}
		p.mu.Unlock()
		if err != nil {
			// Start afresh on the next tick: the cluster may be back.
			sp.Close()
			delete(clients, target)
		}
	}
}

func (p *producer) source(origin string, part int32) *source {
	p.mu.Lock()
	defer p.mu.Unlock()
	k := origin + ":" + strconv.Itoa(int(part))
	src := p.sources[k]
	if src == nil {
		src = &source{Origin: origin, Partition: part}
		p.sources[k] = src
	}
	return src
}

func producerConfig() *sarama.Config {
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	sc.Producer.Return.Successes = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Retry.Max = 0
	sc.Producer.Partitioner = sarama.NewManualPartitioner
	sc.Net.DialTimeout, sc.Net.ReadTimeout, sc.Net.WriteTimeout = time.Second, time.Second, time.Second
	sc.Metadata.Retry.Max = 0
	return sc
}

// stop ends the producer and waits for it. Safe to call twice.
func (p *producer) stop() {
	p.once.Do(func() { close(p.quit) })
	<-p.done
}

// report returns a copy of what was sent.
func (p *producer) report() []source {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]source, 0, len(p.sources))
	for _, s := range p.sources {
		c := *s
		c.Unknown = append([]int64{}, s.Unknown...)
		out = append(out, c)
	}
	return out
}

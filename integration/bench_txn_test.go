//go:build integration && bench

package integration

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/kafka"
)

// The transactional stream alone (internal/kafka's TxnStream), without an
// agent around it: what one stream moves on B when it commits every
// txnCycleCommitBytes, against the same Producer's idempotent path, each
// holding at most txnCycleHeld records not yet settled (acknowledged, or
// for the stream committed), about one stream's share of the agent's
// default budget. It tells the stream's own ceiling from the agent's
// (row G4): one stream commits one transaction at a time, and its
// records count until their commit. A third mode, alternating, probes a
// design the agent does not have: two streams of the same records taking
// turns, one sending while the other commits, held alike.

const (
	txnCycleRecords     = 100_000
	txnCycleHeld        = 1_500
	txnCycleCommitBytes = 1 << 20
)

// txnCycleTrial is one run of one mode.
type txnCycleTrial struct {
	Mode             string  `json:"mode"` // idempotent, transactional or alternating
	Trial            int     `json:"trial"`
	Records          int     `json:"records"`
	RecordsPerSecond float64 `json:"records_per_second"`
	Commits          int     `json:"commits,omitempty"`
	// CommitMillis is the mean time a Commit took, from the call to its
	// return (the last acknowledgements, then EndTxn).
	CommitMillis float64 `json:"commit_millis,omitempty"`
	// ConcurrentRetries counts requests answered CONCURRENT_TRANSACTIONS
	// (the next transaction's AddPartitionsToTxn while the coordinator
	// writes the last one's markers).
	ConcurrentRetries int `json:"concurrent_retries,omitempty"`
}

// txnCycleAcks counts the idempotent path's acknowledgements (the
// stream's records are reported by its commits), and refusals, which
// fail the phase.
type txnCycleAcks struct{ n, refused atomic.Int64 }

func (h *txnCycleAcks) Acked(msgs []*kafka.Message, _ int64) { h.n.Add(int64(len(msgs))) }
func (h *txnCycleAcks) Refused(*kafka.Message, error)        { h.refused.Add(1) }

// txnCycle is the phase: idempotent and transactional alternate, trials
// times each.
func (bx *bench) txnCycle() {
	t, st := bx.t, bx.st
	core, logs := observer.New(zapcore.DebugLevel)
	cfg := kafka.DefaultProducerConfig()
	cfg.Logger = zap.New(core)
	acks := &txnCycleAcks{}
	p, err := kafka.NewProducer(t.Context(), "B", config.Cluster{Brokers: []string{st.b.addr}, Version: config.DefaultKafkaVersion}, cfg, acks)
	if err != nil {
		fatal(t, err)
	}
	defer func() { _ = p.Close(context.Background()) }()
	for i := 1; i <= bx.scale.RelayTrials; i++ {
		for _, mode := range []string{"idempotent", "transactional", "alternating"} {
			topic := fmt.Sprintf("txncycle-%s-%d", mode, i)
			st.b.createTopic(t, topic, 4)
			acks.n.Store(0)
			logs.TakeAll()
			tr := bx.txnCycleRun(p, acks, mode, i, topic)
			for _, e := range logs.TakeAll() {
				if strings.Contains(e.Message, "retrying") && strings.Contains(fmt.Sprint(e.ContextMap()["error"]), "concurrent operation") {
					tr.ConcurrentRetries++
				}
			}
			t.Logf("txncycle %-13s trial %d: %.0f records/s, %d commits of %.1f ms, %d CONCURRENT_TRANSACTIONS retries",
				mode, i, tr.RecordsPerSecond, tr.Commits, tr.CommitMillis, tr.ConcurrentRetries)
			bx.res.TxnCycle = append(bx.res.TxnCycle, tr)
		}
	}
}

// txnCycleRun produces txnCycleRecords records of 1 KiB to topic in one
// mode and returns the rate from the first to the last settled.
func (bx *bench) txnCycleRun(p *kafka.Producer, acks *txnCycleAcks, mode string, trial int, topic string) txnCycleTrial {
	t := bx.t
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	tr := txnCycleTrial{Mode: mode, Trial: trial, Records: txnCycleRecords}
	produce := p.Produce
	var s *kafka.TxnStream
	var committed atomic.Int64
	settled := acks.n.Load
	type commit struct {
		stream int
		last   *kafka.Message // nil: none
	}
	commits := make(chan commit, 1)
	done := make(chan error, 1)
	var commitTime time.Duration
	var failed atomic.Pointer[error] // a Commit's error
	var streams [2]*kafka.TxnStream
	cur := 0
	if mode != "idempotent" {
		var err error
		if s, err = p.OpenTxn(ctx, kafka.DefaultTxnConfig(topic)); err != nil {
			fatal(t, err)
		}
		defer func() { _ = s.Close(context.Background()) }()
		streams[0], streams[1] = s, s
		if mode == "alternating" {
			if streams[1], err = p.OpenTxn(ctx, kafka.DefaultTxnConfig(topic+"/2")); err != nil {
				fatal(t, err)
			}
			defer func() { _ = streams[1].Close(context.Background()) }()
			commits = make(chan commit) // a commit is taken only by an idle committer
		}
		settled = committed.Load
		produce = func(m *kafka.Message) error { return streams[cur].Produce(m) }
		// The committer: one Commit at a time, as routing's. It ends when
		// commits is closed, at a Commit's error, or with ctx (this
		// function's: a fatal return of the producing loop).
		go func() {
			var err error
		loop:
			for {
				select {
				case c, ok := <-commits:
					if !ok {
						break loop
					}
					at := time.Now()
					var msgs []*kafka.Message
					if msgs, err = streams[c.stream].Commit(ctx, c.last); err != nil {
						break loop
					}
					commitTime += time.Since(at)
					tr.Commits++
					committed.Add(int64(len(msgs)))
				case <-ctx.Done():
					err = ctx.Err()
					break loop
				}
			}
			if err != nil {
				failed.Store(&err) // the producing loop stops at once
			}
			done <- err
		}()
	} else {
		close(done)
	}
	value := make([]byte, 1024)
	start := time.Now()
	bytes := 0
	// ask asks the committer for a commit of the current stream, with
	// last as its last record, unless it is busy.
	ask := func(last *kafka.Message) bool {
		select {
		case commits <- commit{cur, last}:
			bytes = 0
			if mode == "alternating" {
				cur = 1 - cur
			}
			return true
		default: // a commit is in progress: the records go to the next transaction
			return false
		}
	}
	for i := range txnCycleRecords {
		for int64(i)-settled() >= txnCycleHeld {
			if s != nil && bytes >= txnCycleCommitBytes && ask(nil) {
				continue
			}
			if err := failed.Load(); err != nil {
				fatalf(t, "txncycle %s: Commit: %v", mode, *err)
			}
			if ctx.Err() != nil {
				fatalf(t, "txncycle %s: %d of %d records settled after 5 min", mode, settled(), i)
			}
			time.Sleep(50 * time.Microsecond) // a budget's wait, polled: the rate, not a condition
		}
		m := &kafka.Message{Topic: topic, Partition: int32(i % 4), Value: value}
		if bytes += len(value); s != nil && bytes >= txnCycleCommitBytes && ask(m) {
			continue
		}
		if err := produce(m); err != nil {
			fatal(t, err)
		}
	}
	if s != nil {
		close(commits)
		if err := <-done; err != nil {
			fatal(t, err)
		}
		msgs, err := streams[cur].Commit(ctx, nil)
		if err != nil {
			fatal(t, err)
		}
		tr.Commits++
		committed.Add(int64(len(msgs)))
	}
	waitFor(t, 2*time.Minute, "every record settled", func() error {
		if n := settled(); n < txnCycleRecords {
			return fmt.Errorf("%d of %d settled", n, txnCycleRecords)
		}
		return nil
	})
	if n := acks.refused.Load(); n > 0 {
		fatalf(t, "txncycle %s: %d records refused", mode, n)
	}
	tr.RecordsPerSecond = round1(txnCycleRecords / time.Since(start).Seconds())
	if tr.Commits > 0 {
		tr.CommitMillis = round3(float64(commitTime.Microseconds()) / 1000 / float64(tr.Commits))
	}
	return tr
}

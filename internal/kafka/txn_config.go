package kafka

import (
	"errors"
	"fmt"
	"time"
)

// TxnConfig adjusts a TxnStream. Start from DefaultTxnConfig.
type TxnConfig struct {
	// ID is the transactional id. Required.
	ID string
	// TxnTimeout is the transaction timeout given to the coordinator in
	// InitProducerID: it aborts a transaction left open longer (an
	// owner gone). Default 60 s.
	TxnTimeout time.Duration
	// RetryTimeout bounds how long one coordinator request is tried
	// again while the coordinator loads, moves, or still ends the
	// transaction before (CONCURRENT_TRANSACTIONS): then OpenTxn fails,
	// or the stream is broken. Default 10 s.
	RetryTimeout time.Duration
}

// DefaultTxnConfig returns the defaults documented on TxnConfig for the
// transactional id id.
func DefaultTxnConfig(id string) TxnConfig {
	return TxnConfig{ID: id, TxnTimeout: time.Minute, RetryTimeout: 10 * time.Second}
}

// Validate reports a setting out of range.
func (c TxnConfig) Validate() error {
	switch {
	case c.ID == "":
		return errors.New("kafka: transactional stream: ID is empty")
	case c.TxnTimeout < time.Millisecond || c.TxnTimeout > time.Duration(1<<31-1)*time.Millisecond:
		return fmt.Errorf("kafka: transactional stream %s: TxnTimeout %s is not within 1 ms..24 days", c.ID, c.TxnTimeout)
	case c.RetryTimeout <= 0:
		return fmt.Errorf("kafka: transactional stream %s: RetryTimeout %s is not positive", c.ID, c.RetryTimeout)
	}
	return nil
}

package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/keys"
)

// maxSwitchEventSize bounds what is parsed from history/: an event lists a
// translation per partition, so it grows with the topics, but a value
// written there by a stranger must not make a leader allocate without
// bound.
const maxSwitchEventSize = 4 << 20

// An event whose JSON is over historyInlineBytes keeps its partitions in
// chunks of historyChunk (about 300 kB each), well under etcd's default
// request limit of 1.5 MiB.
// A value under history/ may claim at most maxHistoryChunks chunks
// (4 million partitions): a stranger's count must not make a reader
// allocate without bound.
const (
	historyInlineBytes = 512 << 10
	historyChunk       = 1000
	maxHistoryChunks   = 4096
)

// ParseSwitchEvent decodes and checks a history/<epoch> value.
func ParseSwitchEvent(val []byte) (SwitchEvent, error) {
	var ev SwitchEvent
	if len(val) > maxSwitchEventSize {
		return ev, fmt.Errorf("coordinator: switch event is %d bytes, over the %d-byte limit", len(val), maxSwitchEventSize)
	}
	if err := json.Unmarshal(val, &ev); err != nil {
		return ev, fmt.Errorf("coordinator: switch event is not valid JSON: %w", err)
	}
	if ev.Epoch <= 0 || ev.To == "" {
		return ev, fmt.Errorf("coordinator: switch event needs a positive epoch and a cluster switched to (epoch %d, to %q)", ev.Epoch, ev.To)
	}
	if ev.PartitionChunks < 0 || ev.PartitionCount < 0 || ev.PartitionChunks > ev.PartitionCount || ev.PartitionChunks > maxHistoryChunks {
		return ev, fmt.Errorf("coordinator: switch event of epoch %d has %d chunks of %d partitions", ev.Epoch, ev.PartitionChunks, ev.PartitionCount)
	}
	return ev, nil
}

// writeHistory records ev at history/<epoch>, fenced by term. A switch of
// more partitions than one value holds writes them first, in chunks under
// history/partitions/<epoch>/ (one fenced transaction each, so that none
// is over etcd's request limit), then the event with their count: a
// reader that finds the event finds its chunks.
func writeHistory(ctx context.Context, term election.Term, k keys.Fleet, ev SwitchEvent) error {
	// An event read back with LoadPartitions holds its partitions again.
	ev.PartitionChunks, ev.PartitionCount, ev.Methods = 0, 0, nil
	val, err := json.Marshal(ev)
	if err != nil {
		return err
	}
	if len(val) > historyInlineBytes {
		parts := ev.Partitions
		ev.Partitions, ev.PartitionCount, ev.Methods = nil, len(parts), map[string]int{}
		for _, p := range parts {
			ev.Methods[p.Method]++
		}
		for chunk := range slices.Chunk(parts, historyChunk) {
			cv, err := json.Marshal(chunk)
			if err != nil {
				return err
			}
			if _, err := term.Txn(ctx, nil, clientv3.OpPut(k.HistoryPartitionChunk(ev.Epoch, ev.PartitionChunks), string(cv))); err != nil {
				return fmt.Errorf("partitions %d-%d of %d: %w", ev.PartitionChunks*historyChunk, ev.PartitionChunks*historyChunk+len(chunk)-1, len(parts), err)
			}
			ev.PartitionChunks++
		}
		if val, err = json.Marshal(ev); err != nil {
			return err
		}
	}
	_, err = term.Txn(ctx, nil, clientv3.OpPut(k.HistoryEvent(ev.Epoch), string(val)))
	return err
}

// LoadPartitions reads back into ev.Partitions the partitions of a switch
// that kept them in chunks (ev.PartitionChunks); an event that holds them
// itself is left as it is.
func LoadPartitions(ctx context.Context, kv clientv3.KV, k keys.Fleet, ev *SwitchEvent) error {
	if ev.PartitionChunks == 0 {
		return nil
	}
	prefix := k.HistoryPartitions(ev.Epoch)
	resp, err := kv.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return fmt.Errorf("coordinator: read the partitions of switch %d: %w", ev.Epoch, err)
	}
	chunks := make([][]PartitionSwitch, ev.PartitionChunks)
	for _, kv := range resp.Kvs {
		n, err := strconv.Atoi(strings.TrimPrefix(string(kv.Key), prefix))
		if err != nil || n < 0 || n >= len(chunks) {
			continue // a chunk of an earlier write with more of them
		}
		if len(kv.Value) > maxSwitchEventSize {
			return fmt.Errorf("coordinator: %s is %d bytes, over the %d-byte limit", kv.Key, len(kv.Value), maxSwitchEventSize)
		}
		if err := json.Unmarshal(kv.Value, &chunks[n]); err != nil {
			return fmt.Errorf("coordinator: %s is not a list of partitions: %w", kv.Key, err)
		}
	}
	parts := slices.Concat(chunks...)
	if len(parts) != ev.PartitionCount {
		return fmt.Errorf("coordinator: switch %d lists %d partitions, %s holds %d of them", ev.Epoch, ev.PartitionCount, prefix, len(parts))
	}
	ev.Partitions = parts
	return nil
}

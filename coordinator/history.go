package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/election"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// An event whose JSON is over historyInlineBytes keeps its partitions in
// chunks of historyChunk (about 300 kB each), well under etcd's default
// request limit of 1.5 MiB (state.LoadPartitions reads them).
const (
	historyInlineBytes = 512 << 10
	historyChunk       = 1000
)

// writeHistory records ev at history/<epoch>, fenced by term. A switch of
// more partitions than one value holds writes them first, in chunks under
// history/partitions/<epoch>/ (one fenced transaction each, so that none
// is over etcd's request limit), then the event with their count: a
// reader that finds the event finds its chunks.
func writeHistory(ctx context.Context, term election.Term, k keys.Fleet, ev state.SwitchEvent) error {
	chunks, event, err := historyOps(k, ev)
	if err != nil {
		return err
	}
	if err := writeChunks(ctx, term, chunks); err != nil {
		return err
	}
	_, err = term.Txn(ctx, nil, event)
	return err
}

// historyOps returns the writes that record ev: the chunks of its
// partitions to write first, each alone (none when the event holds them
// inline), and the event itself.
func historyOps(k keys.Fleet, ev state.SwitchEvent) (chunks []clientv3.Op, event clientv3.Op, err error) {
	// An event read back with LoadPartitions holds its partitions again.
	ev.PartitionChunks, ev.PartitionCount, ev.Methods = 0, 0, nil
	val, err := json.Marshal(ev)
	if err != nil {
		return nil, event, err
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
				return nil, event, err
			}
			chunks = append(chunks, clientv3.OpPut(k.HistoryPartitionChunk(ev.Epoch, ev.PartitionChunks), string(cv)))
			ev.PartitionChunks++
		}
		if val, err = json.Marshal(ev); err != nil {
			return nil, event, err
		}
	}
	return chunks, clientv3.OpPut(k.HistoryEvent(ev.Epoch), string(val)), nil
}

// writeChunks writes the chunks of an event's partitions (historyOps), one
// fenced transaction each.
func writeChunks(ctx context.Context, term election.Term, chunks []clientv3.Op) error {
	for i, op := range chunks {
		if _, err := term.Txn(ctx, nil, op); err != nil {
			return fmt.Errorf("partitions chunk %d of %d (%d partitions each): %w", i+1, len(chunks), historyChunk, err)
		}
	}
	return nil
}

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

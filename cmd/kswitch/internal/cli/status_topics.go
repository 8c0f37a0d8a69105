package cli

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/fleetview"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// statusTopicEvents is how many of the last source topic lifecycle events
// kswitch status shows.
const statusTopicEvents = 10

// topicHistory is what kswitch status shows of history/topics/: the last
// lifecycle events of the fleet's source topics (re-created, partitions
// added or removed), oldest first, and the values refused.
type topicHistory struct {
	events  []state.TopicEvent
	refused []error
}

// readTopicHistory reads the fleet's last topic events. A failed read is
// a warning on warn: the rest of the status stands without them.
func readTopicHistory(ctx context.Context, c *clientv3.Client, fleet string, warn io.Writer) topicHistory {
	evs, bad, err := state.ReadTopicEvents(ctx, c, keys.New(fleet), statusTopicEvents)
	if err != nil {
		fmt.Fprintf(warn, "warning: %v\n", err)
	}
	return topicHistory{events: evs, refused: bad}
}

// statusJSON is kswitch status -o json: the fleet's view and its topic
// events.
type statusJSON struct {
	fleetview.FleetView
	TopicEvents []state.TopicEvent `json:"topic_events,omitempty"`
}

func (h topicHistory) json(v fleetview.FleetView) statusJSON {
	return statusJSON{FleetView: v, TopicEvents: h.events}
}

// print writes the events as a table under the status (nothing when
// there are none).
func (h topicHistory) print(w io.Writer) {
	if len(h.events) > 0 {
		fmt.Fprintf(w, "\nsource topic changes (history/topics/, at most the last %d):\n\n", statusTopicEvents)
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "TIME\tCLUSTER\tTOPIC\tCHANGE")
		for _, ev := range h.events {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", ev.At.UTC().Format(time.RFC3339), ev.Cluster, ev.Topic, ev.Change())
		}
		tw.Flush()
	}
	for _, err := range h.refused {
		fmt.Fprintf(w, "warning: refused %v\n", err)
	}
}

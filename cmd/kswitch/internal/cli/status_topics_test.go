package cli

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// TestStatusListsTopicEvents: kswitch status shows the leader's record of
// source topics re-created or whose partitions changed (history/topics/):
// when, cluster, topic and what changed, in the table and in -o json, and
// names a value it refuses.
func TestStatusListsTopicEvents(t *testing.T) {
	e := testenv.StartEtcdT(t)
	cli := testenv.EtcdClientT(t, e)
	k := keys.New("orders")
	at := time.Date(2026, 12, 5, 10, 0, 0, 0, time.UTC)
	evs := []state.TopicEvent{
		{At: at, Kind: state.TopicPartitionsAdded, Cluster: "A", Topic: "orders", OldPartitions: 12, NewPartitions: 16, Leader: "agent-1"},
		{At: at.Add(time.Minute), Kind: state.TopicRecreated, Cluster: "A", Topic: "orders", OldID: "id-old", NewID: "id-new",
			OldPartitions: 16, NewPartitions: 10, Leader: "agent-2"},
	}
	for _, ev := range evs {
		b, err := json.Marshal(ev)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Put(t.Context(), k.TopicEvent(ev.At.UnixNano()), string(b)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := cli.Put(t.Context(), k.TopicEvent(at.Add(2*time.Minute).UnixNano()), `{"kind":"vanished"}`); err != nil {
		t.Fatal(err)
	}

	env := []string{"KSWITCH_ETCD_ENDPOINTS=" + strings.Join(e.Endpoints(), ","), "KSWITCH_FLEET=orders"}
	code, out, stderr := run(t, env, "status", "--ask=false")
	if code != 0 {
		t.Fatalf("status: exit %d: %s", code, stderr)
	}
	for _, want := range []string{
		"source topic changes (history/topics/",
		"TIME  ", "CLUSTER", "TOPIC", "CHANGE",
		"2026-12-05T10:00:00Z  A        orders  partitions added: 12 -> 16",
		"2026-12-05T10:01:00Z  A        orders  deleted and created again (id id-old -> id-new, 16 -> 10 partitions), consumed from its start",
		"warning: refused " + k.TopicEvent(at.Add(2*time.Minute).UnixNano()),
	} {
		if !strings.Contains(out, want) {
			t.Errorf("status table has no %q:\n%s", want, out)
		}
	}

	code, out, stderr = run(t, env, "status", "--ask=false", "-o", "json")
	if code != 0 {
		t.Fatalf("status -o json: exit %d: %s", code, stderr)
	}
	var got struct {
		Fleet       string             `json:"fleet"`
		TopicEvents []state.TopicEvent `json:"topic_events"`
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatal(err)
	}
	if got.Fleet != "orders" || len(got.TopicEvents) != 2 || got.TopicEvents[1].Kind != state.TopicRecreated ||
		got.TopicEvents[1].NewID != "id-new" || !got.TopicEvents[0].At.Equal(at) {
		t.Errorf("status -o json: fleet %q, topic_events %+v; want the fleet's view and both events, oldest first", got.Fleet, got.TopicEvents)
	}
}

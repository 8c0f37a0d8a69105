package coordinator

import (
	"encoding/json"
	"fmt"
)

// maxSwitchEventSize bounds what is parsed from history/: an event lists a
// translation per partition, so it grows with the topics, but a value
// written there by a stranger must not make a leader allocate without
// bound.
const maxSwitchEventSize = 4 << 20

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
	return ev, nil
}

package coordinator

import (
	"github.com/kswitch/kswitch/state"
)

// revokingPartitions counts the partitions being released in every
// section of a (for logs).
func revokingPartitions(a state.Assignment) int {
	n := 0
	for _, c := range a.Sections() {
		for _, tps := range a.Section(c).Revoking {
			n += len(tps)
		}
	}
	return n
}

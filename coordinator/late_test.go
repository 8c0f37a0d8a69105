package coordinator

import "testing"

// TestLaggedRecordsAreNotLate: the records the fleet consumed on the
// primary just before the failover that the standby lacked are not late,
// wherever the failback's counts meet them. A's orders/1 was consumed up
// to 85 (records 0-84); B's copy (offset +17) ended at 101, lacking A's 84.
func TestLaggedRecordsAreNotLate(t *testing.T) {
	at := atFailover{end: 101, lagged: 1, from: 85}
	for _, c := range []struct {
		name                   string
		standbyPos, primaryPos int64
		want                   int64
	}{
		{"not copied; the failback resumes after it on A", 101, 85, 0},
		{"not copied; the failback resumes at it on A", 101, 84, 1},
		{"copied to B after the failover and consumed there", 102, 85, 1},
	} {
		if got := at.counted(c.standbyPos, c.primaryPos); got != c.want {
			t.Errorf("%s: %d of the lagged record counted, want %d", c.name, got, c.want)
		}
	}
	if got := (atFailover{end: 101, from: 85}).counted(103, 80); got != 0 {
		t.Errorf("no lagged records: %d counted", got)
	}
}

package record

import (
	"context"
	"testing"
)

func TestSameTopic(t *testing.T) {
	for _, tc := range []struct {
		a, b string
		same bool
	}{
		{"", "", true},
		{"", "c1/t1", true},
		{"c1/t1", "", true},
		{"c1/t1", "c1/t1", true},
		{"c1/t1", "c1/t2", false}, // deleted and created again on the same cluster
		{"c1/t1", "c2/t2", true},  // another cluster: rebuilt, or moved to other brokers
		{"t1", "t1", true},        // ids without a cluster's (written before it was recorded)
		{"t1", "t2", false},
		{"t1", "c1/t1", true},
		{"t1", "c1/t2", false},
	} {
		if got := SameTopic(tc.a, tc.b); got != tc.same {
			t.Errorf("SameTopic(%q, %q) = %v, want %v", tc.a, tc.b, got, tc.same)
		}
	}
}

type keeps int

func (keeps) Handle(context.Context, *Record) error { return nil }
func (k keeps) KeptPerRecord() int                  { return int(k) }

func TestKeptPerRecord(t *testing.T) {
	plain := HandlerFunc(func(context.Context, *Record) error { return nil })
	for _, tc := range []struct {
		h    Handler
		want int
	}{
		{plain, DefaultKeptPerRecord}, // says nothing: the routing sink's weight
		{keeps(0), 0},
		{keeps(4096), 4096},
		{keeps(-1), 0},
	} {
		if got := KeptPerRecord(tc.h); got != tc.want {
			t.Errorf("KeptPerRecord(%T %v) = %d, want %d", tc.h, tc.h, got, tc.want)
		}
	}
}

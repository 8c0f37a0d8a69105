package translate

import (
	"encoding/hex"
	"errors"
	"strings"
	"testing"
)

func unhex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.ReplaceAll(s, " ", ""))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// The golden bytes follow Kafka's OffsetSync and Checkpoint schemas
// (connect/mirror): STRING = INT16 length + UTF-8, integers big-endian.
func TestOffsetSyncGolden(t *testing.T) {
	key, value := EncodeOffsetSync("orders", 3, 1042, 77)
	wantKey := unhex(t, "0006 6f7264657273 00000003")
	wantValue := unhex(t, "0000000000000412 000000000000004d")
	if string(key) != string(wantKey) || string(value) != string(wantValue) {
		t.Fatalf("EncodeOffsetSync = %x / %x, want %x / %x", key, value, wantKey, wantValue)
	}
	got, err := DecodeOffsetSync(wantKey, wantValue)
	if err != nil {
		t.Fatal(err)
	}
	if want := (OffsetSync{"orders", 3, 1042, 77}); got != want {
		t.Fatalf("DecodeOffsetSync = %+v, want %+v", got, want)
	}
	// Trailing bytes are ignored, as Kafka's reader does.
	if got, err := DecodeOffsetSync(append(wantKey, 9), append(wantValue, 9)); err != nil || got.Downstream != 77 {
		t.Fatalf("with trailing bytes: %+v, %v", got, err)
	}
}

func TestCheckpointGolden(t *testing.T) {
	key, value := EncodeCheckpoint("g1", "A.orders", 3, 1042, 1000, "m")
	wantKey := unhex(t, "0002 6731 0008 412e6f7264657273 00000003")
	wantValue := unhex(t, "0000 0000000000000412 00000000000003e8 0001 6d")
	if string(key) != string(wantKey) || string(value) != string(wantValue) {
		t.Fatalf("EncodeCheckpoint = %x / %x, want %x / %x", key, value, wantKey, wantValue)
	}
	got, err := DecodeCheckpoint(wantKey, wantValue)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Checkpoint{"g1", "A.orders", 3, 1042, 1000, "m"}); got != want {
		t.Fatalf("DecodeCheckpoint = %+v, want %+v", got, want)
	}
	// Empty metadata (what a commit without metadata gives) and a
	// negative partition number's two's complement round-trip.
	k, v := EncodeCheckpoint("", "t", -1, -1, 0, "")
	if got, err := DecodeCheckpoint(k, v); err != nil || got != (Checkpoint{"", "t", -1, -1, 0, ""}) {
		t.Fatalf("round trip: %+v, %v", got, err)
	}
}

func TestMM2DecodeErrors(t *testing.T) {
	syncKey, syncValue := EncodeOffsetSync("orders", 3, 1, 2)
	cpKey, cpValue := EncodeCheckpoint("g", "A.orders", 3, 1, 2, "meta")
	for _, tc := range []struct {
		name       string
		key, value []byte
		checkpoint bool
		want       string
	}{
		{"sync: empty key", nil, syncValue, false, "too short"},
		{"sync: key cut in the partition", syncKey[:len(syncKey)-1], syncValue, false, "too short"},
		{"sync: key string longer than the key", unhex(t, "0010 6f72"), syncValue, false, "too short"},
		{"sync: negative string length", unhex(t, "ffff 00000003"), syncValue, false, "string length -1"},
		{"sync: short value", syncKey, syncValue[:15], false, "too short"},
		{"checkpoint: short key", cpKey[:5], cpValue, true, "too short"},
		{"checkpoint: version 1", cpKey, append([]byte{0, 1}, cpValue[2:]...), true, "version 1"},
		{"checkpoint: no metadata", cpKey, cpValue[:18], true, "too short"},
		{"checkpoint: metadata cut", cpKey, cpValue[:len(cpValue)-1], true, "too short"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var err error
			if tc.checkpoint {
				_, err = DecodeCheckpoint(tc.key, tc.value)
			} else {
				_, err = DecodeOffsetSync(tc.key, tc.value)
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one saying %q", err, tc.want)
			}
		})
	}
}

func TestEncodeStringTooLong(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Fatal("no panic for a 32768-byte topic")
		}
	}()
	EncodeOffsetSync(strings.Repeat("x", 1<<15), 0, 0, 0)
}

func TestKeepSync(t *testing.T) {
	var syncs []OffsetSync
	for _, s := range []OffsetSync{
		{"t", 0, 10, 100}, {"t", 0, 20, 110}, {"t", 0, 20, 110}, // a repeat is kept
		{"t", 0, 5, 111}, // upstream went back: the source was recreated
		{"t", 0, 8, 120},
		{"t", 0, 9, 3}, // downstream went back: the replica was recreated
		{"t", 0, 12, 6},
	} {
		syncs = keepSync(syncs, s)
	}
	want := []OffsetSync{{"t", 0, 9, 3}, {"t", 0, 12, 6}}
	if len(syncs) != len(want) || syncs[0] != want[0] || syncs[1] != want[1] {
		t.Fatalf("syncs = %+v, want %+v", syncs, want)
	}
}

func TestMM2Translate(t *testing.T) {
	syncs := []OffsetSync{{"orders", 0, 10, 100}, {"orders", 0, 20, 105}, {"orders", 0, 30, 130}}
	t.Run("forward", func(t *testing.T) {
		d := mm2Data{syncs: syncs, cpErr: errors.New("none")}
		for _, tc := range []struct{ pos, want, rewound int64 }{
			{10, 100, 0}, // at a sync: exact
			{11, 101, 0}, // one past it: +1, nothing rewound
			{15, 101, 4}, // 11..14 are delivered again (if all were replicated)
			{20, 105, 0}, // the replica skipped some of 10..19: exact still
			{29, 106, 8}, // at most 8 again
			{30, 130, 0}, //
			{1000, 131, 969},
		} {
			got, err := d.translateForward(tc.pos)
			if err != nil || got.offset != tc.want || got.rewound != tc.rewound {
				t.Errorf("translateForward(%d) = %+v, %v; want %d rewound %d", tc.pos, got, err, tc.want, tc.rewound)
			}
		}
		if _, err := d.translateForward(9); err == nil || !strings.Contains(err.Error(), "no offset-sync at or before upstream offset 9 (oldest kept: 10)") {
			t.Errorf("translateForward(9) error = %v", err)
		}
	})
	t.Run("backward", func(t *testing.T) {
		d := mm2Data{syncs: syncs}
		for _, tc := range []struct{ pos, want, rewound int64 }{
			{100, 10, 0},
			{104, 11, 3},
			{105, 20, 0},
			{129, 21, 23},
			{130, 30, 0},
			{131, 31, 0},
		} {
			got, err := d.translateBackward(tc.pos)
			if err != nil || got.offset != tc.want || got.rewound != tc.rewound {
				t.Errorf("translateBackward(%d) = %+v, %v; want %d rewound %d", tc.pos, got, err, tc.want, tc.rewound)
			}
		}
		if _, err := d.translateBackward(99); err == nil {
			t.Error("translateBackward(99) before every sync succeeded")
		}
		// Checkpoints are never inverted.
		d = mm2Data{syncsErr: errors.New("unreachable"), checkpoint: &Checkpoint{"g", "A.orders", 0, 10, 100, ""}}
		if _, err := d.translateBackward(100); err == nil || !strings.Contains(err.Error(), "unreachable") {
			t.Errorf("translateBackward without syncs = %v", err)
		}
	})
	t.Run("checkpoint", func(t *testing.T) {
		for _, tc := range []struct {
			name          string
			syncs         []OffsetSync
			cp            Checkpoint
			pos           int64
			want, rewound int64
		}{
			{"later than the syncs", syncs, Checkpoint{Upstream: 25, Downstream: 110}, 25, 110, -1},
			{"earlier than the syncs", syncs, Checkpoint{Upstream: 25, Downstream: 103}, 25, 106, 4},
			{"behind the position", syncs, Checkpoint{Upstream: 22, Downstream: 108}, 25, 108, -1},
			{"past the position", syncs, Checkpoint{Upstream: 40, Downstream: 200}, 25, 106, 4},
			{"no syncs", nil, Checkpoint{Upstream: 25, Downstream: 110}, 25, 110, -1},
		} {
			d := mm2Data{syncs: tc.syncs, checkpoint: &tc.cp}
			got, err := d.translateForward(tc.pos)
			if err != nil || got.offset != tc.want || got.rewound != tc.rewound {
				t.Errorf("%s: translateForward(%d) = %+v, %v; want %d rewound %d", tc.name, tc.pos, got, err, tc.want, tc.rewound)
			}
		}
		d := mm2Data{syncsErr: errors.New("no client"), checkpoint: &Checkpoint{Upstream: 40, Downstream: 200}}
		_, err := d.translateForward(25)
		if err == nil || !strings.Contains(err.Error(), "no client") || !strings.Contains(err.Error(), "past position 25") {
			t.Errorf("nothing usable: %v", err)
		}
	})
}

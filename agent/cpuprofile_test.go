package agent_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"runtime/pprof"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
)

// cpuByLabel sums the CPU time of a runtime/pprof CPU profile (gzipped
// profile.proto) whose samples carry the label key=value, and of all of
// them. It reads only what it needs of the format: samples (field 2: their
// values, field 2, and labels, field 3) and the string table (field 6).
func cpuByLabel(profile []byte, key, value string) (labelled, total time.Duration, err error) {
	zr, err := gzip.NewReader(bytes.NewReader(profile))
	if err != nil {
		return 0, 0, err
	}
	data, err := io.ReadAll(zr)
	if err != nil {
		return 0, 0, err
	}
	type label struct{ key, str uint64 }
	type sample struct {
		values []uint64
		labels []label
	}
	var (
		strs    []string
		samples []sample
	)
	bad := errors.New("agent: malformed CPU profile")
	for len(data) > 0 {
		num, typ, n := protowire.ConsumeTag(data)
		if n < 0 {
			return 0, 0, bad
		}
		data = data[n:]
		switch {
		case num == 2 && typ == protowire.BytesType:
			b, n := protowire.ConsumeBytes(data)
			if n < 0 {
				return 0, 0, bad
			}
			data = data[n:]
			var s sample
			for len(b) > 0 {
				f, t, m := protowire.ConsumeTag(b)
				if m < 0 {
					return 0, 0, bad
				}
				b = b[m:]
				switch {
				case f == 2 && t == protowire.BytesType: // packed values
					vs, m := protowire.ConsumeBytes(b)
					if m < 0 {
						return 0, 0, bad
					}
					b = b[m:]
					for len(vs) > 0 {
						v, k := protowire.ConsumeVarint(vs)
						if k < 0 {
							return 0, 0, bad
						}
						s.values, vs = append(s.values, v), vs[k:]
					}
				case f == 2 && t == protowire.VarintType:
					v, m := protowire.ConsumeVarint(b)
					if m < 0 {
						return 0, 0, bad
					}
					s.values, b = append(s.values, v), b[m:]
				case f == 3 && t == protowire.BytesType:
					lb, m := protowire.ConsumeBytes(b)
					if m < 0 {
						return 0, 0, bad
					}
					b = b[m:]
					var l label
					for len(lb) > 0 {
						lf, lt, k := protowire.ConsumeTag(lb)
						if k < 0 {
							return 0, 0, bad
						}
						lb = lb[k:]
						if lt != protowire.VarintType {
							k = protowire.ConsumeFieldValue(lf, lt, lb)
							if k < 0 {
								return 0, 0, bad
							}
							lb = lb[k:]
							continue
						}
						v, k := protowire.ConsumeVarint(lb)
						if k < 0 {
							return 0, 0, bad
						}
						lb = lb[k:]
						switch lf {
						case 1:
							l.key = v
						case 2:
							l.str = v
						}
					}
					s.labels = append(s.labels, l)
				default:
					m := protowire.ConsumeFieldValue(f, t, b)
					if m < 0 {
						return 0, 0, bad
					}
					b = b[m:]
				}
			}
			samples = append(samples, s)
		case num == 6 && typ == protowire.BytesType:
			str, n := protowire.ConsumeString(data)
			if n < 0 {
				return 0, 0, bad
			}
			strs, data = append(strs, str), data[n:]
		default:
			n := protowire.ConsumeFieldValue(num, typ, data)
			if n < 0 {
				return 0, 0, bad
			}
			data = data[n:]
		}
	}
	name := func(i uint64) string {
		if i < uint64(len(strs)) {
			return strs[i]
		}
		return ""
	}
	for _, s := range samples {
		// A CPU profile's values are samples/count and cpu/nanoseconds.
		if len(s.values) < 2 {
			return 0, 0, fmt.Errorf("agent: CPU profile sample with %d values, want 2", len(s.values))
		}
		ns := time.Duration(s.values[1])
		total += ns
		for _, l := range s.labels {
			if name(l.key) == key && name(l.str) == value {
				labelled += ns
				break
			}
		}
	}
	return labelled, total, nil
}

// TestCPUByLabelSeesTheLabelledGoroutines: of two goroutines spinning
// for the same time, the labelled one has about half the profile's CPU.
func TestCPUByLabelSeesTheLabelledGoroutines(t *testing.T) {
	var buf bytes.Buffer
	if err := pprof.StartCPUProfile(&buf); err != nil {
		t.Skipf("a CPU profile is running already: %v", err) // go test -cpuprofile
	}
	spin := func(d time.Duration) {
		for end := time.Now().Add(d); time.Now().Before(end); {
		}
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		pprof.Do(context.Background(), pprof.Labels("kswitch_role", "leader"), func(context.Context) { spin(time.Second) })
	})
	wg.Go(func() { spin(time.Second) })
	wg.Wait()
	pprof.StopCPUProfile()
	leader, total, err := cpuByLabel(buf.Bytes(), "kswitch_role", "leader")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("labelled %v of %v", leader, total)
	// At 100 samples a second, with other tests on the same cores.
	if total < 100*time.Millisecond || leader < total/5 || leader > total*4/5 {
		t.Errorf("labelled %v of %v, want about half of at least 100 ms", leader, total)
	}
}

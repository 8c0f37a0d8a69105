package mirror

import (
	"testing"
	"time"

	"github.com/IBM/sarama"
)

func TestDebugFail(t *testing.T) {
	a, b := pair(t, map[string]int32{"orders": 1})
	_ = a
	if err := b.CreateTopic("orders", 1); err != nil {
		t.Fatal(err)
	}
	cl, err := sarama.NewClient(b.Brokers(), Config{Version: sarama.V3_6_0_0}.saramaConfig(newDialer()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	b.Fail()
	for i := range 10 {
		start := time.Now()
		_, err := produce(cl, sarama.V3_6_0_0, "orders", 0, []record{{value: []byte("x"), ts: 1}})
		h, err2 := cl.GetOffset("orders", 0, sarama.OffsetNewest)
		t.Logf("%d: produce %v; hwm %d %v (%v)", i, err, h, err2, time.Since(start))
		time.Sleep(50 * time.Millisecond)
	}
}

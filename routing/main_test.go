package routing

import (
	"fmt"
	"os"
	"testing"

	"github.com/kswitch/kswitch/internal/testenv"
	"github.com/kswitch/kswitch/internal/wait"
	"github.com/kswitch/kswitch/keys"
)

func TestMain(m *testing.M) {
	// KSWITCH_RELAY_PATH=direct|sarama runs every router the tests and
	// benchmarks start without Options.Produce on that path.
	switch p := os.Getenv("KSWITCH_RELAY_PATH"); p {
	case "":
	case ProduceSarama, ProduceDirect:
		defaultProduce = p
	default:
		fmt.Fprintf(os.Stderr, "KSWITCH_RELAY_PATH=%q: want %q or %q\n", p, ProduceDirect, ProduceSarama)
		os.Exit(2)
	}
	wait.VerifyTestMain(m, testenv.LeakOptions()...)
}

var testKeys = keys.New("test")

package routing

import (
	"testing"

	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
)

func TestMain(m *testing.M) {
	wait.VerifyTestMain(m, testenv.LeakOptions()...)
}

var testKeys = keys.New("test")

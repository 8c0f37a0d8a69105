package routing

import (
	"testing"

	"github.com/kswitch/kswitch/internal/keys"
	"github.com/kswitch/kswitch/internal/testenv"
	"github.com/kswitch/kswitch/internal/wait"
)

func TestMain(m *testing.M) {
	wait.VerifyTestMain(m, testenv.LeakOptions()...)
}

var testKeys = keys.New("test")

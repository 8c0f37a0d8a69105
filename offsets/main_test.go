package offsets

import (
	"testing"

	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

func TestMain(m *testing.M) {
	wait.VerifyTestMain(m, testenv.LeakOptions()...)
}

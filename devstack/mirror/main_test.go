package mirror

import (
	"testing"

	"github.com/kswitch/kswitch/internal/testenv"
	"github.com/kswitch/kswitch/internal/wait"
)

func TestMain(m *testing.M) {
	wait.VerifyTestMain(m, testenv.LeakOptions()...)
}

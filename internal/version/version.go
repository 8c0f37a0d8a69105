// Package version reports the build's version.
package version

import (
	"runtime"
	"runtime/debug"
)

// Version is set at build time with
// -ldflags "-X github.com/kswitch/kswitch/internal/version.Version=v1.2.3".
var Version = "dev"

// String returns the version, the VCS revision when known, and the Go version.
func String() string {
	s := Version
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, kv := range info.Settings {
			if kv.Key == "vcs.revision" && len(kv.Value) >= 12 {
				s += " (" + kv.Value[:12] + ")"
			}
		}
	}
	return s + " " + runtime.Version()
}

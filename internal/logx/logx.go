// Package logx builds the zap loggers of kswitch's commands.
package logx

import (
	"fmt"
	"os"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// New returns a logger writing to stderr: format "json" (one JSON object a
// line, for log shippers) or "console" (human-readable); level one of
// debug, info, warn, error.
func New(format, level string) (*zap.Logger, error) {
	lvl, err := zapcore.ParseLevel(level)
	if err != nil {
		return nil, fmt.Errorf("log.level %q: use debug, info, warn or error", level)
	}
	encCfg := zap.NewProductionEncoderConfig()
	encCfg.TimeKey = "ts"
	encCfg.EncodeTime = zapcore.ISO8601TimeEncoder
	var enc zapcore.Encoder
	switch format {
	case "json", "":
		enc = zapcore.NewJSONEncoder(encCfg)
	case "console":
		encCfg.EncodeLevel = zapcore.CapitalLevelEncoder
		encCfg.EncodeTime = zapcore.TimeEncoderOfLayout("15:04:05.000")
		enc = zapcore.NewConsoleEncoder(encCfg)
	default:
		return nil, fmt.Errorf("log.format %q: use json or console", format)
	}
	core := zapcore.NewCore(enc, zapcore.Lock(os.Stderr), lvl)
	return zap.New(core, zap.AddCaller()), nil
}

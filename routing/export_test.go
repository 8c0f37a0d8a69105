package routing

// SetDefaultProduce makes p the produce path of the routers created
// without Options.Produce (those inside an agent, for the benchmarks)
// until restore is called. Not for concurrent use with New.
func SetDefaultProduce(p string) (restore func()) {
	old := defaultProduce
	defaultProduce = p
	return func() { defaultProduce = old }
}

// DefaultProduce returns the produce path of the routers created without
// Options.Produce (KSWITCH_RELAY_PATH, else direct).
func DefaultProduce() string { return defaultProduce }

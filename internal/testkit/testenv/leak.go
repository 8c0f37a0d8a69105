package testenv

import "go.uber.org/goleak"

// IgnoreEtcd lists goroutines that the etcd server and client libraries
// leave running for the life of the process after every server is stopped
// and every client closed. With etcd v3.7.3 there are none: Etcd.Stop waits
// for all of the server's goroutines and clientv3.Client.Close for the
// client's (checked by this package's tests). The list exists so callers
// need not change when an upgrade adds one.
var IgnoreEtcd = []goleak.Option{}

// IgnoreSarama lists goroutines that sarama leaves running for the life of
// the process.
//
// github.com/rcrowley/go-metrics.(*meterArbiter).tick: sarama registers
// go-metrics meters for every client; the first meter starts one global
// ticker goroutine in go-metrics that never exits (sarama's own tests ignore
// it the same way). Setting metrics.UseNilMetrics = true before the first
// client avoids it, at the cost of sarama's metrics.
var IgnoreSarama = []goleak.Option{
	goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
}

// IgnoreKafka lists goroutines that kfake or franz-go leave running for the
// life of the process. With the kfake and franz-go versions in go.mod there
// are none: after Kafka.Stop, kfake's remaining goroutines exit within
// milliseconds, which goleak's retries absorb. The list exists so callers
// need not change when an upgrade adds one.
var IgnoreKafka = []goleak.Option{}

// LeakOptions returns IgnoreEtcd, IgnoreSarama and IgnoreKafka together, for
// goleak.VerifyTestMain(m, testenv.LeakOptions()...) in packages that use
// this environment.
func LeakOptions() []goleak.Option {
	var opts []goleak.Option
	opts = append(opts, IgnoreEtcd...)
	opts = append(opts, IgnoreSarama...)
	opts = append(opts, IgnoreKafka...)
	return opts
}

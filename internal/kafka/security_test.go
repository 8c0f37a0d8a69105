package kafka_test

import (
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

func TestMain(m *testing.M) {
	wait.VerifyTestMain(m, testenv.LeakOptions()...)
}

const (
	user = "fleet"
	pass = "kafka-S3cret-pw"
)

// TestSASLAndTLS: each SASL mechanism, over plain TCP and over TLS with a
// client certificate, connects and produces; a wrong password is refused
// at once, not after a timeout, and for SCRAM with an error that says so.
func TestSASLAndTLS(t *testing.T) {
	t.Parallel()
	pki, err := devstack.NewPKI(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	tlsOpt, err := devstack.KafkaTLS(pki)
	if err != nil {
		t.Fatal(err)
	}
	client, err := pki.Issue("kafka-client", user)
	if err != nil {
		t.Fatal(err)
	}
	for _, mech := range []string{config.SASLPlain, config.SASLScramSHA256, config.SASLScramSHA512} {
		for _, withTLS := range []bool{false, true} {
			name := mech
			extra := devstack.KafkaSASL(mech, user, pass)
			if withTLS {
				name += "+TLS"
				extra = append(extra, tlsOpt)
			}
			t.Run(name, func(t *testing.T) {
				k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 1}, Extra: extra})
				c := config.Cluster{Brokers: k.Brokers(), Role: config.RolePrimary, Version: config.DefaultKafkaVersion,
					SASL: config.SASL{Mechanism: mech, Username: user, Password: pass}}
				if withTLS {
					c.TLS = config.TLS{CAFile: pki.CAFile, CertFile: client.CertFile, KeyFile: client.KeyFile}
				}
				cl, err := kafka.NewClient("A", c)
				if err != nil {
					t.Fatal(err)
				}
				defer cl.Close()
				if _, err := cl.GetOffset("orders", 0, sarama.OffsetNewest); err != nil {
					t.Errorf("list offsets: %v", err)
				}
				// Producers get the same settings from Config.
				sc, err := kafka.Config(c)
				if err != nil {
					t.Fatal(err)
				}
				sc.Producer.Return.Successes = true
				p, err := sarama.NewSyncProducer(c.Brokers, sc)
				if err != nil {
					t.Fatal(err)
				}
				if _, _, err := p.SendMessage(&sarama.ProducerMessage{Topic: "orders", Value: sarama.StringEncoder("x")}); err != nil {
					t.Errorf("produce: %v", err)
				}
				_ = p.Close()

				c.SASL.Password = "wrong"
				began := time.Now()
				_, err = kafka.NewClient("A", c)
				want := `kafka: SASL authentication failed on cluster A as user "fleet" (` + mech + `)`
				if mech == config.SASLPlain {
					// kfake closes the connection on a wrong PLAIN
					// password, which sarama reports as a bare EOF (Kafka
					// answers SASL_AUTHENTICATION_FAILED, explained as
					// above); only SCRAM's exchange is traced.
					want = "kafka: connect to cluster A"
				}
				if err == nil || !strings.HasPrefix(err.Error(), want) {
					t.Errorf("wrong password: %v, want an error starting %q", err, want)
				}
				if took := time.Since(began); took > 3*time.Second {
					t.Errorf("wrong password refused after %v: a timeout, not the refusal", took)
				}
			})
		}
	}
}

// TestTLSUntrustedServer: a broker whose certificate the configured CA
// did not sign is refused.
func TestTLSUntrustedServer(t *testing.T) {
	t.Parallel()
	pki, err := devstack.NewPKI(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	other, err := devstack.NewPKI(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	tlsOpt, err := devstack.KafkaTLS(pki)
	if err != nil {
		t.Fatal(err)
	}
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Extra: []kfake.Opt{tlsOpt}})
	c := config.Cluster{Brokers: k.Brokers(), Role: config.RolePrimary, Version: config.DefaultKafkaVersion, TLS: config.TLS{CAFile: other.CAFile}}
	_, err = kafka.NewClient("A", c)
	if err == nil || !strings.Contains(err.Error(), "certificate signed by unknown authority") {
		t.Errorf("untrusted broker: %v, want an unknown-authority error", err)
	}
}

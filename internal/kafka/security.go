package kafka

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/kswitch/kswitch/config"
)

// applySecurity sets cluster c's TLS and SASL on sc. It is called by
// Config, so every client of kswitch (consumers, probes, the translator,
// the group mirror, routing producers) gets them. Errors name the field
// below the cluster (sasl.password_file); callers name the cluster. The
// trace it returns follows the SCRAM exchanges of the clients made with
// sc (nil without SCRAM).
func applySecurity(sc *sarama.Config, c config.Cluster) (*saslTrace, error) {
	tc, err := c.TLS.ClientConfig("tls")
	if err != nil {
		return nil, err
	}
	if tc != nil {
		sc.Net.TLS.Enable = true
		sc.Net.TLS.Config = tc
	}
	if c.SASL.Mechanism == "" {
		return nil, nil
	}
	user, pass, err := c.SASL.Credentials("sasl")
	if err != nil {
		return nil, err
	}
	sc.Net.SASL.Enable = true
	sc.Net.SASL.Handshake = true
	sc.Net.SASL.User = user
	sc.Net.SASL.Password = pass.Reveal()
	trace := &saslTrace{}
	switch c.SASL.Mechanism {
	case config.SASLPlain:
		sc.Net.SASL.Mechanism = sarama.SASLTypePlaintext
		return nil, nil
	case config.SASLScramSHA256:
		sc.Net.SASL.Mechanism = sarama.SASLTypeSCRAMSHA256
		sc.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return &scramClient{newMech: scram.Sha256, trace: trace} }
	case config.SASLScramSHA512:
		sc.Net.SASL.Mechanism = sarama.SASLTypeSCRAMSHA512
		sc.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return &scramClient{newMech: scram.Sha512, trace: trace} }
	default:
		return nil, fmt.Errorf("kafka: sasl.mechanism %q is not PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512", c.SASL.Mechanism)
	}
	return trace, nil
}

// saslTrace tells whether the latest SCRAM exchange of a client was begun
// and not finished. Kafka answers wrong credentials with
// SASL_AUTHENTICATION_FAILED, but a broker may also just close the
// connection (kfake does), which sarama reports as a bare EOF; the trace
// tells that EOF from a broker that is down.
type saslTrace struct{ unfinished atomic.Bool }

// scramClient is sarama's SCRAMClient over franz-go's SCRAM (RFC 5802)
// implementation, which is already part of the module graph through kfake
// and keeps the protocol's details (nonce, salted password, server
// signature check) out of kswitch. One is made per connection.
//
// sarama calls Begin, then Step("") for the client-first message, then Step
// with each server message until Done.
type scramClient struct {
	trace   *saslTrace
	newMech func(func(context.Context) (scram.Auth, error)) sasl.Mechanism
	mech    sasl.Mechanism
	session sasl.Session
	first   []byte
	done    bool
}

func (s *scramClient) Begin(user, password, authzID string) error {
	s.mech = s.newMech(func(context.Context) (scram.Auth, error) {
		return scram.Auth{User: user, Pass: password, Zid: authzID}, nil
	})
	session, first, err := s.mech.Authenticate(context.Background(), "")
	if err != nil {
		return err
	}
	s.session, s.first = session, first
	s.trace.unfinished.Store(true)
	return nil
}

func (s *scramClient) Step(challenge string) (string, error) {
	if s.session == nil {
		return "", errors.New("kafka: SCRAM step before begin")
	}
	if s.first != nil {
		first := s.first
		s.first = nil
		return string(first), nil
	}
	done, msg, err := s.session.Challenge([]byte(challenge))
	if err != nil {
		return "", err
	}
	s.done = done
	if done {
		s.trace.unfinished.Store(false)
	}
	return string(msg), nil
}

func (s *scramClient) Done() bool { return s.done }

// explain says what a failure to connect to cluster name means when it is
// about security rather than reachability: SASL credentials refused, or
// the cluster not authorizing this client. Other errors get "". trace is
// the client's (may be nil).
func explain(err error, trace *saslTrace, name string, c config.Cluster) string {
	switch {
	case errors.Is(err, sarama.ErrSASLAuthenticationFailed):
		return fmt.Sprintf("SASL authentication failed on cluster %s as user %q (%s): check clusters.%s.sasl", name, c.SASL.Username, c.SASL.Mechanism, name)
	case trace != nil && trace.unfinished.Load():
		return fmt.Sprintf("SASL authentication failed on cluster %s as user %q (%s): the broker closed the connection during the exchange, as it does for wrong credentials; check clusters.%s.sasl",
			name, c.SASL.Username, c.SASL.Mechanism, name)
	case errors.Is(err, sarama.ErrUnsupportedSASLMechanism):
		return fmt.Sprintf("cluster %s does not accept SASL mechanism %s: set clusters.%s.sasl.mechanism to one its brokers enable", name, c.SASL.Mechanism, name)
	case errors.Is(err, sarama.ErrIllegalSASLState):
		return fmt.Sprintf("cluster %s refused the SASL exchange: is SASL enabled on its listener?", name)
	case errors.Is(err, sarama.ErrClusterAuthorizationFailed), errors.Is(err, sarama.ErrTopicAuthorizationFailed):
		return fmt.Sprintf("cluster %s does not authorize user %q: grant it the ACLs in docs/SECURITY.md", name, c.SASL.Username)
	}
	return ""
}

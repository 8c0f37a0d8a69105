package devstack

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// PKI is a throwaway certificate authority for tests: a CA, and the
// certificates it issues, written as PEM files to a directory the caller
// owns, so that code configured with file paths can load them. Nothing is
// checked in: every run makes new keys (ECDSA P-256, quick to generate).
type PKI struct {
	dir string
	// CAFile is the PEM file of the CA certificate.
	CAFile string
	ca     *x509.Certificate
	caKey  *ecdsa.PrivateKey
	pool   *x509.CertPool
}

// Cert is a certificate issued by a PKI, in files and in memory.
type Cert struct {
	CertFile, KeyFile string
	TLS               tls.Certificate
}

// NewPKI makes a CA valid for a day and writes it to dir/ca.pem.
func NewPKI(dir string) (*PKI, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("devstack: pki: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "kswitch test CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("devstack: pki: %w", err)
	}
	ca, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("devstack: pki: %w", err)
	}
	p := &PKI{dir: dir, CAFile: filepath.Join(dir, "ca.pem"), ca: ca, caKey: key, pool: x509.NewCertPool()}
	p.pool.AddCert(ca)
	if err := writePEM(p.CAFile, "CERTIFICATE", der); err != nil {
		return nil, err
	}
	return p, nil
}

// Issue makes a certificate with common name cn (the user name etcd takes
// from a client certificate), usable by a server on localhost, 127.0.0.1
// and ::1 and by a client, and writes it to dir/<name>.pem and its key to
// dir/<name>-key.pem (mode 0600).
func (p *PKI) Issue(name, cn string) (Cert, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return Cert{}, fmt.Errorf("devstack: pki: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return Cert{}, fmt.Errorf("devstack: pki: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		DNSNames:     []string{"localhost"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca, &key.PublicKey, p.caKey)
	if err != nil {
		return Cert{}, fmt.Errorf("devstack: pki: issue %s: %w", name, err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return Cert{}, fmt.Errorf("devstack: pki: issue %s: %w", name, err)
	}
	c := Cert{
		CertFile: filepath.Join(p.dir, name+".pem"),
		KeyFile:  filepath.Join(p.dir, name+"-key.pem"),
		TLS:      tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key},
	}
	if err := writePEM(c.CertFile, "CERTIFICATE", der); err != nil {
		return Cert{}, err
	}
	if err := writePEM(c.KeyFile, "EC PRIVATE KEY", keyDER); err != nil {
		return Cert{}, err
	}
	return c, nil
}

// ClientTLS returns a client configuration that trusts the CA and, when
// c is given, presents it.
func (p *PKI) ClientTLS(c *Cert) *tls.Config {
	t := &tls.Config{RootCAs: p.pool, MinVersion: tls.VersionTLS12}
	if c != nil {
		t.Certificates = []tls.Certificate{c.TLS}
	}
	return t
}

// ServerTLS returns a server configuration presenting c.
func (p *PKI) ServerTLS(c Cert) *tls.Config {
	return &tls.Config{Certificates: []tls.Certificate{c.TLS}, MinVersion: tls.VersionTLS12}
}

func writePEM(file, typ string, der []byte) error {
	if err := os.WriteFile(file, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		return fmt.Errorf("devstack: pki: %w", err)
	}
	return nil
}

// EtcdSecurity is how a secure etcd (StartSecureEtcd) serves: TLS on its
// client port, client certificates required and their common name taken as
// the user when a request carries no token, and auth enabled.
type EtcdSecurity struct {
	// PKI issued the server's certificate; clients must trust its CA and
	// present a certificate it issued.
	PKI *PKI
	// Root is a client certificate for etcd's root user (common name
	// "root"): Etcd.Client uses it.
	Root   Cert
	server Cert
}

// apply sets the TLS listener on cfg, whose client URLs start as http.
func (s *EtcdSecurity) apply(cfg *embed.Config) {
	for i := range cfg.ListenClientUrls {
		cfg.ListenClientUrls[i].Scheme = "https"
	}
	for i := range cfg.AdvertiseClientUrls {
		cfg.AdvertiseClientUrls[i].Scheme = "https"
	}
	cfg.ClientTLSInfo = transport.TLSInfo{
		CertFile: s.server.CertFile, KeyFile: s.server.KeyFile,
		TrustedCAFile: s.PKI.CAFile, ClientCertAuth: true,
	}
	// Tests authenticate often: the cheapest bcrypt keeps that fast.
	cfg.BcryptCost = 4 // bcrypt.MinCost
}

// StartSecureEtcd starts an etcd as StartEtcd does, with TLS, client
// certificates and auth (EtcdSecurity), certificates from pki, and a root
// user that authenticates by its certificate (Security().Root). Add users
// with AddUser. Client, as well as Restart, keep working: Client returns
// a root client.
func StartSecureEtcd(dir string, logger *zap.Logger, pki *PKI) (*Etcd, error) {
	server, err := pki.Issue("etcd-server", "etcd-server")
	if err != nil {
		return nil, err
	}
	root, err := pki.Issue("etcd-root", "root")
	if err != nil {
		return nil, err
	}
	e, err := startEtcd(dir, logger, &EtcdSecurity{PKI: pki, Root: root, server: server}, 0)
	if err != nil {
		return nil, err
	}
	if err := e.enableAuth(); err != nil {
		e.Stop()
		return nil, err
	}
	return e, nil
}

// Security returns how e serves, or nil for a plain etcd.
func (e *Etcd) Security() *EtcdSecurity { return e.secure }

// enableAuth creates the root user (with a password nobody uses: root
// authenticates by certificate) and enables auth.
func (e *Etcd) enableAuth() error {
	cli, err := e.Client()
	if err != nil {
		return err
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), etcdReadyTimeout)
	defer cancel()
	wrap := func(err error) error { return fmt.Errorf("devstack: etcd %s: enable auth: %w", e.Endpoints()[0], err) }
	if _, err := cli.UserAdd(ctx, "root", rand.Text()); err != nil {
		return wrap(err)
	}
	if _, err := cli.UserGrantRole(ctx, "root", "root"); err != nil {
		return wrap(err)
	}
	if _, err := cli.AuthEnable(ctx); err != nil {
		return wrap(err)
	}
	return nil
}

// EtcdPermission is one permission of a role: read, write or readwrite on
// a key, or on every key under a prefix.
type EtcdPermission struct {
	Key    string
	Prefix bool
	Type   clientv3.PermissionType
}

// AddUser creates the user with password (empty: a user that can only
// authenticate by a certificate with its name as common name) and a role
// of the same name holding perms, as 'etcdctl role add', 'role
// grant-permission [--prefix]', 'user add' and 'user grant-role' would.
func (e *Etcd) AddUser(user, password string, perms ...EtcdPermission) error {
	cli, err := e.Client()
	if err != nil {
		return err
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), etcdReadyTimeout)
	defer cancel()
	wrap := func(err error) error { return fmt.Errorf("devstack: etcd: add user %s: %w", user, err) }
	if _, err := cli.RoleAdd(ctx, user); err != nil {
		return wrap(err)
	}
	for _, p := range perms {
		end := ""
		if p.Prefix {
			end = clientv3.GetPrefixRangeEnd(p.Key)
		}
		if _, err := cli.RoleGrantPermission(ctx, user, p.Key, end, p.Type); err != nil {
			return wrap(err)
		}
	}
	if password == "" {
		_, err = cli.UserAddWithOptions(ctx, user, "", &clientv3.UserAddOptions{NoPassword: true})
	} else {
		_, err = cli.UserAdd(ctx, user, password)
	}
	if err != nil {
		return wrap(err)
	}
	if _, err := cli.UserGrantRole(ctx, user, user); err != nil {
		return wrap(err)
	}
	return nil
}

// clientTLS is the TLS configuration of Client: none for a plain etcd,
// the root certificate for a secure one (etcd takes the user from it).
func (e *Etcd) clientTLS() *tls.Config {
	if e.secure == nil {
		return nil
	}
	return e.secure.PKI.ClientTLS(&e.secure.Root)
}

// KafkaSASL returns kfake options that make a cluster require SASL, with
// user a superuser authenticating by mechanism (PLAIN, SCRAM-SHA-256 or
// SCRAM-SHA-512). Pass them as KafkaOptions.Extra. AddPartitions, which
// speaks without SASL, does not work on such a cluster; CreateTopic does.
func KafkaSASL(mechanism, user, password string) []kfake.Opt {
	return []kfake.Opt{kfake.EnableSASL(), kfake.Superuser(mechanism, user, password)}
}

// KafkaTLS returns the kfake option that makes a cluster's brokers serve
// TLS with a certificate issued by pki for 127.0.0.1.
func KafkaTLS(pki *PKI) (kfake.Opt, error) {
	c, err := pki.Issue("kafka-server", "kafka-server")
	if err != nil {
		return nil, err
	}
	return kfake.TLS(pki.ServerTLS(c)), nil
}

package config

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"slices"
	"strings"

	"go.uber.org/zap/zapcore"
)

// Secret is a password or another value that must never be shown: it
// formats, logs and marshals (JSON, YAML, zap) as "[redacted]" when set
// and as "" when empty. Reveal returns the value, for the one place that
// hands it to a client library.
type Secret string

// redacted is what a set Secret shows instead of its value.
const redacted = "[redacted]"

// Reveal returns the secret's value.
func (s Secret) Reveal() string { return string(s) }

// String redacts the value, for fmt's %v and %s and for zap.Stringer.
func (s Secret) String() string {
	if s == "" {
		return ""
	}
	return redacted
}

// GoString redacts the value for %#v, which would otherwise print it.
func (s Secret) GoString() string { return fmt.Sprintf("config.Secret(%q)", s.String()) }

// MarshalJSON redacts the value in JSON (a configuration dump, zap.Any).
func (s Secret) MarshalJSON() ([]byte, error) { return []byte(fmt.Sprintf("%q", s.String())), nil }

// MarshalYAML redacts the value in a marshalled configuration.
func (s Secret) MarshalYAML() (any, error) { return s.String(), nil }

// MarshalText redacts the value for encoders that use encoding.TextMarshaler.
func (s Secret) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// TLS configures a TLS client connection (to etcd or to a Kafka cluster).
// It is in use when Enabled is set or any other field is: a CA file, a
// client certificate or a server name only make sense over TLS.
type TLS struct {
	// Enabled turns TLS on with the system's root CAs when no other field
	// is set.
	Enabled bool `yaml:"enabled" help:"use TLS (implied by any other tls field)"`
	// CAFile is a PEM bundle of the CAs that sign the servers'
	// certificates. Default: the system's roots.
	CAFile string `yaml:"ca_file" help:"PEM file of the CAs trusted to sign the server certificates (default: the system's roots)"`
	// CertFile and KeyFile are the PEM client certificate and its key, for
	// servers that require client certificates. Both or neither.
	CertFile string `yaml:"cert_file" help:"PEM client certificate, for servers that require one (with key_file)"`
	KeyFile  string `yaml:"key_file" help:"PEM key of cert_file"`
	// ServerName is the name expected in the servers' certificates.
	// Default: the host of the address dialled.
	ServerName string `yaml:"server_name" help:"name expected in the server certificates (default: the host dialled)"`
	// InsecureSkipVerify accepts any server certificate. For tests only:
	// it makes TLS useless against an attacker on the path.
	InsecureSkipVerify bool `yaml:"insecure_skip_verify" help:"accept any server certificate (tests only: no protection against interception)"`
}

// On reports whether TLS is in use.
func (t TLS) On() bool {
	return t.Enabled || t.CAFile != "" || t.CertFile != "" || t.KeyFile != "" || t.ServerName != "" || t.InsecureSkipVerify
}

// ClientConfig loads the files and returns the client TLS configuration,
// or nil when TLS is not in use. Errors name path, the field's dotted path.
func (t TLS) ClientConfig(path string) (*tls.Config, error) {
	if !t.On() {
		return nil, nil
	}
	c := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: t.ServerName, InsecureSkipVerify: t.InsecureSkipVerify}
	if t.CAFile != "" {
		pool, err := loadCAs(t.CAFile)
		if err != nil {
			return nil, fmt.Errorf("config: %s.ca_file: %w", path, err)
		}
		c.RootCAs = pool
	}
	if t.CertFile != "" || t.KeyFile != "" {
		cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("config: %s.cert_file/key_file: %w", path, err)
		}
		c.Certificates = []tls.Certificate{cert}
	}
	return c, nil
}

// ServerTLS configures a TLS listener (the agent's HTTP endpoints).
type ServerTLS struct {
	// CertFile and KeyFile are the PEM server certificate (with its chain)
	// and its key. Setting them turns TLS on.
	CertFile string `yaml:"cert_file" help:"PEM server certificate of the HTTP listener; turns on HTTPS (with key_file)"`
	KeyFile  string `yaml:"key_file" help:"PEM key of cert_file"`
	// ClientCAFile, when set, makes the listener require client
	// certificates signed by these CAs.
	ClientCAFile string `yaml:"client_ca_file" help:"PEM CAs of the client certificates the HTTP listener requires (default: none required)"`
}

// On reports whether the listener serves TLS.
func (t ServerTLS) On() bool { return t.CertFile != "" || t.KeyFile != "" }

// ServerConfig loads the files and returns the listener's TLS
// configuration, or nil when TLS is off. Errors name path.
func (t ServerTLS) ServerConfig(path string) (*tls.Config, error) {
	if !t.On() {
		return nil, nil
	}
	cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("config: %s.cert_file/key_file: %w", path, err)
	}
	c := &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{cert}}
	if t.ClientCAFile != "" {
		pool, err := loadCAs(t.ClientCAFile)
		if err != nil {
			return nil, fmt.Errorf("config: %s.client_ca_file: %w", path, err)
		}
		c.ClientCAs, c.ClientAuth = pool, tls.RequireAndVerifyClientCert
	}
	return c, nil
}

func loadCAs(file string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s holds no PEM certificate", file)
	}
	return pool, nil
}

// SASL mechanisms a Kafka cluster may use.
const (
	SASLPlain       = "PLAIN"
	SASLScramSHA256 = "SCRAM-SHA-256"
	SASLScramSHA512 = "SCRAM-SHA-512"
)

// SASL configures a Kafka cluster's SASL authentication.
type SASL struct {
	// Mechanism is PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512; empty means no
	// SASL. PLAIN sends the password itself: use it only with TLS.
	Mechanism string `yaml:"mechanism" help:"SASL mechanism: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (default: no SASL)"`
	// Username is the SASL user.
	Username string `yaml:"username" help:"SASL user name"`
	// Password is the SASL password; prefer PasswordFile.
	Password Secret `yaml:"password" help:"SASL password (prefer password_file)"`
	// PasswordFile is a file holding the password (a trailing newline is
	// dropped), such as a mounted secret. Exclusive with Password.
	PasswordFile string `yaml:"password_file" help:"file holding the SASL password; trailing newline dropped"`
}

// Credentials returns the SASL user and password, reading PasswordFile
// if set. Errors name path.
func (s SASL) Credentials(path string) (string, Secret, error) {
	pass, err := readSecret(s.Password, s.PasswordFile, path)
	return s.Username, pass, err
}

// Credentials returns the etcd user and password, reading PasswordFile if
// set; both are empty without authentication.
func (e Etcd) Credentials() (string, Secret, error) {
	pass, err := readSecret(e.Password, e.PasswordFile, "etcd")
	return e.Username, pass, err
}

// GossipKeys reads agent.gossip_key_file: the keys, the first being the
// one to send with; none when the field is empty.
func (a Agent) GossipKeys() ([][]byte, error) {
	if a.GossipKeyFile == "" {
		return nil, nil
	}
	data, err := os.ReadFile(a.GossipKeyFile)
	if err != nil {
		return nil, fmt.Errorf("config: agent.gossip_key_file: %w", err)
	}
	keys, err := ParseGossipKeys(data, a.GossipKeyFile)
	if err != nil {
		return nil, fmt.Errorf("config: agent.gossip_key_file: %w", err)
	}
	return keys, nil
}

// ParseGossipKeys parses gossip keys as agent.gossip_key_file and the
// fleet's key in etcd hold them: base64, one per line, blank lines and
// lines starting with # ignored, each 16, 24 or 32 bytes. source names
// where data came from in errors.
func ParseGossipKeys(data []byte, source string) ([][]byte, error) {
	var keys [][]byte
	for i, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, err := base64.StdEncoding.DecodeString(line)
		if err != nil {
			return nil, fmt.Errorf("%s line %d is not base64: %v (make one with: head -c 32 /dev/urandom | base64)", source, i+1, err)
		}
		if n := len(k); n != 16 && n != 24 && n != 32 {
			return nil, fmt.Errorf("%s line %d is a %d-byte key; a gossip key is 16, 24 or 32 bytes (make one with: head -c 32 /dev/urandom | base64)", source, i+1, n)
		}
		keys = append(keys, k)
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("%s holds no key", source)
	}
	return keys, nil
}

// readSecret returns inline, or the content of file without its trailing
// newline when file is set. Errors name path (the section).
func readSecret(inline Secret, file, path string) (Secret, error) {
	if file == "" {
		return inline, nil
	}
	data, err := os.ReadFile(file)
	if err != nil {
		return "", fmt.Errorf("config: %s.password_file: %w", path, err)
	}
	s := strings.TrimSuffix(strings.TrimSuffix(string(data), "\n"), "\r")
	if s == "" {
		return "", fmt.Errorf("config: %s.password_file: %s is empty", path, file)
	}
	return Secret(s), nil
}

// validateSecurity checks the TLS, credential and SASL fields: that files
// are readable and parse, and that the fields that go together are set
// together.
func (c *Config) validateSecurity(p *problems) {
	if _, err := c.Agent.GossipKeys(); err != nil {
		p.add("agent.gossip_key_file", "%s", strings.TrimPrefix(err.Error(), "config: agent.gossip_key_file: "))
	}
	e := c.Etcd
	switch {
	case e.Password != "" && e.PasswordFile != "":
		p.add("etcd.password", "set either etcd.password or etcd.password_file, not both")
	case e.Username == "" && (e.Password != "" || e.PasswordFile != ""):
		p.add("etcd.username", "required with a password: name the etcd user")
	case e.Username != "" && e.Password == "" && e.PasswordFile == "":
		p.add("etcd.password", "etcd.username %q has no password: set etcd.password_file (or etcd.password); for authentication by client certificate alone, leave etcd.username empty", e.Username)
	default:
		if _, _, err := e.Credentials(); err != nil {
			*p = append(*p, err)
		}
	}
	p.clientTLS("etcd.tls", e.TLS)

	for _, name := range slices.Sorted(maps.Keys(c.Clusters)) {
		cl := c.Clusters[name]
		path := "clusters." + name
		p.clientTLS(path+".tls", cl.TLS)
		s := cl.SASL
		switch s.Mechanism {
		case "":
			if s.Username != "" || s.Password != "" || s.PasswordFile != "" {
				p.add(path+".sasl.mechanism", "required with SASL credentials: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512")
			}
			continue
		case SASLPlain, SASLScramSHA256, SASLScramSHA512:
		default:
			p.add(path+".sasl.mechanism", "%q is not one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 (written in capitals, as Kafka's sasl.enabled.mechanisms)", s.Mechanism)
		}
		if s.Username == "" {
			p.add(path+".sasl.username", "required with sasl.mechanism %s", s.Mechanism)
		}
		switch {
		case s.Password != "" && s.PasswordFile != "":
			p.add(path+".sasl.password", "set either sasl.password or sasl.password_file, not both")
		case s.Password == "" && s.PasswordFile == "":
			p.add(path+".sasl.password_file", "required with sasl.mechanism %s (or sasl.password)", s.Mechanism)
		default:
			if _, _, err := s.Credentials(path + ".sasl"); err != nil {
				*p = append(*p, err)
			}
		}
	}

	h := c.Agent.HTTPTLS
	switch {
	case (h.CertFile == "") != (h.KeyFile == ""):
		p.add("agent.http_tls", "set both cert_file and key_file, or neither")
	case h.ClientCAFile != "" && !h.On():
		p.add("agent.http_tls.client_ca_file", "requires cert_file and key_file: client certificates are checked only over HTTPS")
	default:
		if _, err := h.ServerConfig("agent.http_tls"); err != nil {
			*p = append(*p, err)
		}
	}
}

// clientTLS checks a client TLS section: the certificate and key go
// together, and the files load.
func (p *problems) clientTLS(path string, t TLS) {
	if (t.CertFile == "") != (t.KeyFile == "") {
		p.add(path, "set both cert_file and key_file, or neither")
		return
	}
	if _, err := t.ClientConfig(path); err != nil {
		*p = append(*p, err)
	}
}

// InlineSecrets returns the dotted paths of the passwords c holds inline
// (rather than in a password_file), sorted.
func (c Config) InlineSecrets() []string {
	var out []string
	if c.Etcd.Password != "" {
		out = append(out, "etcd.password")
	}
	for _, name := range slices.Sorted(maps.Keys(c.Clusters)) {
		if c.Clusters[name].SASL.Password != "" {
			out = append(out, "clusters."+name+".sasl.password")
		}
	}
	return out
}

// FileModeWarning returns a warning when the configuration file at path,
// from which c was loaded, holds inline passwords and can be read by its
// group or by anyone: the passwords are then readable by more than the
// agent. It returns "" otherwise.
func FileModeWarning(path string, c Config) (string, error) {
	secrets := c.InlineSecrets()
	if len(secrets) == 0 {
		return "", nil
	}
	fi, err := os.Stat(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return "", nil
		}
		return "", fmt.Errorf("config: %w", err)
	}
	if mode := fi.Mode().Perm(); mode&0o044 != 0 {
		return fmt.Sprintf("configuration file %s (mode %04o) is readable by its group or by everyone and holds %s inline: "+
			"chmod 600 it, or move the password to a file and set the matching password_file", path, mode, strings.Join(secrets, ", ")), nil
	}
	return "", nil
}

// MarshalLogObject logs the etcd section without its password, for
// zap.Object.
func (e Etcd) MarshalLogObject(enc zapcore.ObjectEncoder) error {
	enc.AddString("endpoints", strings.Join(e.Endpoints, ","))
	enc.AddString("username", e.Username)
	enc.AddBool("tls", e.TLS.On())
	enc.AddString("password", e.Password.String())
	return nil
}

package config

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/pflag"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.yaml.in/yaml/v3"

	"github.com/kswitch/kswitch/devstack"
)

const (
	etcdPass  = "etcd-S3cret-pw"
	kafkaPass = "kafka-S3cret-pw"
)

// secured returns a valid configuration with inline passwords for etcd
// and for cluster A's SASL.
func secured(t *testing.T) Config {
	t.Helper()
	c := valid(t)
	c.Etcd.Username, c.Etcd.Password = "fleet", etcdPass
	a := c.Clusters["A"]
	a.SASL = SASL{Mechanism: SASLScramSHA256, Username: "fleet", Password: kafkaPass}
	c.Clusters["A"] = a
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestSecretsAreRedacted: passwords never show in fmt, JSON, YAML or zap
// output of the configuration, and Reveal still gives them to the one
// place that needs them.
// rendered is c as every way it is shown: fmt's verbs, JSON, YAML, and a
// zap log line with c and fields.
func rendered(t *testing.T, c Config, fields ...zap.Field) *bytes.Buffer {
	t.Helper()
	var out bytes.Buffer
	for _, verb := range []string{"%v", "%+v", "%#v", "%s"} {
		fmt.Fprintf(&out, verb+"\n", c)
	}
	j, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	out.Write(j)
	y, err := yaml.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	out.Write(y)
	enc := zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig())
	log := zap.New(zapcore.NewCore(enc, zapcore.AddSync(&out), zap.DebugLevel))
	log.Info("config", append([]zap.Field{zap.Any("config", c)}, fields...)...)
	_ = log.Sync()
	return &out
}

func TestSecretsAreRedacted(t *testing.T) {
	c := secured(t)
	out := rendered(t, c, zap.Object("etcd", c.Etcd),
		zap.Any("password", c.Etcd.Password), zap.Stringer("sasl", c.Clusters["A"].SASL.Password))
	for _, secret := range []string{etcdPass, kafkaPass} {
		if strings.Contains(out.String(), secret) {
			t.Errorf("%q shows in:\n%s", secret, out.String())
		}
	}
	if !strings.Contains(out.String(), "[redacted]") {
		t.Errorf("no [redacted] in:\n%s", out.String())
	}
	if c.Etcd.Password.Reveal() != etcdPass {
		t.Errorf("Reveal() = %q", c.Etcd.Password.Reveal())
	}

	// A flag's value shows in help and errors through String.
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	BindFlags(fs)
	if err := fs.Parse([]string{"--etcd.password=" + etcdPass}); err != nil {
		t.Fatal(err)
	}
	if s := fs.Lookup("etcd.password").Value.String(); s != "[redacted]" {
		t.Errorf("--etcd.password shows %q", s)
	}
}

func TestPasswordFiles(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "pw")
	if err := os.WriteFile(file, []byte(etcdPass+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := valid(t)
	c.Etcd.Username, c.Etcd.PasswordFile = "fleet", file
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	user, pass, err := c.Etcd.Credentials()
	if err != nil || user != "fleet" || pass.Reveal() != etcdPass {
		t.Errorf("Credentials() = %q, %q, %v; want fleet, the file without its newline", user, pass.Reveal(), err)
	}

	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, []byte("\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		set  func(*Config)
		want string
	}{
		{"missing file", func(c *Config) { c.Etcd.Username, c.Etcd.PasswordFile = "u", filepath.Join(dir, "nope") }, "config: etcd.password_file: open " + filepath.Join(dir, "nope")},
		{"empty file", func(c *Config) { c.Etcd.Username, c.Etcd.PasswordFile = "u", empty }, "config: etcd.password_file: " + empty + " is empty"},
		{"both", func(c *Config) { c.Etcd.Username, c.Etcd.Password, c.Etcd.PasswordFile = "u", "p", file }, "config: etcd.password: set either etcd.password or etcd.password_file, not both"},
		{"no user", func(c *Config) { c.Etcd.PasswordFile = file }, "config: etcd.username: required with a password"},
		{"no password", func(c *Config) { c.Etcd.Username = "u" }, `config: etcd.password: etcd.username "u" has no password`},
		{"sasl mechanism", func(c *Config) { setSASL(c, SASL{Mechanism: "scram", Username: "u", Password: "p"}) }, `config: clusters.A.sasl.mechanism: "scram" is not one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512`},
		{"sasl without mechanism", func(c *Config) { setSASL(c, SASL{Username: "u", Password: "p"}) }, "config: clusters.A.sasl.mechanism: required with SASL credentials"},
		{"sasl without user", func(c *Config) { setSASL(c, SASL{Mechanism: SASLPlain, PasswordFile: file}) }, "config: clusters.A.sasl.username: required with sasl.mechanism PLAIN"},
		{"sasl without password", func(c *Config) { setSASL(c, SASL{Mechanism: SASLScramSHA512, Username: "u"}) }, "config: clusters.A.sasl.password_file: required with sasl.mechanism SCRAM-SHA-512"},
		{"sasl file missing", func(c *Config) {
			setSASL(c, SASL{Mechanism: SASLScramSHA512, Username: "u", PasswordFile: filepath.Join(dir, "nope")})
		}, "config: clusters.A.sasl.password_file: open "},
		{"etcd cert without key", func(c *Config) { c.Etcd.TLS.CertFile = file }, "config: etcd.tls: set both cert_file and key_file, or neither"},
		{"etcd CA not PEM", func(c *Config) { c.Etcd.TLS.CAFile = file }, "config: etcd.tls.ca_file: " + file + " holds no PEM certificate"},
		{"kafka CA missing", func(c *Config) {
			a := c.Clusters["A"]
			a.TLS.CAFile = filepath.Join(dir, "nope")
			c.Clusters["A"] = a
		}, "config: clusters.A.tls.ca_file: open "},
		{"http key without cert", func(c *Config) { c.Agent.HTTPTLS.KeyFile = file }, "config: agent.http_tls: set both cert_file and key_file, or neither"},
		{"http client CA without TLS", func(c *Config) { c.Agent.HTTPTLS.ClientCAFile = file }, "config: agent.http_tls.client_ca_file: requires cert_file and key_file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := valid(t)
			tc.set(&c)
			err := c.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Validate() = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

func setSASL(c *Config, s SASL) {
	a := c.Clusters["A"]
	a.SASL = s
	c.Clusters["A"] = a
}

// TestSecurityOverrides: the TLS, credential and SASL fields have their
// environment variables and flags, cluster fields included (whose paths,
// tls.ca_file, have a dot as cluster names may).
func TestSecurityOverrides(t *testing.T) {
	pki, err := devstack.NewPKI(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	cert, err := pki.Issue("client", "fleet")
	if err != nil {
		t.Fatal(err)
	}
	c := valid(t)
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	o := BindFlags(fs)
	if err := fs.Parse([]string{
		"--etcd.tls.insecure_skip_verify", // a bool flag alone is true
		"--cluster", "A.sasl.mechanism=SCRAM-SHA-512",
		"--cluster", "dc.1.tls.ca_file=" + pki.CAFile,
		"--cluster", "dc.1.brokers=h:1", "--cluster", "dc.1.role=sink",
	}); err != nil {
		t.Fatal(err)
	}
	env := []string{
		"KSWITCH_ETCD_USERNAME=fleet",
		"KSWITCH_ETCD_PASSWORD=" + etcdPass,
		"KSWITCH_ETCD_TLS_CA_FILE=" + pki.CAFile,
		"KSWITCH_ETCD_TLS_CERT_FILE=" + cert.CertFile,
		"KSWITCH_ETCD_TLS_KEY_FILE=" + cert.KeyFile,
		"KSWITCH_ETCD_TLS_SERVER_NAME=etcd.example",
		"KSWITCH_CLUSTERS_A_SASL_MECHANISM=PLAIN", // the flag wins
		"KSWITCH_CLUSTERS_A_SASL_USERNAME=fleet",
		"KSWITCH_CLUSTERS_A_SASL_PASSWORD=" + kafkaPass,
		"KSWITCH_CLUSTERS_A_TLS_ENABLED=true",
	}
	if err := o.Apply(&c, env); err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	e := c.Etcd
	if e.Username != "fleet" || e.Password.Reveal() != etcdPass || !e.TLS.InsecureSkipVerify || e.TLS.ServerName != "etcd.example" || e.TLS.CertFile != cert.CertFile {
		t.Errorf("etcd = %+v", e)
	}
	tc, err := e.TLS.ClientConfig("etcd.tls")
	if err != nil || tc.RootCAs == nil || len(tc.Certificates) != 1 || tc.ServerName != "etcd.example" {
		t.Errorf("etcd TLS config = %+v, %v", tc, err)
	}
	a := c.Clusters["A"]
	if a.SASL.Mechanism != SASLScramSHA512 || a.SASL.Username != "fleet" || a.SASL.Password.Reveal() != kafkaPass || !a.TLS.On() {
		t.Errorf("cluster A = %+v", a)
	}
	if d := c.Clusters["dc.1"]; d.TLS.CAFile != pki.CAFile || d.Role != RoleSink {
		t.Errorf("cluster dc.1 = %+v", d)
	}
	if err := o.Apply(&c, []string{"KSWITCH_ETCD_TLS_ENABLED=maybe"}); err == nil || !strings.Contains(err.Error(), `KSWITCH_ETCD_TLS_ENABLED="maybe": "maybe" is not true or false`) {
		t.Errorf("bad bool: %v", err)
	}
}

// TestFileModeWarning: an inline password in a file its group or others
// can read is warned about; a private file, or passwords in files, are
// not.
func TestFileModeWarning(t *testing.T) {
	dir := t.TempDir()
	inline := strings.Replace(minimal, "etcd:\n", "etcd:\n  username: fleet\n  password: "+etcdPass+"\n", 1)
	fromFile := strings.Replace(minimal, "etcd:\n", "etcd:\n  username: fleet\n  password_file: /run/secrets/etcd\n", 1)
	for _, tc := range []struct {
		name string
		data string
		mode os.FileMode
		want string
	}{
		{"inline, world-readable", inline, 0o644, "(mode 0644) is readable by its group or by everyone and holds etcd.password inline"},
		{"inline, group-readable", inline, 0o640, "(mode 0640)"},
		{"inline, private", inline, 0o600, ""},
		{"password file, world-readable", fromFile, 0o644, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "_")+".yaml")
			if err := os.WriteFile(path, []byte(tc.data), tc.mode); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(path, tc.mode); err != nil { // past the umask
				t.Fatal(err)
			}
			c, err := Load(path)
			if err != nil {
				t.Fatal(err)
			}
			got, err := FileModeWarning(path, c)
			if err != nil {
				t.Fatal(err)
			}
			if (tc.want == "") != (got == "") || !strings.Contains(got, tc.want) {
				t.Errorf("warning %q, want one containing %q", got, tc.want)
			}
			if strings.Contains(got, etcdPass) {
				t.Errorf("the warning shows the password: %s", got)
			}
		})
	}
}

// TestDynamicClusterRefusesInlinePassword: a cluster defined in etcd may
// name a password file, never hold the password.
func TestDynamicClusterRefusesInlinePassword(t *testing.T) {
	_, err := ParseCluster([]byte("brokers: [h:1]\nrole: sink\nsasl: {mechanism: PLAIN, username: u, password: "+kafkaPass+"}\n"), "/kswitch/orders/config/clusters/C")
	if err == nil || !strings.Contains(err.Error(), "config: /kswitch/orders/config/clusters/C: sasl.password: a cluster defined in etcd cannot hold a password") {
		t.Errorf("inline password: %v", err)
	}
	if err != nil && strings.Contains(err.Error(), kafkaPass) {
		t.Errorf("the error shows the password: %v", err)
	}
	c, err := ParseCluster([]byte("brokers: [h:1]\nrole: sink\nsasl: {mechanism: PLAIN, username: u, password_file: /run/secrets/c}\n"), "c")
	if err != nil || c.SASL.PasswordFile != "/run/secrets/c" {
		t.Errorf("password file: %+v, %v", c.SASL, err)
	}
}

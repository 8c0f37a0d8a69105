package config

import (
	"strings"
	"testing"

	"go.uber.org/zap"
)

const proxyPass = "proxy-S3cret-pw"

func TestProxyValidates(t *testing.T) {
	for _, tc := range []struct {
		url              string
		addr, user, pass string
	}{
		{"socks5://127.0.0.1:1080", "127.0.0.1:1080", "", ""},
		{"socks5://bastion.example:1080/", "bastion.example:1080", "", ""},
		{"socks5://[::1]:1080", "[::1]:1080", "", ""},
		{"socks5://fleet:" + proxyPass + "@bastion:1080", "bastion:1080", "fleet", proxyPass},
		{"socks5://fleet@bastion:1080", "bastion:1080", "fleet", ""},
	} {
		c := valid(t)
		a := c.Clusters["A"]
		a.Proxy = ProxyURL(tc.url)
		c.Clusters["A"] = a
		if err := c.Validate(); err != nil {
			t.Errorf("%s: %v", tc.url, err)
			continue
		}
		addr, user, pass, err := a.Proxy.SOCKS5()
		if err != nil || addr != tc.addr || user != tc.user || pass.Reveal() != tc.pass {
			t.Errorf("%s: SOCKS5() = %q, %q, %q, %v; want %q, %q, %q", tc.url, addr, user, pass.Reveal(), err, tc.addr, tc.user, tc.pass)
		}
	}
}

// TestBadProxyIsRefused: the error names the cluster and the field, says
// what to write, and never shows the password.
func TestBadProxyIsRefused(t *testing.T) {
	for _, tc := range []struct {
		url, want string
	}{
		{"http://fleet:" + proxyPass + "@bastion:3128", `config: clusters.A.proxy: http://fleet:xxxxx@bastion:3128: scheme "http" is not socks5`},
		{"socks5://bastion", "config: clusters.A.proxy: socks5://bastion: the port must be a number from 1 to 65535"},
		{"socks5://bastion:0", "the port must be a number from 1 to 65535"},
		{"socks5://bastion:socks", "is not a URL"},
		{"socks5://:1080", "socks5://:1080 has no host"},
		{"socks5://bastion:1080/kafka", "without a path, query or fragment"},
		{"socks5://:" + proxyPass + "@bastion:1080", "socks5://:xxxxx@bastion:1080 has a password without a user"},
		{"bastion:1080", `config: clusters.A.proxy: bastion:1080: scheme "bastion" is not socks5`},
	} {
		c := valid(t)
		a := c.Clusters["A"]
		a.Proxy = ProxyURL(tc.url)
		c.Clusters["A"] = a
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.url, err, tc.want)
		}
		if err != nil && strings.Contains(err.Error(), proxyPass) {
			t.Errorf("%s: the error shows the password: %v", tc.url, err)
		}
	}
}

// TestProxyPasswordIsRedacted: a proxy's password never shows in fmt,
// JSON, YAML or zap output of the configuration.
func TestProxyPasswordIsRedacted(t *testing.T) {
	c := valid(t)
	a := c.Clusters["A"]
	a.Proxy = ProxyURL("socks5://fleet:" + proxyPass + "@bastion:1080")
	c.Clusters["A"] = a
	out := rendered(t, c, zap.Stringer("proxy", a.Proxy))
	if strings.Contains(out.String(), proxyPass) {
		t.Errorf("%q shows in:\n%s", proxyPass, out.String())
	}
	if !strings.Contains(out.String(), "socks5://fleet:xxxxx@bastion:1080") {
		t.Errorf("no socks5://fleet:xxxxx@bastion:1080 in:\n%s", out.String())
	}
}

func TestProxyFromEnvironment(t *testing.T) {
	c, err := Parse([]byte(minimal), "valid.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := (*Overrides)(nil).Apply(&c, []string{"KSWITCH_CLUSTERS_A_PROXY=socks5://127.0.0.1:1080"}); err != nil {
		t.Fatal(err)
	}
	if c.Clusters["A"].Proxy != "socks5://127.0.0.1:1080" {
		t.Errorf("clusters.A.proxy = %q from KSWITCH_CLUSTERS_A_PROXY", c.Clusters["A"].Proxy)
	}
}

// TestDynamicClusterRefusesProxyPassword: a cluster defined in etcd may
// name a proxy, not the proxy's password.
func TestDynamicClusterRefusesProxyPassword(t *testing.T) {
	_, err := ParseCluster([]byte("brokers: [h:1]\nrole: sink\nproxy: socks5://u:"+proxyPass+"@bastion:1080\n"), "/kswitch/orders/config/clusters/C")
	if err == nil || !strings.Contains(err.Error(), "config: /kswitch/orders/config/clusters/C: proxy: a cluster defined in etcd cannot hold the proxy's password") {
		t.Errorf("proxy password: %v", err)
	}
	if err != nil && strings.Contains(err.Error(), proxyPass) {
		t.Errorf("the error shows the password: %v", err)
	}
	c, err := ParseCluster([]byte("brokers: [h:1]\nrole: sink\nproxy: socks5://bastion:1080\n"), "c")
	if err != nil || c.Proxy != "socks5://bastion:1080" {
		t.Errorf("proxy without a password: %q, %v", c.Proxy, err)
	}
}

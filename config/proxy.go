package config

import (
	"fmt"
	"net"
	"net/url"
	"strconv"
)

// ProxyURL is the URL of a SOCKS5 proxy, socks5://host:port or
// socks5://user:password@host:port. Like a Secret, it never shows its
// password: it formats, logs and marshals (JSON, YAML, zap) with the
// password replaced by "xxxxx"; SOCKS5 gives it to the one place that
// dials.
type ProxyURL string

// SOCKS5 returns the proxy's address (host:port) and credentials (user ""
// when it has none). Its errors never show the password.
func (u ProxyURL) SOCKS5() (addr, user string, password Secret, err error) {
	if u == "" {
		return "", "", "", fmt.Errorf("no proxy URL")
	}
	p, perr := url.Parse(string(u))
	if perr != nil {
		return "", "", "", fmt.Errorf("%s is not a URL; write socks5://host:port or socks5://user:password@host:port", u)
	}
	if p.Scheme != "socks5" {
		return "", "", "", fmt.Errorf("%s: scheme %q is not socks5 (only SOCKS5 proxies are supported); write socks5://host:port or socks5://user:password@host:port", u, p.Scheme)
	}
	if p.Opaque != "" || (p.Path != "" && p.Path != "/") || p.RawQuery != "" || p.Fragment != "" {
		return "", "", "", fmt.Errorf("%s: a proxy URL is socks5://[user:password@]host:port, without a path, query or fragment", u)
	}
	host, port := p.Hostname(), p.Port()
	if host == "" {
		return "", "", "", fmt.Errorf("%s has no host; write socks5://host:port", u)
	}
	if n, perr := strconv.ParseUint(port, 10, 16); perr != nil || n == 0 {
		return "", "", "", fmt.Errorf("%s: the port must be a number from 1 to 65535 (SOCKS has no default port here); write socks5://host:port", u)
	}
	if p.User != nil {
		user = p.User.Username()
		pass, _ := p.User.Password()
		if user == "" {
			return "", "", "", fmt.Errorf("%s has a password without a user; write socks5://user:password@host:port", u)
		}
		password = Secret(pass)
	}
	return net.JoinHostPort(host, port), user, password, nil
}

// String shows the URL with its password replaced by "xxxxx", for fmt's
// %v and %s and for zap.Stringer.
func (u ProxyURL) String() string {
	p, err := url.Parse(string(u))
	if err != nil {
		// Unparsable: it may still hold a password somewhere.
		if u == "" {
			return ""
		}
		return redacted
	}
	return p.Redacted()
}

// GoString redacts the password for %#v, which would otherwise print it.
func (u ProxyURL) GoString() string { return fmt.Sprintf("config.ProxyURL(%q)", u.String()) }

// MarshalJSON redacts the password in JSON (a configuration dump, zap.Any).
func (u ProxyURL) MarshalJSON() ([]byte, error) { return []byte(strconv.Quote(u.String())), nil }

// MarshalYAML redacts the password in a marshalled configuration.
func (u ProxyURL) MarshalYAML() (any, error) { return u.String(), nil }

// MarshalText redacts the password for encoders that use
// encoding.TextMarshaler.
func (u ProxyURL) MarshalText() ([]byte, error) { return []byte(u.String()), nil }

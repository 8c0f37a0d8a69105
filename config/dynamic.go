package config

import "fmt"

// DecodeOver decodes one YAML document into v, a pointer to a struct of
// the configuration's types, as strictly as Parse: unknown fields and
// wrong shapes are errors naming the line and the path. Only the fields the
// document names are set, so decoding over a copy of a section overrides
// it field by field. name is quoted in errors.
func DecodeOver(data []byte, name string, v any) error { return decodeStrict(data, name, v) }

// ParseCluster decodes one cluster definition (the value of etcd's
// config/clusters/<name> key) as strictly as Parse, over the defaults of a
// cluster, so it replaces the file's definition of that cluster as a
// whole.
//
// An inline sasl.password, or a proxy URL with a password, is refused:
// etcd is read by every agent and operator of the fleet and keeps old
// values in its history, and both marshal redacted, so they would not
// survive the leader's versioned copy either. The definition names a
// password_file on the agents' hosts instead.
func ParseCluster(data []byte, name string) (Cluster, error) {
	c := defaultCluster()
	if err := decodeStrict(data, name, &c); err != nil {
		return Cluster{}, err
	}
	if c.SASL.Password != "" {
		return Cluster{}, fmt.Errorf("config: %s: sasl.password: a cluster defined in etcd cannot hold a password (every reader of the fleet's keys would see it); set sasl.password_file, a file on the agents' hosts", name)
	}
	if _, _, pass, err := c.Proxy.SOCKS5(); err == nil && pass != "" {
		return Cluster{}, fmt.Errorf("config: %s: proxy: a cluster defined in etcd cannot hold the proxy's password (every reader of the fleet's keys would see it); use a proxy without a password here, or define the cluster in the agents' files", name)
	}
	return c, nil
}

package state

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/kswitch/kswitch/config"
)

// ConfigDigest is what an agent's registration says of the parts of its
// configuration that must agree across a fleet, so that agents whose
// files differ are found: one with other routing rules splits the traffic
// between two sets of channels, silently.
//
// Each part is the first 12 hex digits of the SHA-256 of its JSON after
// defaults, environment and flags were applied (so a file that spells out
// a default agrees with one that leaves it out):
//   - routing: the whole section (mode, rules, default, dead_letter,
//     channels);
//   - source: every field but max_in_flight_mib, a bound of the agent's own
//     memory;
//   - clusters: every cluster with every field but client_id, tls, sasl
//     and proxy (certificate paths, users, passwords and the SOCKS bastion
//     may differ per host, and no secret is hashed), brokers sorted;
//   - failover: the whole section (the leader applies it, and any agent may
//     lead).
//
// Not compared: fleet (the same by definition), log, agent (id,
// addresses, TLS, gossip keys) and etcd (endpoints, credentials).
type ConfigDigest struct {
	// Digest covers the four parts: agents agree when it is equal.
	Digest   string `json:"digest"`
	Routing  string `json:"routing"`
	Source   string `json:"source"`
	Clusters string `json:"clusters"`
	Failover string `json:"failover"`
}

// parts returns the digest's parts by name.
func (d ConfigDigest) parts() map[string]string {
	return map[string]string{"routing": d.Routing, "source": d.Source, "clusters": d.Clusters, "failover": d.Failover}
}

// DigestConfig returns the digest of cfg's fleet-wide parts.
func DigestConfig(cfg config.Config) ConfigDigest {
	src := cfg.Source
	src.MaxInFlightMiB = 0
	clusters := make(map[string]config.Cluster, len(cfg.Clusters))
	for name, c := range cfg.Clusters {
		c.Brokers = slices.Sorted(slices.Values(c.Brokers))
		c.ClientID, c.TLS, c.SASL, c.Proxy = "", config.TLS{}, config.SASL{}, ""
		clusters[name] = c
	}
	d := ConfigDigest{
		Routing:  digestOf(cfg.Routing),
		Source:   digestOf(src),
		Clusters: digestOf(clusters),
		Failover: digestOf(cfg.Failover),
	}
	d.Digest = digestOf([]string{d.Routing, d.Source, d.Clusters, d.Failover})
	return d
}

// digestOf is the first 12 hex digits of the SHA-256 of v's JSON
// (encoding/json sorts map keys, so equal values give equal digests).
func digestOf(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		// The configuration types are plain data; this is a bug.
		panic(fmt.Sprintf("agent: digest of %T: %v", v, err))
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:6])
}

// ConfigDisagreement is an agent whose configuration digest differs from
// the one most agents of its kswitch version report.
type ConfigDisagreement struct {
	Agent   string `json:"agent"`
	Version string `json:"version"`
	Digest  string `json:"digest"`
	// Fleet is the digest most agents report.
	Fleet string `json:"fleet_digest"`
	// Differs names the parts that differ: routing, source, clusters,
	// failover.
	Differs []string `json:"differs"`
}

func (d ConfigDisagreement) String() string {
	return fmt.Sprintf("%s (%s, digest %s; the fleet's %s)", d.Agent, strings.Join(d.Differs, ", "), d.Digest, d.Fleet)
}

// CompareConfigs returns the agents of regs whose configuration digest
// differs from the fleet's, sorted by id: the digest most agents of the
// same kswitch version report, ties going to the leader's, then to the
// smallest digest. Agents of different versions are not compared, since
// a version's new settings change the digest of the same file (during a
// rolling upgrade each version's agents are compared among themselves);
// registrations without a digest (older agents) are skipped.
func CompareConfigs(regs []Registration, leader string) []ConfigDisagreement {
	byVersion := map[string][]Registration{}
	for _, r := range regs {
		if r.Config != nil {
			byVersion[r.Version] = append(byVersion[r.Version], r)
		}
	}
	var out []ConfigDisagreement
	for _, regs := range byVersion {
		fleet := majorityDigest(regs, leader)
		for _, r := range regs {
			if r.Config.Digest == fleet.Digest {
				continue
			}
			var differs []string
			theirs := fleet.parts()
			for _, part := range slices.Sorted(maps.Keys(theirs)) {
				if r.Config.parts()[part] != theirs[part] {
					differs = append(differs, part)
				}
			}
			out = append(out, ConfigDisagreement{Agent: r.ID, Version: r.Version, Digest: r.Config.Digest, Fleet: fleet.Digest, Differs: differs})
		}
	}
	slices.SortFunc(out, func(a, b ConfigDisagreement) int { return strings.Compare(a.Agent, b.Agent) })
	return out
}

// majorityDigest returns the digest most of regs (all with one) report:
// ties go to the leader's, then to the smallest.
func majorityDigest(regs []Registration, leader string) ConfigDigest {
	count := map[string]int{}
	byDigest := map[string]ConfigDigest{}
	leaders := ""
	for _, r := range regs {
		count[r.Config.Digest]++
		byDigest[r.Config.Digest] = *r.Config
		if r.ID == leader {
			leaders = r.Config.Digest
		}
	}
	best := ""
	for _, d := range slices.Sorted(maps.Keys(count)) {
		switch c := cmp.Compare(count[d], count[best]); {
		case best == "" || c > 0:
			best = d
		case c == 0 && d == leaders:
			best = d
		}
	}
	return byDigest[best]
}

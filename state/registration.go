package state

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/keys"
)

// Registration is what an agent writes under agents/<id> on its session
// lease: the key exists exactly while the agent's session lives.
type Registration struct {
	ID      string    `json:"id"`
	HTTP    string    `json:"http"`
	Gossip  string    `json:"gossip"`
	Version string    `json:"version"`
	Started time.Time `json:"started"`
	// Config is the digest of the agent's fleet-wide configuration; nil
	// in the registration of an agent older than it.
	Config *ConfigDigest `json:"config,omitempty"`
	// Lease is the session lease the registration is kept on (set from
	// etcd, not from the value): what the agent writes on its own behalf
	// (acks/<id>) is on this lease.
	Lease clientv3.LeaseID `json:"-"`
}

// maxRegistrationSize bounds what is parsed from agents/: a value written
// there by a stranger must not make an agent allocate without bound.
const maxRegistrationSize = 4 << 10

// ParseRegistration decodes and checks the value of the key agents/<id>.
func ParseRegistration(id string, val []byte) (Registration, error) {
	var r Registration
	if len(val) > maxRegistrationSize {
		return r, fmt.Errorf("state: registration of %q is %d bytes, over the %d-byte limit", id, len(val), maxRegistrationSize)
	}
	if err := json.Unmarshal(val, &r); err != nil {
		return r, fmt.Errorf("state: registration of %q is not valid JSON: %w", id, err)
	}
	if r.ID != id {
		return r, fmt.Errorf("state: registration under key %q names agent %q", id, r.ID)
	}
	if c := r.Config; c != nil {
		for part, d := range map[string]string{"digest": c.Digest, "routing": c.Routing, "source": c.Source, "clusters": c.Clusters, "failover": c.Failover} {
			if !isDigest(d) {
				return r, fmt.Errorf("state: registration of %q: config.%s %q is not a configuration digest (12 lower-case hex digits)", id, part, d)
			}
		}
	}
	return r, nil
}

// isDigest reports whether s is as digestOf writes them.
func isDigest(s string) bool {
	if len(s) != 12 {
		return false
	}
	for _, c := range s {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// ParseRegistrationKV is ParseRegistration of an etcd key-value: a
// registration is an agent's only while its session lease keeps it, so
// one written without a lease (by hand) is refused.
func ParseRegistrationKV(id string, kv *mvccpb.KeyValue) (Registration, error) {
	if kv.Lease == 0 {
		return Registration{}, fmt.Errorf("state: registration of %q has no lease: an agent registers on its session lease, so this one was written by hand and is not a member (delete it)", id)
	}
	r, err := ParseRegistration(id, kv.Value)
	r.Lease = clientv3.LeaseID(kv.Lease)
	return r, err
}

// ReadRegistrations lists the registered agents of a fleet, sorted by id.
// Values that do not parse are skipped and described in refused, so a
// caller can show the good ones and warn about the rest.
func ReadRegistrations(ctx context.Context, c *clientv3.Client, k keys.Fleet) (regs []Registration, refused []string, err error) {
	resp, err := c.Get(ctx, k.Agents(), clientv3.WithPrefix())
	if err != nil {
		return nil, nil, fmt.Errorf("state: list %s: %w", k.Agents(), err)
	}
	for _, kv := range resp.Kvs {
		id, ok := k.AgentID(string(kv.Key))
		if !ok {
			continue
		}
		r, err := ParseRegistrationKV(id, kv)
		if err != nil {
			refused = append(refused, err.Error())
			continue
		}
		regs = append(regs, r)
	}
	slices.SortFunc(regs, func(a, b Registration) int { return strings.Compare(a.ID, b.ID) })
	return regs, refused, nil
}

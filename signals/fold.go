package signals

import (
	"errors"
	"fmt"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/keys"
)

// maxHistory bounds how many earlier versions of a key are read to find
// its last valid value.
const maxHistory = 16

// getAtFunc returns key as it was at revision rev, or nil when it did not
// exist then.
type getAtFunc func(key string, rev int64) (*mvccpb.KeyValue, error)

// entry is what is known of one key under signals/.
type entry struct {
	// createRev, modRev and version describe the key's current value,
	// valid or not.
	createRev, modRev, version int64
	// inForce is the last valid value; nil means start (the key never
	// held a valid value since it was created, or its scope is invalid).
	inForce *Signal
	// refusal is set while the current value is refused.
	refusal *Refusal
}

// fold turns the keys under signals/ and their changes into a State. It is
// not safe for concurrent use: a Watcher calls it from its Follow goroutine
// only.
type fold struct {
	keys  keys.Fleet
	log   *zap.Logger
	now   func() time.Time
	getAt getAtFunc // nil: no history lookups
	// onRefused, when set, is called with each value refused, once per
	// value (a re-read that finds it unchanged does not call it again).
	onRefused func(Refusal)

	entries map[string]*entry
	rev     int64
}

func newFold(k keys.Fleet, log *zap.Logger, getAt getAtFunc) *fold {
	return &fold{keys: k, log: log, now: time.Now, getAt: getAt, entries: map[string]*entry{}}
}

// reset replaces the view with kvs, read at revision rev. Keys whose value
// did not change since they were last seen are left alone (so a refusal is
// not logged again); missing keys are deleted (start).
func (f *fold) reset(kvs []*mvccpb.KeyValue, rev int64) {
	seen := make(map[string]bool, len(kvs))
	for _, kv := range kvs {
		key := string(kv.Key)
		seen[key] = true
		if e := f.entries[key]; e != nil && e.modRev == kv.ModRevision {
			continue
		}
		f.put(kv)
	}
	for key, e := range f.entries {
		if !seen[key] {
			f.del(key, e, rev)
		}
	}
	f.rev = max(f.rev, rev)
}

// apply applies the events of one watch response, in order.
func (f *fold) apply(evs []*clientv3.Event) {
	for _, ev := range evs {
		if ev.Type == clientv3.EventTypeDelete {
			if e := f.entries[string(ev.Kv.Key)]; e != nil {
				f.del(string(ev.Kv.Key), e, ev.Kv.ModRevision)
			}
		} else {
			f.put(ev.Kv)
		}
		f.rev = max(f.rev, ev.Kv.ModRevision)
	}
}

func (f *fold) put(kv *mvccpb.KeyValue) {
	key := string(kv.Key)
	old := f.entries[key]
	e := &entry{createRev: kv.CreateRevision, modRev: kv.ModRevision, version: kv.Version}
	f.entries[key] = e
	scope, err := ParseKey(f.keys, key)
	if err != nil {
		e.refusal = newRefusal(kv, err)
		f.refused(e.refusal)
		f.log.Warn("refused signal key; it has no effect",
			zap.String("key", key), zap.String("value", e.refusal.Value),
			zap.Int64("revision", kv.ModRevision), zap.String("reason", e.refusal.Reason))
		return
	}
	var before *Signal
	if old != nil {
		before = old.inForce
	}
	paused, note, err := Parse(kv.Value)
	if err == nil {
		e.inForce = &Signal{Scope: scope, Paused: paused, Note: note, Revision: kv.ModRevision, Seen: f.now()}
		f.logChange(key, before, e.inForce, kv.ModRevision)
		return
	}
	e.refusal = newRefusal(kv, err)
	f.refused(e.refusal)
	var herr error
	e.inForce, herr = f.lastValid(key, scope, kv, old)
	fields := []zap.Field{
		zap.String("key", key), zap.String("value", e.refusal.Value),
		zap.Int64("revision", kv.ModRevision), zap.String("reason", e.refusal.Reason),
		zap.String("in_force", describe(e.inForce)),
	}
	if e.inForce != nil {
		fields = append(fields, zap.Int64("in_force_revision", e.inForce.Revision))
	}
	if herr != nil {
		fields = append(fields, zap.NamedError("history_error", herr))
	}
	f.log.Warn("refused signal value; the previous state stays in force", fields...)
	if herr == nil {
		f.logChange(key, before, e.inForce, kv.ModRevision)
	}
}

func (f *fold) refused(r *Refusal) {
	if f.onRefused != nil {
		f.onRefused(*r)
	}
}

func (f *fold) del(key string, e *entry, rev int64) {
	delete(f.entries, key)
	if e.inForce != nil {
		f.logChange(key, e.inForce, nil, rev)
	}
}

// lastValid returns the last valid value of key before kv, nil meaning
// start. It walks back through the key's versions since its creation,
// using old (what was known before kv) when it covers the version before,
// else reading etcd's history. When history cannot tell (compacted, too
// many refused versions, etcd unreachable) it returns its best guess, old's
// value in force when old is of the same incarnation of the key, and the
// reason.
func (f *fold) lastValid(key string, scope Scope, kv *mvccpb.KeyValue, old *entry) (*Signal, error) {
	sameLife := old != nil && old.createRev == kv.CreateRevision
	guess := func(err error) (*Signal, error) {
		if sameLife {
			return old.inForce, err
		}
		return nil, err
	}
	cur := kv
	for range maxHistory {
		if cur.Version <= 1 {
			return nil, nil // created with cur's value: before, the key was absent
		}
		if sameLife && old.version == cur.Version-1 {
			return old.inForce, nil
		}
		if f.getAt == nil {
			return guess(errors.New("no history available"))
		}
		prev, err := f.getAt(key, cur.ModRevision-1)
		if err != nil {
			return guess(fmt.Errorf("read %s at revision %d: %w", key, cur.ModRevision-1, err))
		}
		if prev == nil || prev.CreateRevision != kv.CreateRevision {
			return nil, nil
		}
		if paused, note, err := Parse(prev.Value); err == nil {
			if sameLife && old.inForce != nil && old.inForce.Revision == prev.ModRevision {
				return old.inForce, nil // keep when it was first seen
			}
			return &Signal{Scope: scope, Paused: paused, Note: note, Revision: prev.ModRevision, Seen: f.now()}, nil
		}
		cur = prev
	}
	return guess(fmt.Errorf("no valid value in the %d versions before revision %d", maxHistory, kv.ModRevision))
}

func (f *fold) logChange(key string, before, after *Signal, rev int64) {
	was, is := before != nil && before.Paused, after != nil && after.Paused
	fields := []zap.Field{zap.String("key", key), zap.Int64("revision", rev)}
	if after != nil && after.Note != "" {
		fields = append(fields, zap.String("note", after.Note))
	}
	switch {
	case is && !was:
		f.log.Info("signal: paused", fields...)
	case was && !is:
		f.log.Info("signal: started", fields...)
	default:
		f.log.Debug("signal value", append(fields, zap.String("in_force", describe(after)))...)
	}
}

// state returns a snapshot of the view.
func (f *fold) state() State {
	var sigs []Signal
	var refs []Refusal
	for _, e := range f.entries {
		if e.inForce != nil {
			sigs = append(sigs, *e.inForce)
		}
		if e.refusal != nil {
			refs = append(refs, *e.refusal)
		}
	}
	return newState(f.rev, sigs, refs)
}

func newRefusal(kv *mvccpb.KeyValue, reason error) *Refusal {
	return &Refusal{Key: string(kv.Key), Value: truncate(string(kv.Value), maxRefusedValue), Reason: reason.Error(), Revision: kv.ModRevision}
}

func describe(s *Signal) string {
	if s != nil && s.Paused {
		return "pause"
	}
	return "start"
}

package routing

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/etcdwatch"
	"github.com/kswitch/kswitch/internal/refused"
	"github.com/kswitch/kswitch/keys"
)

// MaxValueSize is the largest routes or channel value accepted from etcd;
// a larger one is refused unread.
const MaxValueSize = 1 << 20

// layer is what the router knows of the dynamic layer in etcd, guarded
// by Router.mu.
type layer struct {
	// lastDelete is the revision of the last deletion of a routes or
	// channel key seen; with the keys' mod revisions it numbers versions.
	lastDelete int64
	// tried is the fingerprint of the content last compiled, accepted or
	// refused, so that a re-read that finds nothing new builds nothing.
	tried [32]byte
	// triedNumber is the version number tried was compiled under.
	triedNumber int64
	// dirty is set when a change was seen but could not be read.
	dirty bool
	// failures counts the reads that failed in a row.
	failures int
}

// Refusal is a dynamic version that was refused.
type Refusal struct {
	// Version is the etcd revision of the change that was refused.
	Version int64 `json:"version"`
	// At is when it was refused.
	At time.Time `json:"at"`
	// Reason lists the problems, one per line.
	Reason string `json:"reason"`
	// Current is true while etcd still holds the refused version: the
	// version in force is older than what etcd says.
	Current bool `json:"current"`
}

// Run reads the dynamic layer from etcd (routes and channels/ under the
// fleet's prefix), puts it in force, and follows it until ctx ends: each
// change is validated as a whole with the file's layer and swapped in, or
// refused. Ready is closed after the first read. Without Options.Etcd it
// follows nothing. It also starts the router's loop (retries, the
// producers' sweep, health samples), which runs until Close: Close drains
// through it. It returns ctx.Err(), or an error at once when called twice
// or after Close.
//
// The routes key and the channels prefix are watched separately, and two
// watches deliver their events in no common order; so a change seen by
// either only triggers a read of both at one revision, and what is
// compiled is always a state etcd held (a routes change and the channel
// it needs, written in one transaction, are seen together).
func (r *Router) Run(ctx context.Context) error {
	if !r.started.CompareAndSwap(false, true) {
		return errors.New("routing: Router.Run called twice")
	}
	started := false
	r.loopOnce.Do(func() {
		started = true
		go r.loop() // ends at Close, not with ctx: Close drains through it
	})
	if !started {
		return errors.New("routing: Router.Run after Close")
	}
	c := r.opts.Etcd
	if c == nil {
		<-ctx.Done()
		return ctx.Err()
	}
	var rebuildMu sync.Mutex // one read and compilation at a time, in order
	rebuild := func() {
		rebuildMu.Lock()
		defer rebuildMu.Unlock()
		r.rebuild(ctx, c)
	}
	onErr := func(what string) func(error) {
		failures := 0
		return func(err error) {
			failures++
			if failures == 1 {
				r.log.Warn("watch of the "+what+" interrupted; reading them again", zap.Error(err))
			}
		}
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		_ = etcdwatch.Follow(ctx, c, etcdwatch.Target{Key: r.keys.Routes(), Timeout: r.timeout, OnError: onErr("routes")}, &follower{r: r, rebuild: rebuild})
	})
	wg.Go(func() {
		_ = etcdwatch.Follow(ctx, c, etcdwatch.Target{Key: r.keys.Channels(), Prefix: true, Timeout: r.timeout, OnError: onErr("channels")}, &follower{r: r, rebuild: rebuild})
	})
	wg.Go(func() { // a change seen but not read (etcd failing) is read again
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				r.mu.Lock()
				dirty := r.layer.dirty
				r.mu.Unlock()
				if dirty {
					rebuild()
				}
			}
		}
	})
	wg.Wait()
	return ctx.Err()
}

// follower turns what etcdwatch reads of the routes key or the channels
// prefix into rebuilds, and notes deletions (which number versions).
type follower struct {
	r       *Router
	rebuild func()
	known   map[string]bool // keys present, as far as this follower knows
}

func (f *follower) Reset(kvs []*mvccpb.KeyValue, rev int64) {
	now := map[string]bool{}
	for _, kv := range kvs {
		now[string(kv.Key)] = true
	}
	for k := range f.known {
		if !now[k] { // deleted while the watch was broken: when is unknown
			f.r.noteDelete(rev)
		}
	}
	f.known = now
	f.rebuild()
}

func (f *follower) Apply(evs []*clientv3.Event) {
	if f.known == nil {
		f.known = map[string]bool{}
	}
	for _, ev := range evs {
		if ev.Type == clientv3.EventTypeDelete {
			f.r.noteDelete(ev.Kv.ModRevision)
			delete(f.known, string(ev.Kv.Key))
		} else {
			f.known[string(ev.Kv.Key)] = true
		}
	}
	f.rebuild()
}

func (r *Router) noteDelete(rev int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.layer.lastDelete = max(r.layer.lastDelete, rev)
}

// snapshot is the dynamic layer read at one revision.
type snapshot struct {
	routes   []byte            // nil: absent
	channels map[string][]byte // by name
	maxMod   int64             // the highest mod revision of the keys
}

func readSnapshot(ctx context.Context, c *clientv3.Client, k keys.Fleet) (snapshot, error) {
	resp, err := c.Txn(ctx).Then(clientv3.OpGet(k.Routes()), clientv3.OpGet(k.Channels(), clientv3.WithPrefix())).Commit()
	if err != nil {
		return snapshot{}, err
	}
	s := snapshot{channels: map[string][]byte{}}
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
		s.routes, s.maxMod = kvs[0].Value, kvs[0].ModRevision
		if s.routes == nil {
			s.routes = []byte{} // present and empty: refused, not absent
		}
	}
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		s.channels[strings.TrimPrefix(string(kv.Key), k.Channels())] = kv.Value
		s.maxMod = max(s.maxMod, kv.ModRevision)
	}
	return s, nil
}

// rebuild reads the dynamic layer at one revision, compiles it with the
// file's layer and puts the result in force, or refuses it. Calls are
// serialised by Run.
func (r *Router) rebuild(ctx context.Context, c *clientv3.Client) {
	rctx, cancel := context.WithTimeout(ctx, r.timeout)
	s, err := readSnapshot(rctx, c, r.keys)
	cancel()
	r.mu.Lock()
	l := &r.layer
	if err != nil {
		l.dirty = true
		l.failures++
		n := l.failures
		r.mu.Unlock()
		if n == 1 && ctx.Err() == nil {
			r.log.Warn("cannot read the routes and channels; retrying every second", zap.Error(err))
		}
		return
	}
	l.dirty, l.failures = false, 0
	fp := s.fingerprint()
	number := max(s.maxMod, l.lastDelete)
	// The same content under a higher number is compiled and put in force
	// again: a rebuild that read the layer after a key's deletion but
	// before its event was seen (another follower's, or a relist) numbered
	// the content without the deletion's revision.
	if fp == l.tried && number <= l.triedNumber {
		r.mu.Unlock()
		r.markReady()
		return
	}
	l.tried, l.triedNumber = fp, number
	r.mu.Unlock()

	v, src, err := r.compileLayer(s.routes, s.channels)
	if err != nil {
		r.m.refused.Inc()
		for _, kind := range refusedKinds(err) {
			r.m.refusedValues.WithLabelValues(kind).Inc()
		}
		ref := &Refusal{Version: number, At: time.Now(), Reason: err.Error(), Current: true}
		r.mu.Lock()
		r.refusal = ref
		r.mu.Unlock()
		r.log.Error("routing version refused; the version in force stays", zap.Int64("refused_version", number),
			zap.Int64("version", r.cur.Load().Number), zap.String("reason", err.Error()))
	} else {
		r.mu.Lock()
		if r.refusal != nil {
			r.refusal.Current = false
		}
		r.mu.Unlock()
		r.install(v, number, src)
		r.log.Info("routing version in force", zap.Int64("version", number), zap.String("source", src),
			zap.String("mode", v.Mode()), zap.Strings("rules", v.RuleNames()), zap.Strings("channels", v.ChannelNames()))
	}
	r.markReady()
}

func (r *Router) markReady() {
	select {
	case <-r.ready:
	default:
		close(r.ready)
	}
}

// compileLayer merges etcd's routes and channels values over the file's
// routing and compiles the result.
func (r *Router) compileLayer(routes []byte, chans map[string][]byte) (*Version, string, error) {
	spec, src, err := Merge(r.static, r.keys, routes, chans)
	if err != nil {
		return nil, "", err
	}
	r.mu.Lock()
	clusters := r.clusters
	r.mu.Unlock()
	v, err := Compile(spec, clusters)
	if err != nil {
		return nil, "", err
	}
	return v, src, nil
}

// SetClusters puts new cluster definitions in force (a dynamic
// configuration version, validated by the caller): the routing in force is
// compiled again with them within a second (by Run; at once without
// Options.Etcd), so channels may name a cluster added at run time; the
// producers of a cluster whose definition changed are replaced, and the
// records they failed are sent again through the new ones.
func (r *Router) SetClusters(clusters map[string]config.Cluster) {
	r.mu.Lock()
	r.clusters = clusters
	r.layer.tried = [32]byte{}
	r.layer.dirty = r.opts.Etcd != nil
	r.mu.Unlock()
	r.pool.setClusters(clusters)
	r.txns.setClusters(clusters)
	if r.opts.Etcd == nil {
		if v, src, err := r.compileLayer(nil, nil); err != nil {
			r.log.Error("the routing file does not compile with the new clusters; the version in force stays", zap.Error(err))
		} else {
			r.install(v, r.cur.Load().Number, src)
		}
	}
	select {
	case r.sweepKick <- struct{}{}:
	default:
	}
}

// Merge returns the routing in force when etcd holds routes (the value of
// the routes key, nil when absent) and chans (the channels/ values by
// name) over the static layer: routes, when present, replaces mode, rules,
// default and dead_letter; each channel is added or replaces the static
// one of its name. src is "file" or "file+etcd". The values are decoded
// strictly; the error lists every problem. k names the keys in errors.
func Merge(static Config, k keys.Fleet, routes []byte, chans map[string][]byte) (spec Config, src string, err error) {
	spec, src = static.Clone(), "file"
	var errs []error
	if routes != nil {
		src = "file+etcd"
		switch rt, perr := parseValue(routes, k.Routes(), config.ParseRouting); {
		case perr != nil:
			errs = append(errs, &valueError{kind: refused.Routes, err: perr})
		case len(rt.Channels) > 0:
			errs = append(errs, fmt.Errorf("%s: channels are not part of the routes value; write each channel to %s<name>", k.Routes(), k.Channels()))
		default:
			spec.Mode, spec.Rules, spec.Default, spec.DeadLetter = rt.Mode, rt.Rules, rt.Default, rt.DeadLetter
		}
	}
	for _, name := range slices.Sorted(maps.Keys(chans)) {
		src = "file+etcd"
		ch, perr := parseValue(chans[name], k.Channel(name), config.ParseChannel)
		if perr != nil {
			errs = append(errs, &valueError{kind: refused.Channel, err: perr})
			continue
		}
		if spec.Channels == nil {
			spec.Channels = map[string]Channel{}
		}
		ch.Name = name
		spec.Channels[name] = ch
	}
	if len(errs) > 0 {
		return Config{}, src, &InvalidError{Problems: errs}
	}
	return spec, src, nil
}

// valueError is a routes or channel value of etcd that does not decode.
type valueError struct {
	kind string // refused.Routes or refused.Channel
	err  error
}

func (e *valueError) Error() string { return e.err.Error() }
func (e *valueError) Unwrap() error { return e.err }

// refusedKinds returns the kinds of the values at fault in err, a refused
// version: a value that does not decode, or the part of the merged version
// a problem's path names (channels.<name>… is a channel, the rest is the
// routes).
func refusedKinds(err error) []string {
	var kinds []string
	add := func(k string) {
		if !slices.Contains(kinds, k) {
			kinds = append(kinds, k)
		}
	}
	var ie *InvalidError
	if errors.As(err, &ie) {
		for _, p := range ie.Problems {
			var ve *valueError
			switch {
			case errors.As(p, &ve):
				add(ve.kind)
			case strings.HasPrefix(p.Error(), "channels."):
				add(refused.Channel)
			default:
				add(refused.Routes)
			}
		}
	}
	if len(kinds) == 0 {
		add(refused.Routes)
	}
	return kinds
}

func parseValue[T any](v []byte, key string, parse func([]byte, string) (T, error)) (T, error) {
	var zero T
	if len(v) > MaxValueSize {
		return zero, fmt.Errorf("%s: value of %d bytes is over the limit of %d", key, len(v), MaxValueSize)
	}
	if len(bytes.TrimSpace(v)) == 0 {
		return zero, fmt.Errorf("%s: empty value; delete the key instead", key)
	}
	out, err := parse(v, key)
	if err != nil {
		lines := strings.Split(err.Error(), "\n")
		for i, line := range lines {
			lines[i] = strings.TrimPrefix(line, "config: ")
		}
		return zero, errors.New(strings.Join(lines, "\n"))
	}
	return out, nil
}

// fingerprint identifies the content of the snapshot.
func (s snapshot) fingerprint() [32]byte {
	h := sha256.New()
	if s.routes != nil {
		h.Write([]byte{1})
		fmt.Fprintf(h, "%d:", len(s.routes))
		h.Write(s.routes)
	} else {
		h.Write([]byte{0})
	}
	for _, name := range slices.Sorted(maps.Keys(s.channels)) {
		fmt.Fprintf(h, "%d:%s%d:", len(name), name, len(s.channels[name]))
		h.Write(s.channels[name])
	}
	var out [32]byte
	h.Sum(out[:0])
	return out
}

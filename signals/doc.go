// Package signals reads the pause/start signals operators write to etcd, and
// writes them for the CLI.
//
// # Keys and values
//
// Signals live under keys.Fleet.Signals(), /kswitch/<fleet>/signals/, one
// key per scope:
//
//	signals/fleet               every partition of the fleet
//	signals/topic/<topic>       every partition of one source topic
//	signals/agent/<id>          every partition one agent consumes
//	signals/channel/<channel>   records routed to one channel
//
// A value is the word "pause" or "start" (case and surrounding whitespace
// ignored), optionally followed by "#" and a free-text note:
//
//	etcdctl put /kswitch/orders/signals/fleet pause
//	etcdctl put /kswitch/orders/signals/topic/payments 'pause # 2026-11-30T10:00:00Z by ops@host1: bad batch'
//
// A missing or deleted key means start. The CLI writes "start # …" rather
// than deleting, so that etcd's history shows who resumed.
//
// # Refusals
//
// Anything else is refused: an empty value, another word ("stop",
// "PAUSED!", "{}"), a value over MaxValueSize, a key under signals/ that
// names no scope. A refused value changes nothing: the key keeps the state
// of its last valid value (start when it never had one). The refusal is kept
// in State.Refusals, with the accepted values in its reason, until the key
// gets a valid value or is deleted, and a Watcher logs it at warn once per
// revision.
//
// "Last valid value" is meant as in etcd's history, not in one process's
// memory: a Watcher that follows the key continuously knows it; one that
// starts (or re-reads after a broken watch) when the key already holds a
// refused value looks the previous versions of the key up in etcd (at most
// 16 of them). When they are compacted away it falls back to what
// it knew before, else to start, and says so in its log.
//
// # Readers
//
// Watcher follows the keys for an agent: it reads them all before it is
// Ready (an agent reads signals before it consumes), then applies each
// change within milliseconds and notifies subscribers. Read is a one-shot
// read for `kswitch status` and `kswitch signals`. Both give an immutable
// State, which answers Paused(topic, agent) and ChannelPaused(channel).
package signals

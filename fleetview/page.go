package fleetview

import (
	"bytes"
	"cmp"
	"context"
	_ "embed"
	"encoding/json"
	"fmt"
	"html/template"
	"io"
	"maps"
	"math"
	"net/http"
	"slices"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/coordinator"
	"github.com/kswitch/kswitch/internal/version"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

// Page is the status page every agent serves at /: the fleet as etcd
// records it (what kswitch status reads), each agent's own answer, the
// leader's verdict and a timeline of the switches. Read-only: every change
// goes through etcd. Plain HTML and CSS; it refreshes itself every 5 s
// without a script.
type Page struct {
	// Self is the id of the agent serving the page.
	Self string
	Etcd *clientv3.Client
	// Config returns the configuration in force (the fleet, its clusters
	// for the lag, the naming of the topics' copies).
	Config func() config.Config
	// Leading returns the leader's status when Self leads (nil
	// otherwise); other agents' pages ask the leader's /status.
	Leading func() *coordinator.LeaderStatus
	// Handler, when set, returns the record handler's status to show
	// (the routing sink's rules version, channels and last refusal).
	Handler func() any
}

//go:embed page/page.html
var pageHTML string

var pageTemplate = template.Must(template.New("page").Funcs(template.FuncMap{
	"since": func(t time.Time, now time.Time) string {
		if t.IsZero() {
			return "-"
		}
		return now.Sub(t).Round(time.Second).String()
	},
	"dash": func(n int64) string {
		if n < 0 {
			return "-"
		}
		return fmt.Sprint(n)
	},
	"rate":  func(f float64) string { return fmt.Sprintf("%.0f", f) },
	"inc":   func(i int) int { return i + 1 },
	"stamp": func(t time.Time) string { return t.UTC().Format("2006-01-02 15:04:05.000Z") },
	"ms":    func(s float64) string { return fmt.Sprintf("%.0f ms", s*1000) },
}).Parse(pageHTML))

// pageData is what the page shows.
type pageData struct {
	Agent, Version string
	Now            time.Time
	View           FleetView
	ViewErr        string
	// Leader is the leader's last verdict (its /status), nil when it
	// could not be read (LeaderErr says why).
	Leader    *coordinator.LeaderStatus
	LeaderErr string
	Agents    []pageAgent
	Parts     []pagePartition
	// Handler is this agent's handler status (the routing sink's rules
	// version, channels and last refusal), as indented JSON.
	Handler  string
	LagErr   string
	Timeline pageTimeline
	// TopicEvents are the last maxTopicEvents of history/topics/ (source
	// topics re-created, partitions added or removed), oldest first, and
	// TopicEventsBad what could not be read of them.
	TopicEvents    []state.TopicEvent
	TopicEventsBad []string
}

type pageAgent struct {
	state.Registration
	Leader bool
	Ready  Readiness
	Asked  bool
	Owned  int
	// Lag is the lag of the partitions it owns, -1 when unknown.
	Lag int64
}

type pagePartition struct {
	PartitionView
	Logical string
	Paused  string
}

// pageTimeline is the switches of history/ drawn as SVG: a row per
// switch, its phases as a bar scaled to the longest switch, a square per
// partition colored by its translation method (past tlSquares partitions,
// a bar split by method).
type pageTimeline struct {
	Width, Height int
	Rows          []pageSwitch
	Methods       []pageMethod
}

type pageSwitch struct {
	Y          int
	Ev         state.SwitchEvent
	Label      string
	Took       string
	Phases     []pageRect
	Partitions []pageRect
	Note       string // what is not drawn: partitions kept in chunks, records delivered again or late
	BarX       int
}

type pageRect struct {
	X, W  int
	Class string
	Title string
}

type pageMethod struct{ Name, Class string }

// maxTimeline is how many switches the timeline shows, the last ones.
const maxTimeline = 20

// maxTopicEvents is how many source topic changes the page lists, the
// last ones.
const maxTopicEvents = 20

// data gathers the page's data within the request's context.
func (pg Page) data(ctx context.Context) pageData {
	ctx, cancel := context.WithTimeout(ctx, 4*time.Second)
	defer cancel()
	cfg := pg.Config()
	d := pageData{Agent: pg.Self, Version: version.Version, Now: time.Now()}
	k := keys.New(cfg.Fleet)
	v, err := ReadFleet(ctx, pg.Etcd, k)
	if err != nil {
		d.ViewErr = err.Error()
	}
	v.AskReady(ctx, time.Second)
	if err := v.FillLag(cfg.Clusters); err != nil {
		d.LagErr = err.Error()
	}
	d.View = v
	d.Leader, d.LeaderErr = pg.leaderStatus(ctx, v)
	naming := coordinator.NewNaming(cfg)
	for _, r := range v.Agents {
		pa := pageAgent{Registration: r, Leader: r.ID == v.Leader}
		for _, p := range v.Partitions {
			if p.Owner != r.ID || pa.Lag < 0 {
				continue
			}
			if p.Lag < 0 {
				pa.Lag = -1
				continue
			}
			pa.Lag += p.Lag
		}
		pa.Ready, pa.Asked = v.Ready[r.ID]
		if v.Assignment != nil {
			for _, tps := range v.Assignment.OwnedBy(r.ID) {
				pa.Owned += len(tps)
			}
		}
		d.Agents = append(d.Agents, pa)
	}
	for _, p := range v.Partitions {
		pp := pagePartition{PartitionView: p, Logical: naming.Logical(p.Cluster, p.Topic)}
		if paused, by := v.Signals.Paused(pp.Logical, p.Owner); paused {
			pp.Paused = by.String()
		}
		d.Parts = append(d.Parts, pp)
	}
	if pg.Handler != nil {
		if b, err := json.MarshalIndent(pg.Handler(), "", "  "); err == nil {
			d.Handler = string(b)
		}
	}
	d.Timeline = timeline(pg.switches(ctx, k))
	evs, bad, err := state.ReadTopicEvents(ctx, pg.Etcd, k, maxTopicEvents)
	d.TopicEvents = evs
	for _, err := range append(bad, err) {
		if err != nil {
			d.TopicEventsBad = append(d.TopicEventsBad, err.Error())
		}
	}
	return d
}

// leaderStatus returns the leader's verdict: its own when this agent
// leads, else from the leader's /status.
func (pg Page) leaderStatus(ctx context.Context, v FleetView) (*coordinator.LeaderStatus, string) {
	if v.Leader == "" {
		return nil, "no leader"
	}
	if v.Leader == pg.Self && pg.Leading != nil {
		if st := pg.Leading(); st != nil {
			return st, ""
		}
	}
	var addr string
	for _, r := range v.Agents {
		if r.ID == v.Leader {
			addr = r.HTTP
		}
	}
	if addr == "" {
		return nil, "the leader " + v.Leader + " has no registration"
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/status", nil)
	if err != nil {
		return nil, err.Error()
	}
	resp, err := (&http.Client{Timeout: time.Second}).Do(req)
	if err != nil {
		return nil, fmt.Sprintf("the leader %s did not answer: %v", v.Leader, err)
	}
	defer resp.Body.Close()
	var st struct {
		Coordinator *coordinator.LeaderStatus `json:"coordinator"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 16<<20)).Decode(&st); err != nil {
		return nil, fmt.Sprintf("the leader %s's /status: %v", v.Leader, err)
	}
	if st.Coordinator == nil {
		return nil, "the leader " + v.Leader + " has not decided yet"
	}
	return st.Coordinator, ""
}

// switches returns the last maxTimeline switches of history/, oldest
// first.
func (pg Page) switches(ctx context.Context, k keys.Fleet) []state.SwitchEvent {
	resp, err := pg.Etcd.Get(ctx, k.SwitchHistory(), clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortDescend),
		clientv3.WithLimit(maxTimeline))
	if err != nil {
		return nil
	}
	var out []state.SwitchEvent
	for _, kv := range resp.Kvs {
		if ev, err := state.ParseSwitchEvent(kv.Value); err == nil {
			out = append(out, ev)
		}
	}
	slices.Reverse(out)
	return out
}

// The timeline's geometry, in SVG units.
const (
	tlLabel  = 430 // the text column
	tlBar    = 300 // the longest switch's bar
	tlRow    = 46
	tlSquare = 9
	// tlSquares is how many partitions get a square each; a switch of
	// more draws a bar split by translation method.
	tlSquares = tlBar / (tlSquare + 2)
)

var phaseOrder = []string{"prepare", "revoke", "translate", "activate"}

// timeline draws the switches evs, a row each, their bars scaled to the
// longest, with a legend of the translation methods they used.
func timeline(evs []state.SwitchEvent) pageTimeline {
	tl := pageTimeline{Width: tlLabel + tlBar + 20, Height: max(1, len(evs))*tlRow + 10}
	longest := 0.001
	for _, ev := range evs {
		longest = math.Max(longest, ev.Finished.Sub(ev.Started).Seconds())
	}
	methods := map[string]bool{}
	for i, ev := range evs {
		row, byMethod := timelineRow(i, ev, longest)
		for m := range byMethod {
			methods[m] = true
		}
		tl.Rows = append(tl.Rows, row)
	}
	for _, m := range slices.Sorted(maps.Keys(methods)) {
		tl.Methods = append(tl.Methods, pageMethod{Name: m, Class: "m-" + m})
	}
	return tl
}

// timelineRow draws switch ev as the timeline's i-th row: its phases as a
// bar, longest seconds filling tlBar, and its partitions as squares or,
// past tlSquares, as a bar split by method. It also returns how many
// partitions each translation method translated, for the legend.
func timelineRow(i int, ev state.SwitchEvent, longest float64) (pageSwitch, map[string]int) {
	what := ev.From + " → " + ev.To
	if len(ev.Topics) > 0 {
		what += " (" + strings.Join(ev.Topics, ", ") + ")"
	}
	row := pageSwitch{Y: 10 + i*tlRow, Ev: ev, BarX: tlLabel, Took: ev.Finished.Sub(ev.Started).Round(time.Millisecond).String(),
		Label: fmt.Sprintf("epoch %d %s at %s", ev.Epoch, what, ev.Started.UTC().Format("15:04:05"))}
	if ev.Abandoned != "" {
		row.Label += " (abandoned)"
	}
	x := tlLabel
	for _, ph := range phaseOrder {
		s, ok := ev.Phases[ph]
		if !ok {
			continue
		}
		w := max(1, int(s/longest*tlBar))
		row.Phases = append(row.Phases, pageRect{X: x, W: w, Class: "ph-" + ph, Title: fmt.Sprintf("%s %.0f ms", ph, s*1000)})
		x += w
	}
	var lagged, late int64
	byMethod := map[string]int{}
	for j, ps := range ev.Partitions {
		m := cmp.Or(ps.Method, "unknown")
		byMethod[m]++
		lagged += ps.Lagged
		late += ps.Late
		if len(ev.Partitions) <= tlSquares {
			row.Partitions = append(row.Partitions, pageRect{X: tlLabel + j*(tlSquare+2), W: tlSquare, Class: "m-" + m,
				Title: fmt.Sprintf("%s/%d: %s %d → %s %d by %s", ps.Topic, ps.Partition, ps.FromTopic, ps.FromOffset, ps.ToTopic, ps.ToOffset, m)})
		}
	}
	total := len(ev.Partitions)
	if ev.PartitionChunks > 0 {
		byMethod, total = ev.Methods, ev.PartitionCount
	}
	var note []string
	if total > tlSquares {
		bar, counts := methodBar(byMethod, total)
		row.Partitions = append(row.Partitions, bar...)
		where := ""
		if ev.PartitionChunks > 0 {
			where = " (in history/partitions/)"
		}
		note = append(note, fmt.Sprintf("%d partitions%s: %s", total, where, counts))
	}
	if lagged > 0 || late > 0 {
		note = append(note, fmt.Sprintf("%d may be delivered again (the target lagged), %d late", lagged, late))
	}
	row.Note = strings.Join(note, "; ")
	return row, byMethod
}

// methodBar draws total partitions, too many for a square each, as a bar
// split by translation method (byMethod counts them), each part as wide as
// its share. It also returns the counts as text ("40 by mm2, 3 by
// timestamp").
func methodBar(byMethod map[string]int, total int) ([]pageRect, string) {
	x := tlLabel
	var bar []pageRect
	var counts []string
	for _, m := range slices.Sorted(maps.Keys(byMethod)) {
		n := byMethod[m]
		w := max(1, n*tlBar/max(total, 1))
		bar = append(bar, pageRect{X: x, W: w, Class: "m-" + m, Title: fmt.Sprintf("%d of %d partitions by %s", n, total, m)})
		x += w
		counts = append(counts, fmt.Sprintf("%d by %s", n, m))
	}
	return bar, strings.Join(counts, ", ")
}

// ServeHTTP renders the page.
func (pg Page) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/" {
		http.NotFound(w, r)
		return
	}
	var buf bytes.Buffer
	if err := pageTemplate.Execute(&buf, pg.data(r.Context())); err != nil {
		http.Error(w, "status page: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	_, _ = w.Write(buf.Bytes())
}

package cli

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"go.yaml.in/yaml/v3"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/fleet"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/routing"
)

func newRoutesCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "routes",
		Short: "Check, apply and show the routing rules and channels",
		Long: `The routing rules and channels of a fleet come from the agents' configuration
file (the routing section: the static layer) and from etcd (the dynamic
layer, which every agent follows and validates before use):

  /kswitch/<fleet>/routes            mode, rules, default, dead_letter (YAML);
                                     when present it replaces the file's as a whole
  /kswitch/<fleet>/channels/<name>   one channel (YAML); adds a channel or
                                     replaces the file's channel of that name

A rules file for 'check' and 'apply' is a routing section on its own: mode,
rules, default, dead_letter and channels (see examples/routes.yaml).`,
		Example: `  kswitch routes check -f routes.yaml --config kswitch.yaml --sample records.jsonl
  kswitch routes apply -f routes.yaml --config kswitch.yaml
  kswitch routes show --config kswitch.yaml`,
		Args: cobra.NoArgs,
	}
	cmd.AddCommand(newRoutesCheckCmd(g), newRoutesApplyCmd(g), newRoutesShowCmd(g))
	return cmd
}

// rulesFile is a rules file split into what goes to etcd: the routes
// value (nil when the file names no mode, rule, default or dead-letter,
// so that the routes key is left alone) and one value per channel.
type rulesFile struct {
	spec     routing.Config
	routes   []byte
	channels map[string][]byte
}

// routesValue is the YAML of the routes key.
type routesValue struct {
	Mode       string      `yaml:"mode,omitempty"`
	Rules      []ruleValue `yaml:"rules,omitempty"`
	Default    []string    `yaml:"default,omitempty"`
	DeadLetter string      `yaml:"dead_letter,omitempty"`
}

type ruleValue struct {
	Name     string   `yaml:"name"`
	Match    string   `yaml:"match,omitempty"`
	Channels []string `yaml:"channels,omitempty,flow"`
	Drop     bool     `yaml:"drop,omitempty"`
}

// channelValue is the YAML of a channels/<name> key.
type channelValue struct {
	Cluster     string `yaml:"cluster"`
	Topic       string `yaml:"topic"`
	Key         string `yaml:"key,omitempty"`
	Partitioner string `yaml:"partitioner,omitempty"`
	Compression string `yaml:"compression,omitempty"`
	Acks        string `yaml:"acks,omitempty"`
}

func readRulesFile(path string) (rulesFile, error) {
	if path == "" {
		return rulesFile{}, errors.New("name the rules file with -f FILE")
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return rulesFile{}, err
	}
	spec, err := config.ParseRouting(data, path)
	if err != nil {
		return rulesFile{}, errors.New(strings.ReplaceAll(err.Error(), "config: ", ""))
	}
	f := rulesFile{spec: spec, channels: map[string][]byte{}}
	if spec.Mode != "" || spec.Rules != nil || spec.Default != nil || spec.DeadLetter != "" {
		rv := routesValue{Mode: spec.Mode, Default: spec.Default, DeadLetter: spec.DeadLetter}
		for _, r := range spec.Rules {
			rv.Rules = append(rv.Rules, ruleValue(r))
		}
		if f.routes, err = yaml.Marshal(rv); err != nil {
			return rulesFile{}, err
		}
	}
	for name, ch := range spec.Channels {
		b, err := yaml.Marshal(channelValue{ch.Cluster, ch.Topic, ch.Key, ch.Partitioner, ch.Compression, ch.Acks})
		if err != nil {
			return rulesFile{}, err
		}
		f.channels[name] = b
	}
	return f, nil
}

// loadClusters reads the configuration file (optional) and the KSWITCH_
// environment for the clusters and the static routing layer; it does not
// require the rest of the configuration.
func loadClusters(file string, environ []string) (config.Config, error) {
	cfg := config.Default()
	if file != "" {
		var err error
		if cfg, err = config.Load(file); err != nil {
			return cfg, err
		}
	}
	if err := (*config.Overrides)(nil).Apply(&cfg, environ); err != nil {
		return cfg, err
	}
	return cfg, nil
}

func describeVersion(w io.Writer, v *routing.Version) {
	spec := v.Spec()
	fmt.Fprintf(w, "mode %s; %d rule(s)", spec.Mode, len(spec.Rules))
	if len(spec.Rules) > 0 {
		fmt.Fprintf(w, ": %s", strings.Join(v.RuleNames(), ", "))
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "default route: %s; dead-letter: %s\n", cmp.Or(strings.Join(spec.Default, ", "), "none (unmatched records are dropped)"),
		cmp.Or(spec.DeadLetter, "none (a record that fails stops its partition)"))
	for _, name := range v.ChannelNames() {
		ch := spec.Channels[name]
		fmt.Fprintf(w, "channel %s → cluster %s topic %s (key %s, partitioner %s, compression %s, acks %s)\n",
			name, ch.Cluster, ch.Topic, ch.Key, ch.Partitioner, ch.Compression, ch.Acks)
	}
}

func newRoutesCheckCmd(g *globals) *cobra.Command {
	var file, sample, cfgFile, fleetName string
	cmd := &cobra.Command{
		Use:   "check -f rules.yaml [--config kswitch.yaml] [--sample records.jsonl]",
		Short: "Validate a rules file and show where sample records would go",
		Long: `Validate a rules file as the agents will once it is applied: the file's routes
replace those of the configuration file's routing section, its channels are
added to the configuration file's, every expression must compile and stay
within its cost bound on test records up to 1 MiB, every channel a rule, the
default route or the dead-letter names must exist, and every channel's
cluster must be one of the configuration's clusters
(--config, or KSWITCH_CLUSTERS_<NAME>_BROKERS). Channels already in etcd are
not consulted: 'apply' checks with them.

With --sample, each line of the file is a JSON record, and check prints the
channels it would go to:

  {"topic": "orders", "partition": 0, "offset": 7, "key": "c-1",
   "value": {"amount": 1500}, "headers": {"test": "false"},
   "timestamp": "2026-01-02T03:04:05Z", "cluster": "A"}

A string value is the record's bytes; any other JSON value is its JSON text.
A record of a copy names it with "physical_topic" and "origin" (topic is the
logical name): {"topic": "orders", "physical_topic": "B.orders", "origin":
"B", "cluster": "A"}. Every field is optional.`,
		Example: `  kswitch routes check -f routes.yaml --config kswitch.yaml
  kswitch routes check -f routes.yaml --config kswitch.yaml --sample records.jsonl`,
		Args: cobra.NoArgs,
	}
	fs := cmd.Flags()
	fs.StringVarP(&file, "file", "f", "", "rules file (YAML: mode, rules, default, dead_letter, channels)")
	fs.StringVar(&sample, "sample", "", "JSON lines file of records to route")
	fs.StringVarP(&cfgFile, "config", "c", "", "agent configuration file: its clusters and its routing section")
	fs.StringVar(&fleetName, "fleet", "", "fleet whose etcd keys errors name (default: fleet of --config, else check)")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		rf, err := readRulesFile(file)
		if err != nil {
			return err
		}
		cfg, err := loadClusters(cfgFile, g.environ)
		if err != nil {
			return err
		}
		fleetName = cmp.Or(fleetName, cfg.Fleet, "check")
		if err := keys.ValidName(fleetName); err != nil {
			return fmt.Errorf("--fleet %q: %v", fleetName, err)
		}
		v, checked, err := fleet.CompileRouting(cfg, fleetName, rf.routes, rf.channels)
		if err != nil {
			return fmt.Errorf("%s is invalid; agents would refuse it and keep their version:\n%w", file, err)
		}
		w := cmd.OutOrStdout()
		fmt.Fprintf(w, "%s is valid\n", file)
		if !checked {
			fmt.Fprintln(w, "note: no clusters configured (--config or KSWITCH_CLUSTERS_*): the channels' clusters were not checked")
		}
		describeVersion(w, v)
		if sample == "" {
			return nil
		}
		return routeSamples(w, sample, v)
	}
	return cmd
}

// sampleRecord is one line of a --sample file.
type sampleRecord struct {
	Cluster   string            `json:"cluster"`
	Topic     string            `json:"topic"`
	Partition int32             `json:"partition"`
	Offset    int64             `json:"offset"`
	Key       *string           `json:"key"`
	Value     json.RawMessage   `json:"value"`
	Headers   map[string]string `json:"headers"`
	Timestamp time.Time         `json:"timestamp"`
	// PhysicalTopic and Origin describe a copy (B.orders on A, written
	// on B); by default the record is from topic's local topic.
	PhysicalTopic string `json:"physical_topic"`
	Origin        string `json:"origin"`
}

func (s sampleRecord) record() (*record.Record, error) {
	r := &record.Record{Cluster: s.Cluster, Topic: cmp.Or(s.PhysicalTopic, s.Topic), SourceTopic: s.Topic, Origin: s.Origin,
		Partition: s.Partition, Offset: s.Offset, Timestamp: s.Timestamp}
	if s.Key != nil {
		r.Key = []byte(*s.Key)
	}
	switch v := bytes.TrimSpace(s.Value); {
	case len(v) == 0 || string(v) == "null":
	case v[0] == '"':
		var str string
		if err := json.Unmarshal(v, &str); err != nil {
			return nil, err
		}
		r.Value = []byte(str)
	default:
		r.Value = v
	}
	for _, k := range slices.Sorted(maps.Keys(s.Headers)) {
		r.Headers = append(r.Headers, record.Header{Key: []byte(k), Value: []byte(s.Headers[k])})
	}
	return r, nil
}

func routeSamples(w io.Writer, path string, v *routing.Version) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	fmt.Fprintf(w, "\nsample records (%s):\n", path)
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	n, bad := 0, 0
	for sc.Scan() {
		n++
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		var s sampleRecord
		dec := json.NewDecoder(bytes.NewReader(line))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&s); err != nil {
			return fmt.Errorf("%s line %d: %v", path, n, err)
		}
		rec, err := s.record()
		if err != nil {
			return fmt.Errorf("%s line %d: value: %v", path, n, err)
		}
		where := fmt.Sprintf("line %d %s/%d@%d", n, rec.Topic, rec.Partition, rec.Offset)
		d, err := v.Route(rec)
		switch {
		case err != nil && v.DeadLetter() != "":
			fmt.Fprintf(w, "%s: → dead-letter %s: %v\n", where, v.DeadLetter(), err)
		case err != nil:
			bad++
			fmt.Fprintf(w, "%s: FAILS, and there is no dead-letter channel (its partition would stop): %v\n", where, err)
		case d.Dropped == routing.DropRule:
			fmt.Fprintf(w, "%s: dropped by rule %s\n", where, d.DropRule)
		case d.Dropped == routing.DropNoMatch:
			fmt.Fprintf(w, "%s: dropped: no rule matched and there is no default route\n", where)
		default:
			by := "the default route"
			if len(d.Rules) > 0 {
				by = "rules " + strings.Join(d.Rules, ", ")
			}
			fmt.Fprintf(w, "%s: → %s (%s)\n", where, strings.Join(d.Channels, ", "), by)
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if bad > 0 {
		return fmt.Errorf("%d sample record(s) fail to evaluate and there is no dead-letter channel", bad)
	}
	return nil
}

func newRoutesApplyCmd(g *globals) *cobra.Command {
	var ef etcdFlags
	var file string
	var dryRun bool
	cmd := &cobra.Command{
		Use:   "apply -f rules.yaml --config kswitch.yaml",
		Short: "Validate a rules file with what etcd holds, then write it to etcd",
		Long: `Validate a rules file as the agents will — over the configuration file's
routing section and the channels already in etcd, against the configuration's
clusters — and, if it is valid, write it to etcd in one transaction: its mode,
rules, default and dead_letter to /kswitch/<fleet>/routes (left alone when the
file has none of them), each of its channels to /kswitch/<fleet>/channels/<name>.
Channels in etcd that the file does not name are kept. The transaction fails,
writing nothing, if a key it writes changed since it was read.

Every agent follows these keys and swaps the new version in between two
records; one that finds it invalid (a different configuration) refuses it
and keeps its version: see 'kswitch routes show' and the agents' /status.`,
		Example: `  kswitch routes apply -f routes.yaml --config kswitch.yaml
  kswitch routes apply -f routes.yaml --config kswitch.yaml --dry-run`,
		Args: cobra.NoArgs,
	}
	ef.bind(cmd)
	cmd.Flags().StringVarP(&file, "file", "f", "", "rules file (YAML: mode, rules, default, dead_letter, channels)")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "validate with what etcd holds, and write nothing")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		rf, err := readRulesFile(file)
		if err != nil {
			return err
		}
		cn, err := ef.open(cmd, g.environ)
		if err != nil {
			return err
		}
		defer cn.close()
		cfg, ctx, op := cn.cfg, cn.ctx, cn.op
		if len(cfg.Clusters) == 0 {
			return errors.New("apply validates the channels against the agents' clusters: pass --config (or set KSWITCH_CLUSTERS_<NAME>_BROKERS)")
		}
		change := fleet.RoutingChange{Routes: rf.routes, Channels: rf.channels}
		if change.Routes == nil && len(change.Channels) == 0 {
			return fmt.Errorf("%s names no mode, rule, default, dead_letter or channel: nothing to write", file)
		}
		w := cmd.OutOrStdout()
		if dryRun {
			v, l, err := op.CheckRoutes(ctx, cfg, change)
			if err != nil {
				return invalidRules(file, err)
			}
			fmt.Fprintf(w, "%s is valid with what etcd holds (revision %d); --dry-run: nothing written\n", file, l.Revision)
			describeVersion(w, v)
			return nil
		}
		v, rev, wrote, err := op.ApplyRoutes(ctx, cfg, change)
		var ie *routing.InvalidError
		switch {
		case errors.As(err, &ie):
			return invalidRules(file, err)
		case err != nil:
			return fmt.Errorf("%w (etcd %v)", err, ef.endpoints)
		}
		for _, key := range wrote {
			fmt.Fprintf(w, "put %s\n", key)
		}
		fmt.Fprintf(w, "version %d written: agents put it in force within moments ('kswitch routes show'; each agent's /status)\n", rev)
		describeVersion(w, v)
		return nil
	}
	return cmd
}

// routesShow is the JSON of 'routes show'.
type routesShow struct {
	Fleet    string            `json:"fleet"`
	Revision int64             `json:"revision"`
	Version  int64             `json:"version"`
	Routes   *string           `json:"routes"`
	Channels map[string]string `json:"channels"`
	Valid    bool              `json:"valid"`
	// ClustersChecked is false when no clusters were configured to check
	// the channels against.
	ClustersChecked bool     `json:"clusters_checked"`
	Problems        []string `json:"problems"`
	Mode            string   `json:"mode,omitempty"`
	Rules           []string `json:"rules"`
	ChannelNames    []string `json:"channels_in_force"`
	Default         []string `json:"default"`
	DeadLetter      string   `json:"dead_letter,omitempty"`
}

func newRoutesShowCmd(g *globals) *cobra.Command {
	var ef etcdFlags
	var output string
	cmd := &cobra.Command{
		Use:   "show [-o text|json]",
		Short: "Print the routes and channels in etcd and whether agents accept them",
		Long: `Print the dynamic layer in etcd (/kswitch/<fleet>/routes and channels/<name>)
and validate it as the agents do: merged over the configuration file's routing
section, against its clusters (--config, or KSWITCH_CLUSTERS_*). When it is
invalid, the agents refuse it and keep their last good version (each agent's
/status shows the version in force and the refusal). The version is the etcd
revision of the last change, the number agents report as
kswitch_config_version.`,
		Example: `  kswitch routes show --config kswitch.yaml
  kswitch routes show --etcd 127.0.0.1:2379 --fleet orders -o json`,
		Args: cobra.NoArgs,
	}
	ef.bind(cmd)
	cmd.Flags().StringVarP(&output, "output", "o", "text", "output format: text or json")
	cmd.RunE = ef.runWith(g.environ, &output, []string{"text", "json"}, func(cmd *cobra.Command, cn *conn) error {
		l, err := cn.op.Routing(cn.ctx)
		if err != nil {
			return err
		}
		s, v := newRoutesShow(cn.cfg, ef.fleet, l)
		if output == "json" {
			enc := json.NewEncoder(cmd.OutOrStdout())
			enc.SetIndent("", "  ")
			enc.SetEscapeHTML(false)
			return enc.Encode(s)
		}
		s.print(cmd.OutOrStdout(), cn.keys, l, v, cn.cfg.Routing.Configured())
		return nil
	})
	return cmd
}

// newRoutesShow validates the routing layer l in etcd as the agents do:
// merged over cfg's routing section, against its clusters. It returns what
// 'routes show' prints, and the version compiled (nil when l is invalid).
func newRoutesShow(cfg config.Config, fleetName string, l fleet.RoutingLayer) (routesShow, *routing.Version) {
	s := routesShow{Fleet: fleetName, Revision: l.Revision, Version: l.Version(), Channels: map[string]string{},
		Problems: []string{}, Rules: []string{}, ChannelNames: []string{}, Default: []string{}}
	if l.Routes != nil {
		r := string(l.Routes)
		s.Routes = &r
	}
	for name, v := range l.Channels {
		s.Channels[name] = string(v)
	}
	v, checked, err := fleet.CompileRouting(cfg, fleetName, l.Routes, l.Channels)
	s.ClustersChecked = checked
	if err != nil {
		var ie *routing.InvalidError
		if errors.As(err, &ie) {
			for _, p := range ie.Problems {
				s.Problems = append(s.Problems, p.Error())
			}
		} else {
			s.Problems = append(s.Problems, err.Error())
		}
		return s, nil
	}
	spec := v.Spec()
	s.Valid, s.Mode, s.Rules, s.ChannelNames, s.DeadLetter = true, spec.Mode, v.RuleNames(), v.ChannelNames(), spec.DeadLetter
	s.Default = append(s.Default, spec.Default...)
	return s, v
}

// print writes s as text to w: each key of the layer l with its revision,
// then whether agents accept it and, when they do, the version v they put
// in force. fileRouting says whether the configuration file has a routing
// section of its own (the layer is merged with it).
func (s routesShow) print(w io.Writer, k keys.Fleet, l fleet.RoutingLayer, v *routing.Version, fileRouting bool) {
	fmt.Fprintf(w, "fleet %s: routing in etcd at revision %d (version %d)\n\n", s.Fleet, s.Revision, s.Version)
	if s.Routes == nil {
		fmt.Fprintf(w, "%s: absent (the configuration file's rules apply)\n", k.Routes())
	} else {
		fmt.Fprintf(w, "%s (revision %d):\n%s\n", k.Routes(), l.RoutesAt, indent(*s.Routes))
	}
	if len(l.Channels) == 0 {
		fmt.Fprintf(w, "%s: none (the configuration file's channels apply)\n", k.Channels())
	}
	for _, name := range slices.Sorted(maps.Keys(l.Channels)) {
		fmt.Fprintf(w, "%s (revision %d):\n%s\n", k.Channel(name), l.ChannelsAt[name], indent(s.Channels[name]))
	}
	fmt.Fprintln(w)
	if !s.Valid {
		fmt.Fprintln(w, "INVALID: agents refuse this version and keep their last good one:")
		for _, p := range s.Problems {
			fmt.Fprintf(w, "  %s\n", p)
		}
		return
	}
	what := "valid"
	if !s.ClustersChecked {
		what = "valid, but the channels' clusters were not checked (no --config or KSWITCH_CLUSTERS_*)"
	} else if fileRouting {
		what = "valid, merged with the configuration file's routing"
	}
	fmt.Fprintf(w, "%s:\n", what)
	describeVersion(w, v)
}

func indent(s string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	for i, l := range lines {
		lines[i] = "  " + l
	}
	return strings.Join(lines, "\n")
}

// invalidRules says that the rules file is invalid with what etcd holds,
// and that nothing was written.
func invalidRules(file string, err error) error {
	return fmt.Errorf("%s is invalid (with the configuration file's routing and the channels in etcd); nothing written:\n%w", file, err)
}

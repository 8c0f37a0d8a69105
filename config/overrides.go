package config

import (
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"

	"github.com/spf13/pflag"
)

// envPrefix starts every environment variable the configuration reads.
const envPrefix = "KSWITCH_"

// Overrides are the command-line flags registered by BindFlags, applied to
// a Config together with the environment by Apply.
type Overrides struct {
	fs       *pflag.FlagSet
	leaves   []*leafFlag
	clusters *clusterFlag
}

// BindFlags registers on fs one flag per configuration leaf, named by its
// dotted YAML path (--fleet, --agent.id, --etcd.session_ttl, ...), whose
// help names the environment variable and shows the default of Default(),
// and the repeatable --cluster NAME.field=value. List flags take
// comma-separated values; repeating one appends.
//
// Flag values are checked as they are parsed, so fs.Parse reports a bad
// duration naming the flag. The returned Overrides reads fs when Apply is
// called, after fs has been parsed.
func BindFlags(fs *pflag.FlagSet) *Overrides {
	o := &Overrides{fs: fs}
	for _, l := range configLeaves {
		f := &leafFlag{leaf: l}
		if l.def != "" {
			f.value, _ = parseValue(l.typ, l.def, "")
		} else {
			f.value = reflect.New(l.typ).Elem()
		}
		usage := fmt.Sprintf("%s [env %s]", l.help, l.env())
		fs.Var(f, l.path, usage)
		if l.typ.Kind() == reflect.Bool {
			fs.Lookup(l.path).NoOptDefVal = "true" // --etcd.tls.enabled alone means true
		}
		o.leaves = append(o.leaves, f)
	}
	o.clusters = &clusterFlag{}
	fs.Var(o.clusters, "cluster", fmt.Sprintf(
		"set a field of a Kafka cluster, creating the cluster if it is new; repeatable, e.g. "+
			"--cluster A.brokers=h1:9092,h2:9092 --cluster B.role=standby (fields: %s; defaults version=%s client_id=%s) "+
			"[env KSWITCH_CLUSTERS_<NAME>_<FIELD>]",
		clusterFields(), DefaultKafkaVersion, DefaultClientID))
	return o
}

// Apply sets on c the values of the environment (environ holds "KEY=value"
// entries, as os.Environ returns them) and then of the flags explicitly set
// on the command line, so a flag beats its variable, which beats the file.
// A nil *Overrides applies the environment only.
//
// The environment variables are KSWITCH_<PATH> for each leaf (e.g.
// KSWITCH_ETCD_SESSION_TTL) and KSWITCH_CLUSTERS_<NAME>_<FIELD> (e.g.
// KSWITCH_CLUSTERS_B_BROKERS), where NAME matches an existing cluster
// case-insensitively and otherwise creates one. Lists are comma-separated.
// A variable set to the empty string is ignored, as templated deployments
// often render unset values that way. A KSWITCH_ variable under a
// configuration section (KSWITCH_ETCD_..., KSWITCH_CLUSTERS_..., ...) that
// names no field is an error, to catch typos; other KSWITCH_ variables are
// left to the rest of the program.
//
// Apply checks only that values parse (durations); Validate checks the
// result. Every problem is reported, joined, naming the variable or flag.
func (o *Overrides) Apply(c *Config, environ []string) error {
	if c.Clusters == nil {
		c.Clusters = map[string]Cluster{}
	}
	errs := applyEnv(c, environ)
	if o != nil {
		root := reflect.ValueOf(c).Elem()
		for _, f := range o.leaves {
			if o.fs.Changed(f.path) {
				f.field(root).Set(f.value)
			}
		}
		if o.fs.Changed("cluster") {
			for _, s := range o.clusters.sets {
				if err := setCluster(c, s.name, s.field, s.value, s.add); err != nil {
					errs = append(errs, fmt.Errorf("config: --cluster %s.%s: %w", s.name, s.field.path, err))
				}
			}
		}
	}
	c.fillClusterDefaults()
	return errors.Join(errs...)
}

func applyEnv(c *Config, environ []string) []error {
	env := map[string]string{}
	for _, kv := range environ {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || !strings.HasPrefix(k, envPrefix) || v == "" {
			continue
		}
		if _, dup := env[k]; !dup { // the first wins, as with os.Getenv
			env[k] = v
		}
	}
	var errs []error
	root := reflect.ValueOf(c).Elem()
	for _, l := range configLeaves {
		s, ok := env[l.env()]
		if !ok {
			continue
		}
		delete(env, l.env())
		v, err := parseValue(l.typ, s, l.example())
		if err != nil {
			errs = append(errs, fmt.Errorf("config: %s=%q: %w", l.env(), s, err))
			continue
		}
		l.field(root).Set(v)
	}

	// What is left is clusters and unknown variables; go in name order so
	// that the outcome does not depend on the order of environ.
	sections := map[string]bool{}
	for _, l := range configLeaves {
		if section, _, nested := strings.Cut(l.path, "."); nested {
			sections[envName(section)+"_"] = true
		}
	}
	clusterPrefix := envName("clusters") + "_"
	for _, k := range slices.Sorted(maps.Keys(env)) {
		s := env[k]
		if rest, ok := strings.CutPrefix(k, clusterPrefix); ok {
			name, l, ok := clusterEnvField(rest)
			if !ok {
				errs = append(errs, fmt.Errorf("config: %s: not a cluster field; write %s<NAME>_<FIELD> with FIELD one of %s",
					k, clusterPrefix, clusterEnvFields()))
				continue
			}
			v, err := parseValue(l.typ, s, l.example())
			if err == nil {
				err = setCluster(c, name, l, v, false)
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("config: %s=%q: %w", k, s, err))
			}
			continue
		}
		if path, ok := fileOnlyEnv(k); ok {
			errs = append(errs, fmt.Errorf("config: %s: %s has no environment variable; set it in the configuration file, or in etcd with 'kswitch routes apply'", k, path))
			continue
		}
		for section := range sections {
			if strings.HasPrefix(k, section) {
				errs = append(errs, fmt.Errorf("config: %s: unknown variable (known: %s)", k, sectionEnvs(section)))
				break
			}
		}
	}
	return errs
}

// clusterEnvField splits the part of KSWITCH_CLUSTERS_<NAME>_<FIELD> after
// the prefix. NAME may itself contain '_', so the field is matched as the
// longest known suffix.
func clusterEnvField(rest string) (string, leaf, bool) {
	var best leaf
	var name string
	for _, l := range clusterLeaves {
		suffix := "_" + l.envField()
		if n, ok := strings.CutSuffix(rest, suffix); ok && n != "" && len(l.path) > len(best.path) {
			name, best = n, l
		}
	}
	return name, best, name != ""
}

// fileOnlyEnv reports whether k is the variable a file-only field would
// have (or one below it), and that field's path.
func fileOnlyEnv(k string) (string, bool) {
	for _, path := range fileOnlyPaths {
		if env := envName(path); k == env || strings.HasPrefix(k, env+"_") {
			return path, true
		}
	}
	return "", false
}

func clusterFields() string {
	var out []string
	for _, l := range clusterLeaves {
		out = append(out, l.path)
	}
	return strings.Join(out, ", ")
}

func clusterEnvFields() string {
	var out []string
	for _, l := range clusterLeaves {
		out = append(out, l.envField())
	}
	return strings.Join(out, ", ")
}

func sectionEnvs(section string) string {
	var out []string
	for _, l := range configLeaves {
		if strings.HasPrefix(l.env(), section) {
			out = append(out, l.env())
		}
	}
	return strings.Join(out, ", ")
}

// setCluster sets one field of the cluster called name: the existing cluster
// of exactly that name, else the one whose name differs only in case, else
// a new cluster. add appends to a list instead of replacing it.
func setCluster(c *Config, name string, l leaf, v reflect.Value, add bool) error {
	key, err := clusterKey(c, name)
	if err != nil {
		return err
	}
	cl, ok := c.Clusters[key]
	if !ok {
		cl = defaultCluster()
	}
	f := l.field(reflect.ValueOf(&cl).Elem())
	if add && f.Kind() == reflect.Slice {
		v = reflect.AppendSlice(f, v)
	}
	f.Set(v)
	c.Clusters[key] = cl
	return nil
}

func clusterKey(c *Config, name string) (string, error) {
	if _, ok := c.Clusters[name]; ok {
		return name, nil
	}
	var matches []string
	for k := range c.Clusters {
		if strings.EqualFold(k, name) {
			matches = append(matches, k)
		}
	}
	switch len(matches) {
	case 0:
		return name, nil
	case 1:
		return matches[0], nil
	default:
		slices.Sort(matches)
		return "", fmt.Errorf("cluster %q matches clusters %s, which differ only in case; rename one", name, strings.Join(matches, " and "))
	}
}

// leafFlag is the pflag.Value of one leaf. It holds the typed value so that
// a bad value fails fs.Parse, with pflag naming the flag.
type leafFlag struct {
	leaf
	value   reflect.Value
	changed bool // whether Set was called: a later Set of a list appends
}

func (f *leafFlag) String() string {
	if !f.value.IsValid() {
		return ""
	}
	return formatValue(f.value)
}

func (f *leafFlag) Set(s string) error {
	v, err := parseValue(f.typ, s, f.example())
	if err != nil {
		return err
	}
	if f.changed && f.typ == stringListType {
		v = reflect.AppendSlice(f.value, v)
	}
	f.value, f.changed = v, true
	return nil
}

func (f *leafFlag) Type() string {
	switch {
	case f.typ == durationType:
		return "duration"
	case f.typ == stringListType:
		return "strings"
	case f.typ.Kind() == reflect.Int:
		return "int"
	case f.typ.Kind() == reflect.Bool:
		return "bool"
	default:
		return "string"
	}
}

// clusterFlag is the pflag.Value of --cluster: the list of assignments in
// command-line order.
type clusterFlag struct {
	sets []clusterSet
}

type clusterSet struct {
	name  string
	field leaf
	value reflect.Value
	add   bool // append: the same cluster list field was set before
}

func (f *clusterFlag) String() string {
	var out []string
	for _, s := range f.sets {
		out = append(out, fmt.Sprintf("%s.%s=%s", s.name, s.field.path, formatValue(s.value)))
	}
	return strings.Join(out, " ")
}

func (f *clusterFlag) Type() string { return "NAME.field=value" }

func (f *clusterFlag) Set(s string) error {
	target, value, ok := strings.Cut(s, "=")
	if !ok || !strings.Contains(target, ".") || target[0] == '.' {
		return fmt.Errorf("want NAME.field=value, e.g. A.brokers=h1:9092,h2:9092")
	}
	// Cluster names and field paths (tls.ca_file) may both contain '.':
	// the field is the longest known path that ends target.
	var l leaf
	for _, c := range clusterLeaves {
		if n, ok := strings.CutSuffix(target, "."+c.path); ok && n != "" && len(c.path) > len(l.path) {
			l = c
		}
	}
	if l.path == "" {
		return fmt.Errorf("unknown cluster field %q (known: %s)", target[strings.LastIndexByte(target, '.')+1:], clusterFields())
	}
	name, field := strings.TrimSuffix(target, "."+l.path), l.path
	v, err := parseValue(l.typ, value, l.example())
	if err != nil {
		return err
	}
	add := l.typ == stringListType && slices.ContainsFunc(f.sets, func(p clusterSet) bool {
		return p.name == name && p.field.path == field
	})
	f.sets = append(f.sets, clusterSet{name: name, field: l, value: v, add: add})
	return nil
}

package config

import (
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"time"
)

// A leaf is one settable value of the configuration: a string, a list of
// strings, a duration, a whole number or a bool. The leaf tables below are
// derived from the yaml and help tags of Config and Cluster, and drive the
// file decoder's known-field lists, the environment variables, the flags and
// their help, so a field is declared exactly once.
type leaf struct {
	path  string       // dotted YAML path below the root, e.g. "etcd.session_ttl"
	index []int        // reflect field index below the root type
	typ   reflect.Type // string kind, []string or time.Duration
	help  string       // one-line help, without the default
	def   string       // the default, formatted as a flag or env value would be
}

var (
	durationType   = reflect.TypeFor[time.Duration]()
	stringListType = reflect.TypeFor[[]string]()
	secretType     = reflect.TypeFor[Secret]()
	proxyURLType   = reflect.TypeFor[ProxyURL]()

	// configLeaves are the leaves of Config outside the clusters map.
	configLeaves = leavesOf(reflect.ValueOf(Default()), "", nil)
	// clusterLeaves are the leaves of one cluster, paths relative to it.
	clusterLeaves = leavesOf(reflect.ValueOf(defaultCluster()), "", nil)
	// fileOnlyPaths are the dotted paths of the fields tagged leaf:"-".
	fileOnlyPaths = fileOnlyOf(reflect.TypeFor[Config](), "")
)

// fileOnly reports whether a struct field is tagged leaf:"-": part of the
// file's schema, but with no environment variable or flag. Lists and maps
// of structures (routing.rules, routing.channels) are: they have no
// one-line syntax, and come from the file or etcd only.
func fileOnly(f reflect.StructField) bool { return f.Tag.Get("leaf") == "-" }

// leavesOf lists the leaves of the struct def (a default value, which
// supplies each leaf's default), skipping maps, which hold named entries
// and are handled by their own overrides, and fields tagged leaf:"-". Any
// other field whose type has no env/flag syntax is a programming error and
// panics, so that a new field cannot silently lack its variable and flag.
func leavesOf(def reflect.Value, prefix string, index []int) []leaf {
	var out []leaf
	t := def.Type()
	for i := range t.NumField() {
		f := t.Field(i)
		name := yamlName(f)
		if name == "" || fileOnly(f) {
			continue
		}
		path := prefix + name
		idx := append(index[:len(index):len(index)], i)
		switch {
		case f.Type.Kind() == reflect.Struct:
			out = append(out, leavesOf(def.Field(i), path+".", idx)...)
		case f.Type.Kind() == reflect.Map:
			continue
		case isLeafType(f.Type):
			out = append(out, leaf{
				path:  path,
				index: idx,
				typ:   f.Type,
				help:  f.Tag.Get("help"),
				def:   formatValue(def.Field(i)),
			})
		default:
			panic(fmt.Sprintf("config: field %s has type %s, which has no env/flag syntax", path, f.Type))
		}
	}
	return out
}

// fileOnlyOf lists the paths of the fields of struct type t tagged
// leaf:"-", at any depth outside maps.
func fileOnlyOf(t reflect.Type, prefix string) []string {
	var out []string
	for i := range t.NumField() {
		f := t.Field(i)
		name := yamlName(f)
		switch {
		case name == "":
		case fileOnly(f):
			out = append(out, prefix+name)
		case f.Type.Kind() == reflect.Struct && f.Type != durationType:
			out = append(out, fileOnlyOf(f.Type, prefix+name+".")...)
		}
	}
	return out
}

// yamlName is the YAML key of a struct field, or "" for a field that is not
// part of the schema.
func yamlName(f reflect.StructField) string {
	if !f.IsExported() {
		return ""
	}
	name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
	if name == "-" {
		return ""
	}
	if name == "" {
		return strings.ToLower(f.Name)
	}
	return name
}

func isLeafType(t reflect.Type) bool {
	return t == durationType || t.Kind() == reflect.String || t.Kind() == reflect.Int || t.Kind() == reflect.Bool || t == stringListType
}

// env is the environment variable of a static leaf.
func (l leaf) env() string { return envName(l.path) }

// envField is the part a cluster leaf adds to KSWITCH_CLUSTERS_<NAME>_.
func (l leaf) envField() string { return strings.ToUpper(strings.ReplaceAll(l.path, ".", "_")) }

func envName(path string) string {
	return "KSWITCH_" + strings.ToUpper(strings.ReplaceAll(path, ".", "_"))
}

// example is a valid value to quote in an error message: the default, or a
// generic one where the default is empty.
func (l leaf) example() string {
	if l.def != "" {
		return l.def
	}
	if l.typ == durationType {
		return "1s"
	}
	return ""
}

// field returns the leaf's field within root, which must be the leaf
// table's root type (Config or Cluster).
func (l leaf) field(root reflect.Value) reflect.Value { return root.FieldByIndex(l.index) }

// parseValue parses s, an environment or flag value, into a value of type t.
// Lists are comma-separated; blanks around items and empty items are
// dropped. The error does not name the source; the caller does.
func parseValue(t reflect.Type, s, example string) (reflect.Value, error) {
	v := reflect.New(t).Elem()
	switch {
	case t == durationType:
		d, err := parseDuration(s, example)
		if err != nil {
			return v, err
		}
		v.SetInt(int64(d))
	case t == stringListType:
		var items []string
		for item := range strings.SplitSeq(s, ",") {
			if item = strings.TrimSpace(item); item != "" {
				items = append(items, item)
			}
		}
		v.Set(reflect.ValueOf(items))
	case t.Kind() == reflect.Int:
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			return v, fmt.Errorf("%q is not a whole number", s)
		}
		v.SetInt(int64(n))
	case t.Kind() == reflect.Bool:
		b, err := strconv.ParseBool(strings.TrimSpace(s))
		if err != nil {
			return v, fmt.Errorf("%q is not true or false", s)
		}
		v.SetBool(b)
	default: // string kinds
		v.SetString(s)
	}
	return v, nil
}

// formatValue formats a leaf value the way parseValue reads it.
func formatValue(v reflect.Value) string {
	switch {
	case v.Type() == durationType:
		if v.Int() == 0 {
			return ""
		}
		return time.Duration(v.Int()).String()
	case v.Type() == stringListType:
		return strings.Join(v.Interface().([]string), ",")
	case v.Kind() == reflect.Int:
		return strconv.FormatInt(v.Int(), 10)
	case v.Kind() == reflect.Bool:
		return strconv.FormatBool(v.Bool())
	case v.Type() == secretType:
		return v.Interface().(Secret).String() // flag help and errors never show it
	case v.Type() == proxyURLType:
		return v.Interface().(ProxyURL).String() // nor a proxy's password
	default:
		return v.String()
	}
}

// parseDuration parses a Go duration string. Its errors quote s and show
// example, a valid duration for the same setting, because the usual mistakes
// ("5", "5 seconds") are easy to fix once a good value is in sight.
func parseDuration(s, example string) (time.Duration, error) {
	if example == "" {
		example = "1s"
	}
	d, err := time.ParseDuration(strings.TrimSpace(s))
	if err == nil {
		return d, nil
	}
	if _, nerr := strconv.ParseFloat(strings.TrimSpace(s), 64); nerr == nil {
		return 0, fmt.Errorf("%q has no unit; write a Go duration such as %q", s, example)
	}
	return 0, fmt.Errorf("%q is not a duration; write a Go duration such as %q", s, example)
}

package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"reflect"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Load reads the configuration file at path; see Parse. Errors name path.
func Load(path string) (Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Config{}, fmt.Errorf("config: %w", err)
	}
	return Parse(data, path)
}

// Parse decodes a configuration file over Default(): fields absent from the
// file (or null) keep their defaults, and clusters get the default version
// and client_id. name is the file name quoted in errors.
//
// Decoding is strict: an unknown or duplicated field, a value of the wrong
// shape, a bad duration or a second YAML document is an error naming the
// line and the field's path. Every such problem is reported, joined.
// Anchors, aliases and merge keys ("<<: *base") are supported.
//
// Parse does not validate: apply overrides, then call Validate.
func Parse(data []byte, name string) (Config, error) {
	c := Default()
	d := decoder{name: name}
	root, err := d.document(data)
	if err != nil {
		return Config{}, err
	}
	if root == nil { // empty file: all defaults
		return c, nil
	}
	d.value(root, reflect.ValueOf(&c).Elem(), "")
	if len(d.errs) > 0 {
		return Config{}, errors.Join(d.errs...)
	}
	if c.Clusters == nil { // "clusters:" with no value
		c.Clusters = map[string]Cluster{}
	}
	c.fillClusterDefaults()
	c.Routing.normalize()
	return c, nil
}

// ParseRouting decodes a routing section on its own (a rules file, or the
// value of etcd's routes key) over the zero Routing, as strictly as Parse:
// unknown fields and wrong shapes are errors naming the line and the path.
// Empty fields stay empty (the router's defaults apply). Channel names are
// filled from the keys of channels. name is quoted in errors.
func ParseRouting(data []byte, name string) (Routing, error) {
	var r Routing
	if err := decodeStrict(data, name, &r); err != nil {
		return Routing{}, err
	}
	r.normalize()
	return r, nil
}

// ParseChannel decodes one channel definition (the value of etcd's
// channels/<name> key) as strictly as Parse. Name is left empty.
func ParseChannel(data []byte, name string) (RoutingChannel, error) {
	var ch RoutingChannel
	if err := decodeStrict(data, name, &ch); err != nil {
		return RoutingChannel{}, err
	}
	return ch, nil
}

// decodeStrict decodes one YAML document into v, a pointer to a struct of
// the configuration's types, with Parse's decoder.
func decodeStrict(data []byte, name string, v any) error {
	d := decoder{name: name}
	root, err := d.document(data)
	if err != nil || root == nil {
		return err
	}
	d.value(root, reflect.ValueOf(v).Elem(), "")
	return errors.Join(d.errs...)
}

// document reads the one YAML document of data and returns its root node,
// or nil when data holds none. A trailing "---" is harmless; a second
// document is an error.
func (d *decoder) document(data []byte) (*yaml.Node, error) {
	var doc yaml.Node
	dec := yaml.NewDecoder(bytes.NewReader(data))
	switch err := dec.Decode(&doc); {
	case errors.Is(err, io.EOF):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("config: %s: %w", d.file(), err)
	}
	for {
		var extra yaml.Node
		err := dec.Decode(&extra)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("config: %s: %w", d.file(), err)
		}
		if !emptyDocument(&extra) {
			return nil, fmt.Errorf("config: %s line %d: a second YAML document; the configuration is one document", d.file(), extra.Line)
		}
	}
	root := &doc
	if root.Kind == yaml.DocumentNode && len(root.Content) == 1 {
		root = root.Content[0]
	}
	return root, nil
}

// decoder decodes a yaml.Node tree into the config structs by their yaml
// tags. It is used instead of yaml's own strict mode because that reports
// neither the path of an unknown field nor the fields that would be known,
// and its type errors do not name the field.
type decoder struct {
	name string
	errs []error
}

func (d *decoder) file() string {
	if d.name == "" {
		return "<config>"
	}
	return d.name
}

func (d *decoder) errorf(n *yaml.Node, path, format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	if path != "" {
		msg = path + ": " + msg
	}
	d.errs = append(d.errs, fmt.Errorf("config: %s line %d: %s", d.file(), n.Line, msg))
}

// value decodes n into v, whose dotted YAML path is path ("" for the root).
// A null leaves v unchanged: an explicit null means "the default".
func (d *decoder) value(n *yaml.Node, v reflect.Value, path string) {
	n = resolve(n)
	if n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null" {
		return
	}
	t := v.Type()
	switch {
	case t.Kind() == reflect.Struct:
		d.structure(n, v, path)
	case t.Kind() == reflect.Map:
		d.mapping(n, v, path)
	case t == durationType:
		if !d.want(n, yaml.ScalarNode, path) {
			return
		}
		dur, err := parseDuration(n.Value, formatValue(v))
		if err != nil {
			d.errorf(n, path, "%v", err)
			return
		}
		v.SetInt(int64(dur))
	case t == stringListType:
		if n.Kind == yaml.ScalarNode {
			d.errorf(n, path, "expected a list, got the single value %q; write [%s]", n.Value, n.Value)
			return
		}
		if !d.want(n, yaml.SequenceNode, path) {
			return
		}
		list := make([]string, 0, len(n.Content))
		for i, item := range n.Content {
			item = resolve(item)
			ipath := fmt.Sprintf("%s[%d]", path, i)
			if !d.want(item, yaml.ScalarNode, ipath) {
				continue
			}
			if item.ShortTag() == "!!null" {
				d.errorf(item, ipath, "empty list item")
				continue
			}
			list = append(list, item.Value)
		}
		v.Set(reflect.ValueOf(list))
	case t.Kind() == reflect.Slice && t.Elem().Kind() == reflect.Struct:
		d.list(n, v, path)
	case t.Kind() == reflect.Bool:
		// true or false only: yes/no/on/off are YAML 1.1 and a quoted
		// "true" is a string, as elsewhere in the file.
		if !d.want(n, yaml.ScalarNode, path) {
			return
		}
		var b bool
		if n.ShortTag() != "!!bool" || n.Decode(&b) != nil {
			d.errorf(n, path, "%q is not true or false", n.Value)
			return
		}
		v.SetBool(b)
	case t.Kind() == reflect.String:
		if d.want(n, yaml.ScalarNode, path) {
			v.SetString(n.Value)
		}
	case t.Kind() == reflect.Int:
		// A YAML integer only: a quoted number is a string, as in the
		// rest of the file, and 2.0 or true are not counts.
		if !d.want(n, yaml.ScalarNode, path) {
			return
		}
		var i int
		switch {
		case n.ShortTag() == "!!int" && n.Decode(&i) == nil:
			v.SetInt(int64(i))
		case n.ShortTag() == "!!str" && isInteger(n.Value):
			d.errorf(n, path, "expected a whole number, got the string %q; write it without quotes", n.Value)
		default:
			d.errorf(n, path, "%q is not a whole number", n.Value)
		}
	default:
		panic(fmt.Sprintf("config: no YAML decoding for %s (%s)", path, t))
	}
}

// want reports whether n is of kind k, recording an error if not.
func (d *decoder) want(n *yaml.Node, k yaml.Kind, path string) bool {
	if n.Kind == k {
		return true
	}
	d.errorf(n, path, "expected %s, got %s", kindName(k), describe(n))
	return false
}

func (d *decoder) structure(n *yaml.Node, v reflect.Value, path string) {
	if !d.want(n, yaml.MappingNode, orTop(path)) {
		return
	}
	t := v.Type()
	fields := map[string]int{}
	var known []string
	for i := range t.NumField() {
		if name := yamlName(t.Field(i)); name != "" {
			fields[name] = i
			known = append(known, name)
		}
	}
	for _, p := range d.pairs(n, path) {
		i, ok := fields[p.key.Value]
		if !ok {
			where := "in " + path
			if path == "" {
				where = "at the top level"
			}
			d.errorf(p.key, "", "unknown field %q %s (known: %s)", p.key.Value, where, strings.Join(known, ", "))
			continue
		}
		d.value(p.value, v.Field(i), join(path, p.key.Value))
	}
}

func (d *decoder) mapping(n *yaml.Node, v reflect.Value, path string) {
	if !d.want(n, yaml.MappingNode, path) {
		return
	}
	if v.IsNil() {
		v.Set(reflect.MakeMap(v.Type()))
	}
	for _, p := range d.pairs(n, path) {
		key := reflect.ValueOf(p.key.Value)
		elem := reflect.New(v.Type().Elem()).Elem()
		if old := v.MapIndex(key); old.IsValid() {
			elem.Set(old) // an entry merged in and overridden field by field
		}
		d.value(p.value, elem, join(path, p.key.Value))
		v.SetMapIndex(key, elem)
	}
}

// list decodes a list of structures (routing.rules): each item over the
// zero value, paths named by index.
func (d *decoder) list(n *yaml.Node, v reflect.Value, path string) {
	if !d.want(n, yaml.SequenceNode, path) {
		return
	}
	out := reflect.MakeSlice(v.Type(), 0, len(n.Content))
	for i, item := range n.Content {
		ipath := fmt.Sprintf("%s[%d]", path, i)
		item = resolve(item)
		if item.Kind == yaml.ScalarNode && item.ShortTag() == "!!null" {
			d.errorf(item, ipath, "empty list item")
			continue
		}
		elem := reflect.New(v.Type().Elem()).Elem()
		d.value(item, elem, ipath)
		out = reflect.Append(out, elem)
	}
	v.Set(out)
}

type pair struct{ key, value *yaml.Node }

// pairs returns the key/value pairs of mapping n, with the pairs of merged
// mappings ("<<") first so that the mapping's own keys override them, and
// records an error for a key that is not a plain scalar or is repeated.
func (d *decoder) pairs(n *yaml.Node, path string) []pair {
	var merged, own []pair
	seen := map[string]int{} // key → line
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, val := resolve(n.Content[i]), n.Content[i+1]
		if k.Kind == yaml.ScalarNode && k.Value == "<<" && k.ShortTag() == "!!merge" {
			merged = append(merged, d.merge(val, path)...)
			continue
		}
		if k.Kind != yaml.ScalarNode || k.Value == "" {
			d.errorf(k, orTop(path), "a key must be a non-empty name, got %s", describe(k))
			continue
		}
		if line, dup := seen[k.Value]; dup {
			d.errorf(k, join(path, k.Value), "set twice (first on line %d)", line)
			continue
		}
		seen[k.Value] = k.Line
		own = append(own, pair{k, val})
	}
	return append(merged, own...)
}

// merge returns the pairs of the value of a merge key: a mapping or a list
// of mappings, where earlier mappings take precedence.
func (d *decoder) merge(n *yaml.Node, path string) []pair {
	n = resolve(n)
	switch n.Kind {
	case yaml.MappingNode:
		return d.pairs(n, path)
	case yaml.SequenceNode:
		var out []pair
		for i := len(n.Content) - 1; i >= 0; i-- {
			m := resolve(n.Content[i])
			if d.want(m, yaml.MappingNode, join(path, "<<")) {
				out = append(out, d.pairs(m, path)...)
			}
		}
		return out
	default:
		d.errorf(n, join(path, "<<"), "a merge key needs a mapping or a list of mappings, got %s", describe(n))
		return nil
	}
}

// isInteger reports whether s, an int leaf's YAML value, would be a whole
// number had it not been quoted.
func isInteger(s string) bool {
	_, err := strconv.Atoi(strings.TrimSpace(s))
	return err == nil
}

func emptyDocument(doc *yaml.Node) bool {
	if len(doc.Content) == 0 {
		return true
	}
	n := doc.Content[0]
	return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null" && n.Value == ""
}

// resolve follows aliases to the node they name.
func resolve(n *yaml.Node) *yaml.Node {
	for n.Kind == yaml.AliasNode && n.Alias != nil {
		n = n.Alias
	}
	return n
}

func join(path, name string) string {
	if path == "" {
		return name
	}
	return path + "." + name
}

func orTop(path string) string {
	if path == "" {
		return "top level"
	}
	return path
}

func kindName(k yaml.Kind) string {
	switch k {
	case yaml.MappingNode:
		return "a mapping (key: value lines)"
	case yaml.SequenceNode:
		return "a list"
	case yaml.ScalarNode:
		return "a single value"
	default:
		return "a value"
	}
}

func describe(n *yaml.Node) string {
	if n.Kind == yaml.ScalarNode {
		return fmt.Sprintf("%q", n.Value)
	}
	return kindName(n.Kind)
}

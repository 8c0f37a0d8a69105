package cli

import (
	"context"
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
	"github.com/kswitch/kswitch/internal/dynconfig"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/state"
)

func newConfigCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "config",
		Short: "Show and change the fleet's dynamic configuration: source topics and cluster addresses",
		Long: `Each agent starts from its configuration file (the static layer). Two
parts of it can be changed while the fleet runs, in etcd (the dynamic layer):

  /kswitch/<fleet>/config/source           topics, topic_regex, initial_offset (YAML);
                                           the fields it names replace the file's
  /kswitch/<fleet>/config/clusters/<name>  one cluster (YAML: brokers, role, ...);
                                           replaces the file's cluster of that name,
                                           or adds one

Agents never act on these keys directly. The leader validates every change in
full (strict YAML, the merged configuration's rules, the brokers of a changed
cluster answering within 5s) and publishes what it accepts as a numbered
version at state/config, which every agent applies; a refused change is
recorded at state/config-refused with its reason, and the version in force
stays. 'kswitch config apply' validates before it writes and then waits for
the leader's verdict; 'etcdctl put' works too. Delete a key (etcdctl del) to
return to the file's value.`,
		Example: `  kswitch config show --config kswitch.yaml
  kswitch config apply -f orders-v2.yaml --config kswitch.yaml
  etcdctl put /kswitch/orders/config/source 'topics: [orders-v2]'`,
		Args: cobra.NoArgs,
	}
	cmd.AddCommand(newConfigShowCmd(g), newConfigApplyCmd(g))
	return cmd
}

// configFile is the file of 'config apply': a source section and/or a
// clusters section, each in the schema of the agent's configuration file.
type configFile struct {
	source   []byte            // nil: the file has no source section
	clusters map[string][]byte // by name
}

func readConfigFile(path string) (configFile, error) {
	if path == "" {
		return configFile{}, errors.New("name the file with -f FILE (a source section and/or a clusters section)")
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return configFile{}, err
	}
	var top map[string]yaml.Node
	if err := yaml.Unmarshal(data, &top); err != nil {
		return configFile{}, fmt.Errorf("%s: %v", path, err)
	}
	f := configFile{clusters: map[string][]byte{}}
	for _, name := range slices.Sorted(maps.Keys(top)) {
		node := top[name]
		switch name {
		case "source":
			if f.source, err = yaml.Marshal(&node); err != nil {
				return configFile{}, err
			}
		case "clusters":
			var cls map[string]yaml.Node
			if err := node.Decode(&cls); err != nil {
				return configFile{}, fmt.Errorf("%s line %d: clusters: %v", path, node.Line, err)
			}
			for cname, cnode := range cls {
				if f.clusters[cname], err = yaml.Marshal(&cnode); err != nil {
					return configFile{}, err
				}
			}
		default:
			return configFile{}, fmt.Errorf("%s line %d: %q cannot change at run time; the file may hold source and clusters", path, node.Line, name)
		}
	}
	if f.source == nil && len(f.clusters) == 0 {
		return configFile{}, fmt.Errorf("%s: nothing to apply; write a source section and/or a clusters section", path)
	}
	return f, nil
}

func newConfigApplyCmd(g *globals) *cobra.Command {
	var (
		ef      etcdFlags
		file    string
		noReach bool
		waitFor time.Duration
	)
	cmd := &cobra.Command{
		Use:   "apply -f FILE",
		Short: "Validate a source and/or clusters change, write it to etcd and wait for the leader's verdict",
		Long: `apply reads FILE, a YAML document with a source section (topics,
topic_regex, initial_offset) and/or a clusters section (name: {brokers, role,
...}), in the schema of the agent's configuration file. It merges it with what
etcd holds and with the --config file, validates the result as the leader will
(unless --config is missing: then only the values themselves), checks that the
brokers of each cluster in FILE answer, writes the keys in one transaction and
waits for the leader to accept (version N) or refuse (with its reason).

Keys FILE does not name are left as they are.`,
		Example: `  # move consumption to orders-v2 (orders is drained and released)
  printf 'source:\n  topics: [orders-v2]\n' > v2.yaml
  kswitch config apply -f v2.yaml --config kswitch.yaml

  # cluster B rebuilt behind new brokers
  printf 'clusters:\n  B:\n    brokers: [b1.new:9092]\n    role: standby\n' > b.yaml
  kswitch config apply -f b.yaml --config kswitch.yaml`,
		Args: cobra.NoArgs,
	}
	ef.bind(cmd)
	fs := cmd.Flags()
	fs.StringVarP(&file, "file", "f", "", "YAML file with a source and/or a clusters section")
	fs.BoolVar(&noReach, "no-reach", false, "do not check from here that the clusters' brokers answer (the leader still checks)")
	fs.DurationVar(&waitFor, "wait", 15*time.Second, "how long to wait for the leader's verdict; 0 does not wait")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		cf, err := readConfigFile(file)
		if err != nil {
			return err
		}
		c, err := ef.open(cmd, g.environ)
		if err != nil {
			return err
		}
		defer c.close()
		w := cmd.OutOrStdout()
		check := fleet.ConfigCheck{Reach: !noReach}
		if ef.file != "" {
			check.File = &c.cfg
		} else {
			fmt.Fprintln(w, "note: no --config: checked the values, not the whole configuration they make (the leader checks it)")
		}
		rev, err := c.op.ApplyConfig(c.ctx, fleet.ConfigChange{Source: cf.source, Clusters: cf.clusters}, check)
		if errors.Is(err, fleet.ErrUnreachable) {
			return fmt.Errorf("%s: %w (--no-reach skips this check)", file, err)
		}
		if err != nil {
			return fmt.Errorf("%s: %w", file, err)
		}
		fmt.Fprintf(w, "written at revision %d\n", rev)
		if waitFor <= 0 {
			return nil
		}
		wctx, cancel := context.WithTimeout(cmd.Context(), waitFor)
		defer cancel()
		number, changed, err := c.op.AwaitConfig(wctx, rev)
		if errors.Is(err, fleet.ErrNoConfigVerdict) {
			return fmt.Errorf("no verdict from a leader within %s: is the fleet running? 'kswitch status' shows the leader, 'kswitch config show' the version in force", waitFor)
		}
		if err != nil {
			return err
		}
		fmt.Fprintf(w, "accepted: version %d (changed: %s); agents apply it now\n", number, strings.Join(changed, ", "))
		return nil
	}
	return cmd
}

func newConfigShowCmd(g *globals) *cobra.Command {
	var (
		ef     etcdFlags
		output string
	)
	cmd := &cobra.Command{
		Use:   "show",
		Short: "Print the dynamic layer in etcd, the version in force, the last refusal and (with --config) the result",
		Args:  cobra.NoArgs,
		Example: `  kswitch config show --config kswitch.yaml
  kswitch config show --fleet orders --etcd 10.0.0.1:2379 -o json`,
	}
	ef.bind(cmd)
	cmd.Flags().StringVarP(&output, "output", "o", "text", "text or json")
	cmd.RunE = ef.runWith(g.environ, &output, []string{"text", "json"}, func(cmd *cobra.Command, c *conn) error {
		layer, err := dynconfig.Read(c.ctx, c.client, c.keys)
		if err != nil {
			return err
		}
		cur, stateErr := state.ReadConfigState(c.ctx, c.client, c.keys)
		if stateErr != nil && !errors.Is(stateErr, state.ErrMalformed) {
			return stateErr
		}
		var inForce *config.Config
		if ef.file != "" {
			if cfg, err := cur.Version.Overrides.Apply(c.cfg); err == nil {
				inForce = &cfg
			}
		}
		if output == "json" {
			return json.NewEncoder(cmd.OutOrStdout()).Encode(configView(c.keys, layer, cur, inForce))
		}
		printConfig(cmd.OutOrStdout(), c.keys, layer, cur, stateErr, inForce)
		return nil
	})
	return cmd
}

type configJSON struct {
	Layer   map[string]string    `json:"layer"`
	Version state.ConfigVersion  `json:"version"`
	Refusal *state.ConfigRefusal `json:"refusal,omitempty"`
	Source  *config.Source       `json:"source,omitempty"`
	// Clusters are the clusters in force (with --config): brokers and role.
	Clusters map[string]config.Cluster `json:"clusters,omitempty"`
}

func configView(k keys.Fleet, l dynconfig.Layer, s state.ConfigState, inForce *config.Config) configJSON {
	v := configJSON{Layer: map[string]string{}, Version: s.Version, Refusal: s.Refusal}
	if l.Source != nil {
		v.Layer[k.ConfigSource()] = string(l.Source)
	}
	for n, b := range l.Clusters {
		v.Layer[k.ConfigCluster(n)] = string(b)
	}
	if inForce != nil {
		v.Source, v.Clusters = &inForce.Source, inForce.Clusters
	}
	return v
}

func printConfig(w io.Writer, k keys.Fleet, l dynconfig.Layer, s state.ConfigState, stateErr error, inForce *config.Config) {
	switch v := s.Version; {
	case stateErr != nil:
		fmt.Fprintf(w, "version in force: unreadable: %v\n", stateErr)
	case v.Number == 0:
		fmt.Fprintln(w, "version in force: none (the agents' files alone)")
	default:
		fmt.Fprintf(w, "version in force: %d, accepted %s by %s (revision %d; changed: %s)\n",
			v.Number, v.At.Format(time.RFC3339), v.Leader, v.Revision, strings.Join(v.Changed, ", "))
	}
	if r := s.Refusal; r != nil {
		fmt.Fprintf(w, "REFUSED: the layer at revision %d, %s; version %d stays in force:\n", r.Revision, r.At.Format(time.RFC3339), r.InForce)
		for line := range strings.SplitSeq(r.Reason, "\n") {
			fmt.Fprintf(w, "  %s\n", line)
		}
	}
	fmt.Fprintf(w, "\netcd layer (%s):\n", k.Config())
	if l.Source == nil && len(l.Clusters) == 0 && len(l.Unknown) == 0 {
		fmt.Fprintln(w, "  (empty)")
	}
	show := func(key string, val []byte) {
		fmt.Fprintf(w, "  %s:\n", key)
		for line := range strings.SplitSeq(strings.TrimRight(string(val), "\n"), "\n") {
			fmt.Fprintf(w, "    %s\n", line)
		}
	}
	if l.Source != nil {
		show(k.ConfigSource(), l.Source)
	}
	for _, n := range slices.Sorted(maps.Keys(l.Clusters)) {
		show(k.ConfigCluster(n), l.Clusters[n])
	}
	for _, u := range l.Unknown {
		fmt.Fprintf(w, "  %s: unknown key (refused by the leader)\n", u)
	}
	if inForce == nil {
		return
	}
	src := inForce.Source
	fmt.Fprintf(w, "\nin force over the --config file:\n  source: topics [%s] topic_regex %q initial_offset %s\n",
		strings.Join(src.Topics, ", "), src.TopicRegex, src.InitialOffset)
	for _, n := range slices.Sorted(maps.Keys(inForce.Clusters)) {
		cl := inForce.Clusters[n]
		fmt.Fprintf(w, "  cluster %s: %s, brokers %s\n", n, cl.Role, strings.Join(cl.Brokers, ","))
	}
}

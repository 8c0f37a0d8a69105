// Package kubernetes checks the Kubernetes manifests of deploy/kubernetes
// against the Kubernetes API types and against kswitch itself: a module of
// its own, so that kswitch does not depend on the Kubernetes API.
package kubernetes

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"

	"github.com/kswitch/kswitch/config"
)

// manifests decodes every YAML document of the directory strictly (an
// unknown or misspelled field is an error) into the API type of its kind.
type manifests struct {
	config      *corev1.ConfigMap
	secret      *corev1.Secret
	statefulSet *appsv1.StatefulSet
	service     *corev1.Service
	pdb         *policyv1.PodDisruptionBudget
}

func load(t *testing.T) manifests {
	t.Helper()
	files, err := filepath.Glob("*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests: %v", err)
	}
	var m manifests
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range bytes.Split(b, []byte("\n---\n")) {
			var meta struct{ Kind string }
			if err := yaml.Unmarshal(doc, &meta); err != nil {
				t.Fatalf("%s document %d: %v", f, i, err)
			}
			var into any
			switch meta.Kind {
			case "ConfigMap":
				m.config = &corev1.ConfigMap{}
				into = m.config
			case "Secret":
				m.secret = &corev1.Secret{}
				into = m.secret
			case "StatefulSet":
				m.statefulSet = &appsv1.StatefulSet{}
				into = m.statefulSet
			case "Service":
				m.service = &corev1.Service{}
				into = m.service
			case "PodDisruptionBudget":
				m.pdb = &policyv1.PodDisruptionBudget{}
				into = m.pdb
			default:
				t.Fatalf("%s document %d: kind %q is not one this test knows", f, i, meta.Kind)
			}
			if err := yaml.UnmarshalStrict(doc, into); err != nil {
				t.Fatalf("%s document %d (%s): %v", f, i, meta.Kind, err)
			}
		}
	}
	if m.config == nil || m.secret == nil || m.statefulSet == nil || m.service == nil || m.pdb == nil {
		t.Fatalf("missing manifests: %+v", m)
	}
	return m
}

// env resolves the container's environment as the kubelet would, with
// sample values for the fields it reads from the pod.
func env(t *testing.T, c corev1.Container) []string {
	t.Helper()
	vals := map[string]string{}
	var out []string
	for _, e := range c.Env {
		v := e.Value
		if e.ValueFrom != nil && e.ValueFrom.FieldRef != nil {
			v = map[string]string{"metadata.name": "kswitch-0", "status.podIP": "10.1.2.3"}[e.ValueFrom.FieldRef.FieldPath]
		}
		v = regexp.MustCompile(`\$\(([A-Z_]+)\)`).ReplaceAllStringFunc(v, func(s string) string { return vals[s[2:len(s)-1]] })
		vals[e.Name] = v
		out = append(out, e.Name+"="+v)
	}
	return out
}

func port(t *testing.T, addr string) int32 {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("address %q: %v", addr, err)
	}
	var n int32
	fmt.Sscan(p, &n)
	return n
}

// TestManifests: the manifests are valid Kubernetes objects, and what the
// agent is told matches what it does: the configuration in the ConfigMap
// is a valid kswitch configuration once the container's environment is
// applied (its id and gossip address per pod); the container runs
// `kswitch agent --config` on the file the ConfigMap is mounted as; the
// probes ask /readyz and /healthz on the port agent.http listens on; the
// container ports are agent.http's and agent.gossip's; every file the
// configuration names under the secrets mount is a key of the Secret; the
// scrape annotations point at /metrics on the HTTP port; the disruption
// budget and anti-affinity select the pods; resources are set.
func TestManifests(t *testing.T) {
	m := load(t)
	ss := m.statefulSet
	pod := ss.Spec.Template
	if len(pod.Spec.Containers) != 1 {
		t.Fatalf("%d containers", len(pod.Spec.Containers))
	}
	c := pod.Spec.Containers[0]
	if ss.Spec.Replicas == nil || *ss.Spec.Replicas < 3 {
		t.Errorf("replicas %v: a fleet survives an agent's loss with 3", ss.Spec.Replicas)
	}

	// The command line and the mounted configuration.
	args := strings.Join(c.Args, " ")
	mm := regexp.MustCompile(`^agent --config (\S+)$`).FindStringSubmatch(args)
	if mm == nil {
		t.Fatalf("container args %q, want agent --config <file>", args)
	}
	var configKey string
	for _, vm := range c.VolumeMounts {
		if vm.MountPath == mm[1] {
			for _, v := range pod.Spec.Volumes {
				if v.Name == vm.Name && v.ConfigMap != nil && v.ConfigMap.Name == m.config.Name {
					configKey = vm.SubPath
				}
			}
		}
	}
	data, ok := m.config.Data[configKey]
	if configKey == "" || !ok {
		t.Fatalf("--config %s is not the ConfigMap %s mounted (key %q)", mm[1], m.config.Name, configKey)
	}
	cfg, err := config.Parse([]byte(data), "the ConfigMap's "+configKey)
	if err != nil {
		t.Fatal(err)
	}
	var ov *config.Overrides
	if err := ov.Apply(&cfg, env(t, c)); err != nil {
		t.Fatalf("the container's environment: %v", err)
	}
	// The Secret's files, where the configuration reads them: in a
	// directory of the test's in place of the mount.
	var secretDir string
	for _, vm := range c.VolumeMounts {
		for _, v := range pod.Spec.Volumes {
			if v.Name == vm.Name && v.Secret != nil && v.Secret.SecretName == m.secret.Name {
				secretDir = vm.MountPath
			}
		}
	}
	tmp := t.TempDir()
	for k, v := range m.secret.StringData {
		if err := os.WriteFile(filepath.Join(tmp, k), []byte(v), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// Every file the configuration reads from the secrets mount is a key
	// of the Secret; the check reads them from the test's copy.
	inTmp := func(f string) string {
		if f == "" {
			return ""
		}
		key, ok := strings.CutPrefix(f, secretDir+"/")
		if _, inSecret := m.secret.StringData[key]; secretDir == "" || !ok || !inSecret {
			t.Errorf("%s is not a key of the Secret %s mounted at %q", f, m.secret.Name, secretDir)
		}
		return filepath.Join(tmp, key)
	}
	checked := cfg
	checked.Etcd.PasswordFile = inTmp(cfg.Etcd.PasswordFile)
	checked.Agent.GossipKeyFile = inTmp(cfg.Agent.GossipKeyFile)
	checked.Clusters = map[string]config.Cluster{}
	for name, cl := range cfg.Clusters {
		cl.SASL.PasswordFile = inTmp(cl.SASL.PasswordFile)
		checked.Clusters[name] = cl
	}
	if err := checked.Validate(); err != nil {
		t.Fatalf("the configuration with the container's environment and the Secret's files: %v", err)
	}
	if cfg.Agent.ID != "kswitch-0" || cfg.Agent.GossipAdvertise != "10.1.2.3:7946" {
		t.Errorf("agent id %q, gossip advertise %q: want the pod's name and IP", cfg.Agent.ID, cfg.Agent.GossipAdvertise)
	}

	// Ports and probes.
	ports := map[string]corev1.ContainerPort{}
	for _, p := range c.Ports {
		ports[p.Name] = p
	}
	if ports["http"].ContainerPort != port(t, cfg.Agent.HTTP) {
		t.Errorf("container port http %d, agent.http %s", ports["http"].ContainerPort, cfg.Agent.HTTP)
	}
	if ports["gossip"].ContainerPort != port(t, cfg.Agent.Gossip) || ports["gossip-udp"].Protocol != corev1.ProtocolUDP ||
		ports["gossip-udp"].ContainerPort != port(t, cfg.Agent.Gossip) || port(t, cfg.Agent.GossipAdvertise) != port(t, cfg.Agent.Gossip) {
		t.Errorf("gossip ports %+v, agent.gossip %s (memberlist uses TCP and UDP), advertised %s", c.Ports, cfg.Agent.Gossip, cfg.Agent.GossipAdvertise)
	}
	for name, probe := range map[string]*corev1.Probe{"/readyz": c.ReadinessProbe, "/healthz": c.LivenessProbe} {
		if probe == nil || probe.HTTPGet == nil || probe.HTTPGet.Path != name || probe.HTTPGet.Port != intstr.FromString("http") {
			t.Errorf("probe %s: %+v", name, probe)
		}
	}
	ann := pod.Annotations
	if ann["prometheus.io/scrape"] != "true" || ann["prometheus.io/path"] != "/metrics" || ann["prometheus.io/port"] != fmt.Sprint(port(t, cfg.Agent.HTTP)) {
		t.Errorf("scrape annotations %v", ann)
	}

	// Secrets: every file under the secrets mount is a key of the Secret.
	files := []string{cfg.Etcd.PasswordFile, cfg.Agent.GossipKeyFile}
	for _, cl := range cfg.Clusters {
		files = append(files, cl.SASL.PasswordFile)
	}
	for _, f := range files {
		if f == "" {
			continue
		}
		key, ok := strings.CutPrefix(f, secretDir+"/")
		if _, inSecret := m.secret.StringData[key]; secretDir == "" || !ok || !inSecret {
			t.Errorf("%s is not a key of the Secret %s mounted at %q", f, m.secret.Name, secretDir)
		}
	}
	for _, e := range c.Env {
		if strings.Contains(strings.ToUpper(e.Name), "PASSWORD") {
			t.Errorf("env %s: passwords are files, not environment", e.Name)
		}
	}

	// Placement and disruption.
	labels := pod.Labels
	for what, sel := range map[string]map[string]string{"selector": ss.Spec.Selector.MatchLabels, "PodDisruptionBudget": m.pdb.Spec.Selector.MatchLabels,
		"Service": m.service.Spec.Selector} {
		for k, v := range sel {
			if labels[k] != v {
				t.Errorf("the %s selects %s=%s; the pods have %v", what, k, v, labels)
			}
		}
	}
	aa := pod.Spec.Affinity
	if aa == nil || aa.PodAntiAffinity == nil || len(aa.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution) == 0 ||
		aa.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution[0].TopologyKey != "kubernetes.io/hostname" {
		t.Errorf("no anti-affinity by host: two agents on one node fail together")
	}
	if m.pdb.Spec.MaxUnavailable == nil || m.pdb.Spec.MaxUnavailable.IntValue() != 1 {
		t.Errorf("PodDisruptionBudget maxUnavailable %v, want 1", m.pdb.Spec.MaxUnavailable)
	}
	if c.Resources.Requests.Cpu().IsZero() || c.Resources.Limits.Memory().IsZero() {
		t.Errorf("resources %+v: requests and a memory limit", c.Resources)
	}
	if mem := c.Resources.Limits.Memory().Value() >> 20; cfg.Agent.MemoryLimitMiB == 0 || int64(cfg.Agent.MemoryLimitMiB) >= mem {
		t.Errorf("agent.memory_limit_mib %d against the container's limit of %d MiB: the Go limit must sit below it", cfg.Agent.MemoryLimitMiB, mem)
	}
	if ss.Spec.Template.Spec.TerminationGracePeriodSeconds == nil || *ss.Spec.Template.Spec.TerminationGracePeriodSeconds < 15 {
		t.Errorf("terminationGracePeriodSeconds %v: the agent drains and hands over on SIGTERM", ss.Spec.Template.Spec.TerminationGracePeriodSeconds)
	}
}

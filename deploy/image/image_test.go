package main

import (
	"archive/tar"
	"bytes"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"sigs.k8s.io/yaml"
)

var (
	agentOnce sync.Once
	agentBin  string
	agentErr  error
)

// staticAgent builds cmd/kswitch once, as the Makefile's image target does.
func staticAgent(t *testing.T) string {
	t.Helper()
	agentOnce.Do(func() {
		dir, err := os.MkdirTemp("", "kswitch-image-")
		if err != nil {
			agentErr = err
			return
		}
		agentBin = filepath.Join(dir, "kswitch")
		cmd := exec.Command("go", "build", "-trimpath", "-o", agentBin, "./cmd/kswitch")
		cmd.Dir = filepath.Join("..", "..")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux")
		if out, err := cmd.CombinedOutput(); err != nil {
			agentErr = fmt.Errorf("go build ./cmd/kswitch: %v\n%s", err, out)
		}
	})
	if agentErr != nil {
		t.Fatal(agentErr)
	}
	return agentBin
}

func TestMain(m *testing.M) {
	code := m.Run()
	if agentBin != "" {
		os.RemoveAll(filepath.Dir(agentBin))
	}
	os.Exit(code)
}

// statefulSet is the part of deploy/kubernetes/statefulset.yaml the image
// must agree with (that module decodes it strictly into the API types).
type statefulSet struct {
	Spec struct {
		Template struct {
			Spec struct {
				SecurityContext struct {
					RunAsUser  int64 `json:"runAsUser"`
					RunAsGroup int64 `json:"runAsGroup"`
				} `json:"securityContext"`
				Containers []struct {
					Args  []string `json:"args"`
					Ports []struct {
						ContainerPort int    `json:"containerPort"`
						Protocol      string `json:"protocol"`
					} `json:"ports"`
					SecurityContext struct {
						ReadOnlyRootFilesystem bool `json:"readOnlyRootFilesystem"`
					} `json:"securityContext"`
					VolumeMounts []struct {
						MountPath string `json:"mountPath"`
					} `json:"volumeMounts"`
				} `json:"containers"`
			} `json:"spec"`
		} `json:"template"`
	} `json:"spec"`
}

func readStatefulSet(t *testing.T) statefulSet {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "kubernetes", "statefulset.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var s statefulSet
	if err := yaml.Unmarshal(b, &s); err != nil {
		t.Fatalf("statefulset.yaml: %v", err)
	}
	if len(s.Spec.Template.Spec.Containers) != 1 {
		t.Fatalf("statefulset.yaml: %d containers, want the agent alone", len(s.Spec.Template.Spec.Containers))
	}
	return s
}

// writeAndLoad writes img as make image does and reads it back as docker
// load would find it, by its tag.
func writeAndLoad(t *testing.T, img v1.Image) v1.Image {
	t.Helper()
	tag, err := name.NewTag("kswitch:test")
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "kswitch-image.tar")
	if err := tarball.WriteToFile(p, tag, img); err != nil {
		t.Fatal(err)
	}
	loaded, err := tarball.ImageFromPath(p, &tag)
	if err != nil {
		t.Fatalf("read back %s: %v", p, err)
	}
	return loaded
}

// unpack extracts the image's layers into a directory: its root filesystem.
func unpack(t *testing.T, img v1.Image) string {
	t.Helper()
	root := t.TempDir()
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range layers {
		rc, err := l.Uncompressed()
		if err != nil {
			t.Fatal(err)
		}
		tr := tar.NewReader(rc)
		for {
			h, err := tr.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			p := filepath.Join(root, filepath.FromSlash(h.Name))
			if !strings.HasPrefix(p, root+string(filepath.Separator)) {
				t.Fatalf("layer entry %q leaves the root", h.Name)
			}
			switch h.Typeflag {
			case tar.TypeDir:
				if err := os.MkdirAll(p, 0o755); err != nil {
					t.Fatal(err)
				}
				// MkdirAll obeys the umask; the image's modes are what count.
				if err := os.Chmod(p, os.FileMode(h.Mode&0o777)|modeBits(h.Mode)); err != nil {
					t.Fatal(err)
				}
				if err := os.Lchown(p, h.Uid, h.Gid); err != nil && os.Geteuid() == 0 {
					t.Fatal(err)
				}
			case tar.TypeReg:
				f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, os.FileMode(h.Mode&0o777))
				if err != nil {
					t.Fatal(err)
				}
				if _, err := io.Copy(f, tr); err != nil {
					t.Fatal(err)
				}
				if err := f.Close(); err != nil {
					t.Fatal(err)
				}
			default:
				t.Fatalf("layer entry %q has type %q; the image holds only directories and files", h.Name, h.Typeflag)
			}
		}
		rc.Close()
	}
	return root
}

func modeBits(m int64) os.FileMode {
	var fm os.FileMode
	if m&0o1000 != 0 {
		fm |= os.ModeSticky
	}
	return fm
}

// TestImageRunsTheAgentAsTheStatefulSetExpects builds the image, loads it
// back from its tarball, checks its configuration against the StatefulSet
// that runs it, and runs the binary inside its root filesystem as its user.
func TestImageRunsTheAgentAsTheStatefulSetExpects(t *testing.T) {
	bin := staticAgent(t)
	ca := ""
	if _, err := os.Stat(caPath); err == nil {
		ca = caPath
	}
	img, err := build(options{binary: bin, caCerts: ca, version: "test", created: time.Unix(0, 0).UTC()})
	if err != nil {
		t.Fatal(err)
	}
	img = writeAndLoad(t, img)
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	sts := readStatefulSet(t)
	pod := sts.Spec.Template.Spec
	c := pod.Containers[0]

	if want := fmt.Sprintf("%d:%d", pod.SecurityContext.RunAsUser, pod.SecurityContext.RunAsGroup); cf.Config.User != want {
		t.Errorf("image user %q; the StatefulSet runs it as %s", cf.Config.User, want)
	}
	if !slices.Equal(cf.Config.Entrypoint, []string{binaryPath}) {
		t.Errorf("entrypoint %v, want [%s]", cf.Config.Entrypoint, binaryPath)
	}
	if !slices.Equal(cf.Config.Cmd, c.Args) {
		t.Errorf("the image's default arguments %v differ from the StatefulSet's %v", cf.Config.Cmd, c.Args)
	}
	var ports []string
	for _, p := range c.Ports {
		ports = append(ports, fmt.Sprintf("%d/%s", p.ContainerPort, strings.ToLower(p.Protocol)))
	}
	for _, p := range ports {
		if _, ok := cf.Config.ExposedPorts[p]; !ok {
			t.Errorf("the StatefulSet declares port %s; the image does not expose it (exposes %v)", p, cf.Config.ExposedPorts)
		}
	}
	if len(cf.Config.ExposedPorts) != len(ports) {
		t.Errorf("the image exposes %v, the StatefulSet declares %v", cf.Config.ExposedPorts, ports)
	}
	if cf.OS != "linux" || cf.Architecture == "" {
		t.Errorf("platform %s/%s", cf.OS, cf.Architecture)
	}

	root := unpack(t, img)
	inImage, err := os.ReadFile(filepath.Join(root, binaryPath))
	if err != nil {
		t.Fatal(err)
	}
	built, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(inImage, built) {
		t.Errorf("%s in the image is not the binary built (%d bytes against %d)", binaryPath, len(inImage), len(built))
	}
	for _, m := range c.VolumeMounts {
		if !strings.HasPrefix(m.MountPath, configDir+"/") {
			t.Errorf("the StatefulSet mounts %s outside %s, which the image provides", m.MountPath, configDir)
		}
	}
	if st, err := os.Stat(filepath.Join(root, "tmp")); err != nil || st.Mode()&os.ModeSticky == 0 || st.Mode().Perm() != 0o777 {
		t.Errorf("/tmp: %v %v, want a sticky directory anyone may write", st.Mode(), err)
	}
	passwd, err := os.ReadFile(filepath.Join(root, "etc", "passwd"))
	if err != nil || !strings.Contains(string(passwd), fmt.Sprintf(":%d:%d:", pod.SecurityContext.RunAsUser, pod.SecurityContext.RunAsGroup)) {
		t.Errorf("/etc/passwd does not name the StatefulSet's user: %q %v", passwd, err)
	}
	if ca != "" {
		pem, err := os.ReadFile(filepath.Join(root, caPath))
		if err != nil || !x509.NewCertPool().AppendCertsFromPEM(pem) {
			t.Errorf("%s in the image holds no certificate: %v", caPath, err)
		}
	}

	// Run it as the container runtime would: in the image's root, as its
	// user, with its environment alone. That needs root here (chroot).
	if os.Geteuid() != 0 {
		t.Skip("running the binary inside the image's root filesystem needs root (chroot); the configuration and contents were checked")
	}
	run := func(args ...string) (string, error) {
		cmd := exec.Command(binaryPath, args...)
		cmd.Path = binaryPath
		cmd.Dir = "/"
		cmd.Env = cf.Config.Env
		cmd.SysProcAttr = &syscall.SysProcAttr{
			Chroot:     root,
			Credential: &syscall.Credential{Uid: uint32(pod.SecurityContext.RunAsUser), Gid: uint32(pod.SecurityContext.RunAsGroup)},
		}
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	if out, err := run("version"); err != nil || !strings.Contains(out, "kswitch") {
		t.Fatalf("kswitch version inside the image: %v\n%s", err, out)
	}
	// The default command reads the configuration the StatefulSet mounts;
	// without it the agent says which file is missing and exits non-zero.
	out, err := run(cf.Config.Cmd...)
	if err == nil || !strings.Contains(out, configDir+"/kswitch.yaml") {
		t.Fatalf("the image's default command without its configuration: %v\n%s\nwant a failure naming %s/kswitch.yaml", err, out, configDir)
	}
}

// TestImageIsReproducible: the same binary gives the same digest, and
// another time (SOURCE_DATE_EPOCH) another one.
func TestImageIsReproducible(t *testing.T) {
	bin := staticAgent(t)
	digest := func(created time.Time) v1.Hash {
		img, err := build(options{binary: bin, version: "test", created: created})
		if err != nil {
			t.Fatal(err)
		}
		d, err := img.Digest()
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	epoch := time.Unix(0, 0).UTC()
	if a, b := digest(epoch), digest(epoch); a != b {
		t.Fatalf("two builds of one binary: %s and %s", a, b)
	}
	if a, b := digest(epoch), digest(epoch.Add(time.Hour)); a == b {
		t.Fatalf("builds an hour apart share the digest %s: the time is not in the image", a)
	}
}

// TestImageRefusesABinaryItCannotRun: a dynamically linked binary (the
// image has no libc) and a file that is not a linux binary are refused
// with the fix.
func TestImageRefusesABinaryItCannotRun(t *testing.T) {
	dynamic := ""
	for _, p := range []string{"/bin/sh", "/usr/bin/env", "/bin/ls"} {
		if _, err := os.Stat(p); err == nil {
			dynamic = p
			break
		}
	}
	if dynamic != "" {
		if _, err := build(options{binary: dynamic}); err == nil || !strings.Contains(err.Error(), "CGO_ENABLED=0") {
			t.Errorf("%s (dynamically linked): %v, want a refusal naming CGO_ENABLED=0", dynamic, err)
		}
	}
	script := filepath.Join(t.TempDir(), "kswitch")
	if err := os.WriteFile(script, []byte("#!/bin/sh\necho kswitch\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := build(options{binary: script}); err == nil || !strings.Contains(err.Error(), "GOOS=linux") {
		t.Errorf("a shell script: %v, want a refusal naming GOOS=linux", err)
	}
	if _, err := sourceDate("yesterday"); err == nil || !strings.Contains(err.Error(), "SOURCE_DATE_EPOCH") {
		t.Errorf("SOURCE_DATE_EPOCH=yesterday: %v, want a refusal", err)
	}
}

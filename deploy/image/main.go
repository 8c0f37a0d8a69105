// Command image builds the agent's container image without a container
// daemon or a base image from a registry: one layer holding the static
// kswitch binary, the host's CA bundle, a passwd and group naming the
// non-root user 65532 (the StatefulSet's runAsUser), /tmp and
// /etc/kswitch. It writes a tarball that `docker load`, `podman load` and
// `crane push` accept.
//
// The build is reproducible: every file has the same time (SOURCE_DATE_EPOCH,
// or the Unix epoch), the image's creation time is that time, and the same
// binary gives the same image digest.
//
//	CGO_ENABLED=0 go build -trimpath -o bin/kswitch-linux ./cmd/kswitch
//	go run ./deploy/image -binary bin/kswitch-linux -tag kswitch:dev -o bin/kswitch-image.tar
package main

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"runtime"
	"strconv"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// The image's layout. deploy/kubernetes/statefulset.yaml runs it as
// this user and mounts the configuration under configDir.
const (
	binaryPath = "/usr/local/bin/kswitch"
	caPath     = "/etc/ssl/certs/ca-certificates.crt"
	configDir  = "/etc/kswitch"
	nonRootUID = 65532
	httpPort   = "8080/tcp"
	gossipTCP  = "7946/tcp"
	gossipUDP  = "7946/udp"
)

type options struct {
	binary  string    // a static linux kswitch binary
	caCerts string    // a PEM bundle copied to caPath; empty: none
	version string    // the image's version label
	created time.Time // every file's and the image's time
}

func main() {
	var (
		o   options
		out = flag.String("o", "bin/kswitch-image.tar", "the image tarball to write")
		tag = flag.String("tag", "kswitch:dev", "the image's name in the tarball (what docker load names it)")
	)
	flag.StringVar(&o.binary, "binary", "", "the kswitch binary to put in the image: a static linux build (CGO_ENABLED=0 go build -trimpath ./cmd/kswitch)")
	flag.StringVar(&o.caCerts, "ca-certs", caPath, "a PEM bundle of CA certificates to put at "+caPath+"; empty: none (the agent then trusts only the CA files its configuration names)")
	flag.StringVar(&o.version, "version", "dev", "the org.opencontainers.image.version label")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: image -binary PATH [-o OUT.tar] [-tag NAME:TAG] [-version V]\n\n"+
			"Builds the kswitch agent's container image without a container daemon or a base image.\n"+
			"Load it with docker load -i OUT.tar or podman load -i OUT.tar, or push it with crane push OUT.tar REPO:TAG.\n\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if o.binary == "" {
		fmt.Fprintln(os.Stderr, "image: -binary is required: the kswitch binary to put in the image")
		flag.Usage()
		os.Exit(2)
	}
	var err error
	if o.created, err = sourceDate(os.Getenv("SOURCE_DATE_EPOCH")); err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(2)
	}
	ref, err := name.NewTag(*tag)
	if err != nil {
		fmt.Fprintf(os.Stderr, "image: -tag %q: %v\n", *tag, err)
		os.Exit(2)
	}
	img, err := build(o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
	if err := tarball.WriteToFile(*out, ref, img); err != nil {
		fmt.Fprintf(os.Stderr, "image: write %s: %v\n", *out, err)
		os.Exit(1)
	}
	digest, err := img.Digest()
	if err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
	fmt.Printf("%s: %s %s\n", *out, ref, digest)
}

// sourceDate reads SOURCE_DATE_EPOCH (reproducible-builds.org); unset: the
// Unix epoch.
func sourceDate(s string) (time.Time, error) {
	if s == "" {
		return time.Unix(0, 0).UTC(), nil
	}
	secs, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return time.Time{}, fmt.Errorf("SOURCE_DATE_EPOCH=%q is not a count of seconds: %v", s, err)
	}
	return time.Unix(secs, 0).UTC(), nil
}

// build makes the image: one layer on an empty base.
func build(o options) (v1.Image, error) {
	bin, err := os.ReadFile(o.binary)
	if err != nil {
		return nil, fmt.Errorf("read the binary: %w", err)
	}
	arch, err := checkStatic(o.binary)
	if err != nil {
		return nil, err
	}
	var ca []byte
	if o.caCerts != "" {
		if ca, err = os.ReadFile(o.caCerts); err != nil {
			return nil, fmt.Errorf("read the CA bundle (-ca-certs \"\" leaves it out): %w", err)
		}
	}
	layerTar, err := rootfs(bin, ca, o.created)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	})
	if err != nil {
		return nil, fmt.Errorf("layer: %w", err)
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return nil, fmt.Errorf("layer: %w", err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS = "linux"
	cf.Architecture = arch
	cf.Created = v1.Time{Time: o.created}
	cf.Config.User = fmt.Sprintf("%d:%d", nonRootUID, nonRootUID)
	cf.Config.Entrypoint = []string{binaryPath}
	cf.Config.Cmd = []string{"agent", "--config", configDir + "/kswitch.yaml"}
	cf.Config.WorkingDir = "/"
	cf.Config.ExposedPorts = map[string]struct{}{httpPort: {}, gossipTCP: {}, gossipUDP: {}}
	cf.Config.Env = []string{"PATH=/usr/local/bin", "SSL_CERT_FILE=" + caPath}
	cf.Config.Labels = map[string]string{
		"org.opencontainers.image.title":   "kswitch",
		"org.opencontainers.image.version": o.version,
		"org.opencontainers.image.source":  "https://github.com/kswitch/kswitch",
	}
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		return nil, err
	}
	return mutate.CreatedAt(img, v1.Time{Time: o.created})
}

// checkStatic refuses a binary the image cannot run: not linux ELF, or
// linked against a libc the empty base does not have. It returns the
// image architecture of the binary.
func checkStatic(p string) (string, error) {
	f, err := elf.Open(p)
	if err != nil {
		return "", fmt.Errorf("%s is not a linux binary (%v): build it with GOOS=linux", p, err)
	}
	defer f.Close()
	for _, prog := range f.Progs {
		if prog.Type == elf.PT_INTERP {
			return "", fmt.Errorf("%s is dynamically linked and the image has no libc: build it with CGO_ENABLED=0", p)
		}
	}
	switch f.Machine {
	case elf.EM_X86_64:
		return "amd64", nil
	case elf.EM_AARCH64:
		return "arm64", nil
	}
	return "", fmt.Errorf("%s is built for %v; the image is built for amd64 or arm64 (this machine is %s)", p, f.Machine, runtime.GOARCH)
}

// rootfs is the layer: directories first, each file with the one time.
func rootfs(bin, ca []byte, mtime time.Time) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dir := func(p string, mode int64, uid int) error {
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: p + "/", Mode: mode, Uid: uid, Gid: uid, ModTime: mtime, Format: tar.FormatPAX})
	}
	file := func(p string, mode int64, body []byte) error {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: p, Mode: mode, Size: int64(len(body)), ModTime: mtime, Format: tar.FormatPAX}); err != nil {
			return err
		}
		_, err := tw.Write(body)
		return err
	}
	user := fmt.Sprintf("root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:%d:%d:nonroot:/home/nonroot:/sbin/nologin\n", nonRootUID, nonRootUID)
	group := fmt.Sprintf("root:x:0:\nnonroot:x:%d:\n", nonRootUID)
	var errs []error
	for _, d := range []string{"etc", "etc/ssl", "etc/ssl/certs", "etc/kswitch", "usr", "usr/local", "usr/local/bin", "home"} {
		errs = append(errs, dir(d, 0o755, 0))
	}
	errs = append(errs,
		dir("home/nonroot", 0o755, nonRootUID),
		dir("tmp", 0o1777, 0),
		file("etc/passwd", 0o644, []byte(user)),
		file("etc/group", 0o644, []byte(group)),
		file(path.Clean(binaryPath[1:]), 0o755, bin),
	)
	if ca != nil {
		errs = append(errs, file(caPath[1:], 0o644, ca))
	}
	errs = append(errs, tw.Close())
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("layer: %w", err)
	}
	return buf.Bytes(), nil
}

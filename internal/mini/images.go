package mini

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"syscall"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/k8sversion"
	"github.com/berth-k8s/berth/internal/mini/image"
)

// imageFormat changes whenever ImageSpecs changes in a way the bin dir names do not capture.
const imageFormat = "1"

// nftPath is Debian's nft, which kube-proxy's nftables mode execs.
const nftPath = "/usr/sbin/nft"

// ImageSpecs lists every image a mini cluster at release r needs: all images r's kubeadm names,
// flannel and the e2e test workload. kube-proxy's image carries nft and its shared libraries from the
// host.
func ImageSpecs(b Bins, r k8sversion.Release) ([]image.Spec, error) {
	bin := func(dir, name string) image.File {
		return image.File{Src: filepath.Join(dir, name), Dst: "/usr/local/bin/" + name}
	}
	nft, err := image.DynamicClosure(nftPath, image.DefaultLibDirs)
	if err != nil {
		return nil, fmt.Errorf("collecting nft for the kube-proxy image: %w", err)
	}
	im := r.Images()
	return []image.Spec{
		{Tag: im.KubeAPIServer, Files: []image.File{bin(b.K8s, "kube-apiserver")}},
		{Tag: im.KubeControllerManager, Files: []image.File{bin(b.K8s, "kube-controller-manager")}},
		{Tag: im.KubeScheduler, Files: []image.File{bin(b.K8s, "kube-scheduler")}},
		{Tag: im.KubeProxy, Files: append([]image.File{bin(b.K8s, "kube-proxy")}, nft...)},
		{Tag: im.Etcd, Files: []image.File{bin(b.Etcd, "etcd")}},
		{Tag: im.CoreDNS, Files: []image.File{{Src: filepath.Join(b.CoreDNS, "coredns"), Dst: "/coredns"}}, Entrypoint: []string{"/coredns"}},
		{Tag: im.Pause, Files: []image.File{{Src: filepath.Join(b.PodBin, "pause"), Dst: "/pause"}}, Entrypoint: []string{"/pause"}},
		{Tag: ImageFlannel, Files: []image.File{{Src: filepath.Join(b.Flannel, "flanneld"), Dst: "/opt/bin/flanneld"}}, Entrypoint: []string{"/opt/bin/flanneld"}},
		{Tag: ImageTestApp, Files: []image.File{{Src: filepath.Join(b.PodBin, "testapp"), Dst: "/testapp"}}, Entrypoint: []string{"/testapp"}},
	}, nil
}

// EnsureImageArchive returns the path of the docker-archive holding every image of ImageSpecs(b, r),
// building it under cacheDir when no archive for these inputs exists yet. The name carries a hash
// of the inputs (the versioned bin dirs and the host files copied in), so a warm call only hashes
// small files and returns; an exclusive flock keeps concurrent callers from building twice.
func EnsureImageArchive(cacheDir string, b Bins, r k8sversion.Release) (string, error) {
	specs, err := ImageSpecs(b, r)
	if err != nil {
		return "", err
	}
	key, err := specsKey(specs)
	if err != nil {
		return "", err
	}
	dir := filepath.Join(cacheDir, "images")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("creating image cache: %w", err)
	}
	path := filepath.Join(dir, "mini-"+key+".tar")
	if _, err := os.Stat(path); err == nil {
		return path, nil
	}
	lock, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return "", fmt.Errorf("opening image cache lock: %w", err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return "", fmt.Errorf("locking image cache: %w", err)
	}
	if _, err := os.Stat(path); err == nil {
		return path, nil
	}
	if err := image.WriteArchive(path, specs); err != nil {
		return "", err
	}
	return path, nil
}

// specsKey hashes the specs: tags, entrypoints, destinations and, for each source, its path and
// (for files outside a versioned bin dir) its contents.
func specsKey(specs []image.Spec) (string, error) {
	h := sha256.New() // writes to a hash never fail
	_, _ = fmt.Fprintf(h, "format %s\n", imageFormat)
	for _, s := range specs {
		_, _ = fmt.Fprintf(h, "image %s %q %q\n", s.Tag, s.Entrypoint, s.Env)
		files := append([]image.File(nil), s.Files...)
		sort.Slice(files, func(i, j int) bool { return files[i].Dst < files[j].Dst })
		for _, f := range files {
			_, _ = fmt.Fprintf(h, "file %s %s %o\n", f.Src, f.Dst, f.Mode)
			st, err := os.Stat(f.Src)
			if err != nil {
				return "", fmt.Errorf("reading %s: %w", f.Src, err)
			}
			_, _ = fmt.Fprintf(h, "size %d mtime %d\n", st.Size(), st.ModTime().UnixNano())
			if st.Size() < 16<<20 {
				if err := hashFile(h, f.Src); err != nil {
					return "", err
				}
			}
		}
	}
	return hex.EncodeToString(h.Sum(nil))[:12], nil
}

func hashFile(w io.Writer, p string) error {
	f, err := os.Open(p)
	if err != nil {
		return fmt.Errorf("opening %s: %w", p, err)
	}
	defer f.Close()
	if _, err := io.Copy(w, f); err != nil {
		return fmt.Errorf("hashing %s: %w", p, err)
	}
	return nil
}

// BerthImageSpecs lists Berth's own images: the joinservice, built from the binary at joinservice,
// with the platform settings of this cluster (metadata API, attestation variant) in its environment,
// the way a machine image carries its platform's configuration; and, when webhook names its binary,
// the image-policy webhook.
func (c Config) BerthImageSpecs(joinservice, webhook string) []image.Spec {
	attestation := c.Attestation
	if attestation == "" {
		attestation = AttestationTPM
	}
	specs := []image.Spec{{
		Tag:        ImageJoinService,
		Files:      []image.File{{Src: joinservice, Dst: "/usr/local/bin/joinservice"}},
		Entrypoint: []string{"/usr/local/bin/joinservice"},
		Env:        []string{defaultImagePath, joinconfig.EnvMetadata + "=mini", joinconfig.EnvMetadataURL + "=" + c.MetadataURL(), joinconfig.EnvAttestation + "=" + attestation},
	}}
	if webhook != "" {
		specs = append(specs, image.Spec{
			Tag:        ImageWebhook,
			Files:      []image.File{{Src: webhook, Dst: "/usr/local/bin/berth-webhook"}},
			Entrypoint: []string{"/usr/local/bin/berth-webhook"},
			Env:        []string{defaultImagePath},
		})
	}
	return specs
}

// defaultImagePath is the PATH of Berth's images.
const defaultImagePath = "PATH=/usr/local/bin:/usr/bin:/bin"

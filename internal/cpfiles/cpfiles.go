// Package cpfiles owns the files the cluster configuration puts on every control plane besides
// kubeadm's own: the API server's admission configuration (Berth's PodSecurity, then the operator's
// plugin configurations), the operator's audit policy and the kubeadm patches. kubeadm uploads the
// API server's flags that name these files (kubeadm-config), so every control plane that joins
// later must have them at the same paths as the first one.
//
// The package is the one owner of those paths, a contract between the bootstrapper (`berth init`
// writes the files on the first control plane; a joining control plane writes them from its
// ticket) and the joinservice (which renders them from the configuration in force,
// kube-system/berth-cluster-config, into the control-plane join ticket). On the node every path is
// checked against its directory before anything is written: a path outside it is ErrUnsafePath.
package cpfiles

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"

	"github.com/spf13/afero"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	apiserverv1 "k8s.io/apiserver/pkg/apis/apiserver/v1"
	auditv1 "k8s.io/apiserver/pkg/apis/audit/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/clusterconfig"
	"github.com/berth-k8s/berth/internal/kubeadm"
	"github.com/berth-k8s/berth/joinproto"
)

// Where the files live. The first two are relative to kubeadm's directory (/etc/kubernetes), in
// Berth's subdirectory that kubeadm mounts into the API server's pod; the patches directory is
// relative to the bootstrapper's state directory.
const (
	// BerthDir is Berth's subdirectory of kubeadm's directory: the only place a file of root
	// FILE_ROOT_KUBERNETES may be written.
	BerthDir = "berth"
	// AdmissionConfigFile is the API server's admission configuration.
	AdmissionConfigFile = berthsystem.AdmissionConfigFile
	// AuditPolicyFile is the API server's audit policy, when the configuration sets one.
	AuditPolicyFile = BerthDir + "/audit-policy.yaml"
	// PatchesDir is the directory of kubeadm patches (kubeadm.PatchFiles).
	PatchesDir = "kubeadm-patches"
)

// ErrUnsafePath: a file's path leaves the directory its root names, or names no such root.
var ErrUnsafePath = errors.New("file path outside its directory")

// Dirs are a node's directories the files are written under.
type Dirs struct {
	// Kubernetes is kubeadm's directory (/etc/kubernetes).
	Kubernetes string
	// State is the bootstrapper's state directory.
	State string
}

// PKI is kubeadm's PKI directory.
func (d Dirs) PKI() string { return filepath.Join(d.Kubernetes, "pki") }

// Patches is the directory of kubeadm patches.
func (d Dirs) Patches() string { return filepath.Join(d.State, PatchesDir) }

// AuditPolicy is the audit policy's path.
func (d Dirs) AuditPolicy() string {
	return filepath.Join(d.Kubernetes, filepath.FromSlash(AuditPolicyFile))
}

// AdmissionConfig is the admission configuration's path.
func (d Dirs) AdmissionConfig() string {
	return filepath.Join(d.Kubernetes, filepath.FromSlash(AdmissionConfigFile))
}

// Render returns the files c puts on every control plane: the admission configuration (always:
// Berth's PodSecurity comes first), the audit policy when c sets one, and one file per kubeadm
// patch, each with its root and its path relative to it.
func Render(c *clusterconfig.ClusterConfiguration) ([]*joinproto.File, error) {
	extra := make([]apiserverv1.AdmissionPluginConfiguration, 0, len(c.APIServer.Admission.Plugins))
	for _, p := range c.APIServer.Admission.Plugins {
		extra = append(extra, apiserverv1.AdmissionPluginConfiguration{
			Name: p.Name, Configuration: &runtime.Unknown{Raw: p.Configuration.Raw, ContentType: runtime.ContentTypeJSON},
		})
	}
	admission, err := berthsystem.AdmissionConfiguration(extra...)
	if err != nil {
		return nil, err
	}
	files := []*joinproto.File{{Root: joinproto.FileRoot_FILE_ROOT_KUBERNETES, Path: AdmissionConfigFile, Data: admission, Mode: 0o600}}
	if a := c.APIServer.Audit; a != nil {
		pol := a.Policy
		pol.APIVersion, pol.Kind = auditv1.SchemeGroupVersion.String(), "Policy"
		data, err := clusterconfig.CompactYAML(pol)
		if err != nil {
			return nil, fmt.Errorf("encoding the audit policy: %w", err)
		}
		files = append(files, &joinproto.File{Root: joinproto.FileRoot_FILE_ROOT_KUBERNETES, Path: AuditPolicyFile, Data: data, Mode: 0o600})
	}
	patches := kubeadm.PatchFiles(c.Patches)
	names := make([]string, 0, len(patches))
	for name := range patches {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		files = append(files, &joinproto.File{Root: joinproto.FileRoot_FILE_ROOT_PATCHES, Path: name, Data: patches[name], Mode: 0o600})
	}
	return files, nil
}

// Path returns where f goes on a node with directories d, or ErrUnsafePath: a PKI file anywhere
// below the PKI directory, a file of kubeadm's directory only directly in Berth's subdirectory, a
// patch only directly in the patches directory. Paths are slash-separated, relative and clean;
// ".." is refused everywhere.
func (d Dirs) Path(f *joinproto.File) (string, error) {
	p := f.GetPath()
	if p == "" || path.IsAbs(p) || path.Clean(p) != p || strings.ContainsRune(p, '\\') ||
		slices.Contains(strings.Split(p, "/"), "..") {
		return "", fmt.Errorf("%w: %q is not a clean relative path", ErrUnsafePath, p)
	}
	switch f.GetRoot() {
	case joinproto.FileRoot_FILE_ROOT_UNSPECIFIED:
		return filepath.Join(d.PKI(), filepath.FromSlash(p)), nil
	case joinproto.FileRoot_FILE_ROOT_KUBERNETES:
		if dir, name := path.Split(p); dir != BerthDir+"/" || name == "" {
			return "", fmt.Errorf("%w: %q is not a file of %s/ in kubeadm's directory", ErrUnsafePath, p, BerthDir)
		}
		return filepath.Join(d.Kubernetes, filepath.FromSlash(p)), nil
	case joinproto.FileRoot_FILE_ROOT_PATCHES:
		if strings.Contains(p, "/") {
			return "", fmt.Errorf("%w: patch %q is not a file name", ErrUnsafePath, p)
		}
		return filepath.Join(d.Patches(), p), nil
	default:
		return "", fmt.Errorf("%w: %q has an unknown root %d", ErrUnsafePath, p, f.GetRoot())
	}
}

// Check returns the first error of Path over files.
func (d Dirs) Check(files []*joinproto.File) error {
	for _, f := range files {
		if _, err := d.Path(f); err != nil {
			return err
		}
	}
	return nil
}

// Written says which of the operator's files are among files, as kubeadm's configuration names
// them: the admission configuration's and the audit policy's paths, and the patches directory
// (each empty when files hold none).
func (d Dirs) Written(files []*joinproto.File) (admission, audit, patches string) {
	for _, f := range files {
		switch {
		case f.GetRoot() == joinproto.FileRoot_FILE_ROOT_KUBERNETES && f.GetPath() == AdmissionConfigFile:
			admission = d.AdmissionConfig()
		case f.GetRoot() == joinproto.FileRoot_FILE_ROOT_KUBERNETES && f.GetPath() == AuditPolicyFile:
			audit = d.AuditPolicy()
		case f.GetRoot() == joinproto.FileRoot_FILE_ROOT_PATCHES:
			patches = d.Patches()
		}
	}
	return admission, audit, patches
}

// Write writes files (of every root) under d on fsys. Every path is checked first: one that
// leaves its directory refuses the whole set before anything is written. The patches directory is
// emptied first, so that only files' patches apply. Modes keep at most 0644; unset is 0600.
func Write(fsys afero.Fs, d Dirs, files []*joinproto.File) error {
	if err := d.Check(files); err != nil {
		return err
	}
	if err := fsys.RemoveAll(d.Patches()); err != nil {
		return fmt.Errorf("emptying the kubeadm patches directory: %w", err)
	}
	for _, f := range files {
		dst, _ := d.Path(f)
		mode := os.FileMode(f.GetMode() & 0o644)
		if mode == 0 {
			mode = 0o600
		}
		dirMode := os.FileMode(0o755)
		if f.GetRoot() == joinproto.FileRoot_FILE_ROOT_PATCHES {
			dirMode = 0o700
		}
		if err := fsys.MkdirAll(filepath.Dir(dst), dirMode); err != nil {
			return fmt.Errorf("creating the directory of %s: %w", f.GetPath(), err)
		}
		if err := afero.WriteFile(fsys, dst, f.GetData(), mode); err != nil {
			return fmt.Errorf("writing %s: %w", f.GetPath(), err)
		}
	}
	return nil
}

// FromCluster renders the files of the configuration in force, read from the ConfigMap
// kube-system/berth-cluster-config through client. A cluster without that ConfigMap (initialized
// before Berth kept its configuration) has none: it returns no files.
func FromCluster(ctx context.Context, client kubernetes.Interface) ([]*joinproto.File, error) {
	cm, err := client.CoreV1().ConfigMaps(clusterconfig.ConfigMapNamespace).Get(ctx, clusterconfig.ConfigMapName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading %s/%s: %w", clusterconfig.ConfigMapNamespace, clusterconfig.ConfigMapName, err)
	}
	c, err := clusterconfig.FromConfigMap(cm)
	if err != nil {
		return nil, err
	}
	return Render(&c)
}

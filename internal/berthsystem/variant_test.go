package berthsystem_test

import (
	"bytes"
	"errors"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"

	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/joinconfig"
)

// A control plane's environment as the OS image's bootstrapper passes it on: the image sets BERTH_TPM
// whatever its variant (image/bootstrapper.env.in).
func controlPlaneEnv(variant string) map[string]string {
	return map[string]string{
		joinconfig.EnvAttestation: variant, joinconfig.EnvTPM: "/dev/tpmrm0", joinconfig.EnvMetadata: "qemu",
	}
}

// joinServicePod builds berth-system's objects as init does and returns the joinservice's pod spec.
func joinServicePod(t *testing.T, cfg berthsystem.Config, attestationPolicy string) (*corev1.PodSpec, error) {
	t.Helper()
	cfg.JoinServiceImage = testJoinServiceImage
	if cfg.JoinServiceHostPaths == nil {
		cfg.JoinServiceHostPaths = berthsystem.TPMHostPaths(cfg.JoinServiceEnv[joinconfig.EnvTPM])
	}
	objs, err := berthsystem.Objects(cfg, berthsystem.Cluster{
		Secrets: joinconfig.ClusterSecrets{MasterSecret: bytes.Repeat([]byte{1}, 32), Salt: bytes.Repeat([]byte{2}, 32)},
		Join:    joinconfig.Config{AttestationPolicy: []byte(attestationPolicy), KubernetesVersion: "v1.37.2"},
	})
	if err != nil {
		return nil, err
	}
	var ds appsv1.DaemonSet
	find(t, objs, "DaemonSet", joinconfig.JoinServiceName, &ds)
	return &ds.Spec.Template.Spec, nil
}

// podView is what the joinservice's pod gets from the host, by host path and environment variable.
type podView struct {
	hostPaths map[string]corev1.Volume      // by host path
	mounts    map[string]corev1.VolumeMount // by volume name
	env       map[string]string
	priv      bool
}

func viewPod(pod *corev1.PodSpec) podView {
	v := podView{hostPaths: map[string]corev1.Volume{}, mounts: map[string]corev1.VolumeMount{}, env: map[string]string{}}
	for _, vol := range pod.Volumes {
		if vol.HostPath != nil {
			v.hostPaths[vol.HostPath.Path] = vol
		}
	}
	c := pod.Containers[0]
	for _, m := range c.VolumeMounts {
		v.mounts[m.Name] = m
	}
	for _, e := range c.Env {
		v.env[e.Name] = e.Value
	}
	v.priv = c.SecurityContext != nil && c.SecurityContext.Privileged != nil && *c.SecurityContext.Privileged
	return v
}

// TestJoinServiceForVariant builds berth-system's objects for a TDX control plane and checks that the
// joinservice's pod gets the TD guest interface where the joinservice looks for it, the policy's
// collateral directory read-only, and nothing of the TPM although the image's environment names one; and
// that a TPM control plane's gets its TPM and nothing of TDX.
func TestJoinServiceForVariant(t *testing.T) {
	const collateralDir = "/var/lib/berth/tdx-collateral"
	tdxPolicy := "variant: tdx\ntdx:\n  collateralDir: " + collateralDir + "\n"
	tpmPaths := []string{"/dev/tpmrm0", "/run/swtpm"}

	for name, tc := range map[string]struct {
		iface              berthsystem.TDXGuestInterface
		hostPath, hostType string
		opened             string
		privileged         bool
	}{
		"configfs-tsm (default)": {hostPath: "/sys/kernel/config", hostType: "Directory", opened: tdx.TSMReportDir},
		"legacy device":          {iface: berthsystem.TDXLegacyDevice, hostPath: "/dev/tdx-guest", hostType: "CharDevice", opened: tdx.LegacyGuestDevice, privileged: true},
	} {
		t.Run("tdx "+name, func(t *testing.T) {
			for _, hostPaths := range [][]string{nil, tpmPaths} {
				pod, err := joinServicePod(t, berthsystem.Config{JoinServiceEnv: controlPlaneEnv("tdx"), JoinServiceHostPaths: hostPaths, TDXGuest: tc.iface}, tdxPolicy)
				if err != nil {
					t.Fatalf("Objects() for a TDX control plane = %v", err)
				}
				v := viewPod(pod)
				guest, ok := v.hostPaths[tc.hostPath]
				if !ok || string(*guest.HostPath.Type) != tc.hostType {
					t.Fatalf("volumes %+v, want host path %s (%s)", pod.Volumes, tc.hostPath, tc.hostType)
				}
				root := v.env[joinconfig.EnvTDXRoot]
				mount, ok := v.mounts[guest.Name]
				if root != berthsystem.TDXRoot || !ok || !strings.HasPrefix(root+tc.opened, mount.MountPath) {
					t.Fatalf("%s=%q, mount %+v: the joinservice does not find %s in the mount", joinconfig.EnvTDXRoot, root, mount, tc.opened)
				}
				if v.env[joinconfig.EnvAttestation] != "tdx" {
					t.Errorf("%s = %q, want tdx", joinconfig.EnvAttestation, v.env[joinconfig.EnvAttestation])
				}
				if _, ok := v.env[joinconfig.EnvTPM]; ok {
					t.Errorf("a TDX control plane's joinservice gets %s", joinconfig.EnvTPM)
				}
				for p := range v.hostPaths {
					if slices.Contains(tpmPaths, p) || strings.HasPrefix(p, "/dev/tpm") {
						t.Errorf("a TDX control plane's joinservice gets the TPM's host path %s", p)
					}
				}
				col, ok := v.hostPaths[collateralDir]
				if !ok || *col.HostPath.Type != corev1.HostPathDirectory {
					t.Fatalf("no collateral directory %s among %+v", collateralDir, pod.Volumes)
				}
				if m := v.mounts[col.Name]; m.MountPath != collateralDir || !m.ReadOnly {
					t.Errorf("collateral mount %+v, want %s read-only", m, collateralDir)
				}
				if v.priv != tc.privileged {
					t.Errorf("privileged = %t, want %t", v.priv, tc.privileged)
				}
				if len(pod.Volumes) != 4 || len(pod.Containers[0].VolumeMounts) != 4 {
					t.Errorf("volumes %+v, want the PKI, the backups, the TD guest interface and the collateral", pod.Volumes)
				}
			}
		})
	}

	t.Run("tpm", func(t *testing.T) {
		pod, err := joinServicePod(t, berthsystem.Config{JoinServiceEnv: controlPlaneEnv("tpm")}, "variant: tpm\n")
		if err != nil {
			t.Fatalf("Objects() for a TPM control plane = %v", err)
		}
		v := viewPod(pod)
		if _, ok := v.hostPaths["/dev/tpmrm0"]; !ok || v.env[joinconfig.EnvTPM] != "/dev/tpmrm0" {
			t.Errorf("volumes %+v, env %v: the TPM control plane's joinservice lacks its TPM", pod.Volumes, v.env)
		}
		if _, ok := v.env[joinconfig.EnvTDXRoot]; ok {
			t.Errorf("a TPM control plane's joinservice gets %s", joinconfig.EnvTDXRoot)
		}
		for p := range v.hostPaths {
			if p == "/sys/kernel/config" || p == "/dev/tdx-guest" || strings.Contains(p, "collateral") {
				t.Errorf("a TPM control plane's joinservice gets the TDX host path %s", p)
			}
		}
		for _, m := range pod.Containers[0].VolumeMounts {
			if strings.HasPrefix(m.MountPath, berthsystem.TDXRoot) {
				t.Errorf("a TPM control plane's joinservice gets the mount %+v", m)
			}
		}
	})
}

// TestJoinServiceVariantRefused: what init refuses, each with its named error.
func TestJoinServiceVariantRefused(t *testing.T) {
	for name, tc := range map[string]struct {
		cfg     berthsystem.Config
		policy  string
		wantErr error
	}{
		"tdx control plane, tpm policy": {cfg: berthsystem.Config{JoinServiceEnv: controlPlaneEnv("tdx")}, policy: "variant: tpm\n", wantErr: berthsystem.ErrMixedVariants},
		"tpm control plane, tdx policy": {cfg: berthsystem.Config{JoinServiceEnv: controlPlaneEnv("tpm")}, policy: "variant: tdx\n", wantErr: berthsystem.ErrMixedVariants},
		"policy without variant":        {cfg: berthsystem.Config{JoinServiceEnv: controlPlaneEnv("tdx")}, policy: "measurements: {}\n", wantErr: berthsystem.ErrMixedVariants},
		"unknown variant":               {cfg: berthsystem.Config{JoinServiceEnv: controlPlaneEnv("sev-snp")}, policy: "variant: sev-snp\n", wantErr: berthsystem.ErrUnknownVariant},
		"TD guest on a tpm node":        {cfg: berthsystem.Config{JoinServiceEnv: controlPlaneEnv("tpm"), TDXGuest: berthsystem.TDXConfigfsTSM}, policy: "variant: tpm\n", wantErr: berthsystem.ErrTDXGuestWithoutTDX},
		"unknown TD guest interface":    {cfg: berthsystem.Config{JoinServiceEnv: controlPlaneEnv("tdx"), TDXGuest: "vsock"}, policy: "variant: tdx\n", wantErr: berthsystem.ErrUnknownTDXGuestInterface},
		"relative collateral directory": {cfg: berthsystem.Config{JoinServiceEnv: controlPlaneEnv("tdx")}, policy: "variant: tdx\ntdx: {collateralDir: collateral}\n", wantErr: berthsystem.ErrCollateralDirNotAbsolute},
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := joinServicePod(t, tc.cfg, tc.policy); !errors.Is(err, tc.wantErr) {
				t.Fatalf("Objects() = %v, want %v", err, tc.wantErr)
			}
		})
	}
	// insecure-none attests nothing: whatever policy the cluster has, nothing is refused.
	if _, err := joinServicePod(t, berthsystem.Config{JoinServiceEnv: controlPlaneEnv("insecure-none")}, "variant: tdx\n"); err != nil {
		t.Errorf("Objects() for insecure-none = %v", err)
	}
}

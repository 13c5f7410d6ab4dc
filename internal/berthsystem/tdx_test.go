package berthsystem_test

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	appsv1ac "k8s.io/client-go/applyconfigurations/apps/v1"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/joinconfig"
)

// joinServiceDaemonSet is the joinservice's DaemonSet, in namespace.
func joinServiceDaemonSet(namespace string) *appsv1ac.DaemonSetApplyConfiguration {
	ds, err := berthsystem.JoinServiceDaemonSet(berthsystem.Config{
		JoinServiceImage: "berth.local/joinservice:dev",
		JoinServiceEnv:   map[string]string{"BERTH_ATTESTATION": "tdx"},
	}, nil)
	if err != nil {
		panic(err) // a fixed configuration; TestJoinServiceForVariant checks the errors
	}
	ds.WithNamespace(namespace)
	return ds
}

// tdxView is what AddTDXGuest added, as the joinservice sees it.
type tdxView struct {
	hostPath, hostType, mountPath, root string
	privileged                          bool
	volumes, mounts, env                int
}

func viewOf(t *testing.T, pod *corev1ac.PodSpecApplyConfiguration) tdxView {
	t.Helper()
	var v tdxView
	v.volumes = len(pod.Volumes)
	for _, vol := range pod.Volumes {
		if *vol.Name == "tdx-guest" {
			v.hostPath, v.hostType = *vol.HostPath.Path, string(*vol.HostPath.Type)
		}
	}
	c := pod.Containers[0]
	v.mounts, v.env = len(c.VolumeMounts), len(c.Env)
	for _, m := range c.VolumeMounts {
		if *m.Name == "tdx-guest" {
			v.mountPath = *m.MountPath
		}
	}
	for _, e := range c.Env {
		if *e.Name == joinconfig.EnvTDXRoot {
			v.root = *e.Value
		}
	}
	v.privileged = c.SecurityContext != nil && c.SecurityContext.Privileged != nil && *c.SecurityContext.Privileged
	return v
}

func TestAddTDXGuest(t *testing.T) {
	testCases := map[berthsystem.TDXGuestInterface]tdxView{
		berthsystem.TDXConfigfsTSM: {
			hostPath: "/sys/kernel/config", hostType: "Directory", mountPath: "/run/berth/tdx/sys/kernel/config",
			root: "/run/berth/tdx", volumes: 3, mounts: 3, env: 4,
		},
		berthsystem.TDXLegacyDevice: {
			hostPath: "/dev/tdx-guest", hostType: "CharDevice", mountPath: "/run/berth/tdx/dev/tdx-guest",
			root: "/run/berth/tdx", privileged: true, volumes: 3, mounts: 3, env: 4,
		},
	}
	for iface, want := range testCases {
		t.Run(string(iface), func(t *testing.T) {
			ds := joinServiceDaemonSet("berth-system")
			for range 2 { // a second call changes nothing
				if err := berthsystem.AddTDXGuest(ds, iface); err != nil {
					t.Fatalf("AddTDXGuest() = %v", err)
				}
				if got := viewOf(t, ds.Spec.Template.Spec); got != want {
					t.Fatalf("AddTDXGuest() added %+v, want %+v", got, want)
				}
			}
			// What the joinservice opens under BERTH_TDX_ROOT is inside the mount.
			opened := filepath.Join(want.root, tdx.TSMReportDir)
			if iface == berthsystem.TDXLegacyDevice {
				opened = filepath.Join(want.root, tdx.LegacyGuestDevice)
			}
			if opened != want.mountPath && !strings.HasPrefix(opened, want.mountPath+"/") {
				t.Fatalf("the joinservice opens %s, outside the mount at %s", opened, want.mountPath)
			}
		})
	}

	if err := berthsystem.AddTDXGuest(joinServiceDaemonSet("berth-system"), "tdx-guest-ioctl"); !errors.Is(err, berthsystem.ErrUnknownTDXGuestInterface) {
		t.Errorf("AddTDXGuest(unknown interface) = %v, want %v", err, berthsystem.ErrUnknownTDXGuestInterface)
	}
	other := joinServiceDaemonSet("berth-system")
	other.Spec.Template.Spec.Containers[0].WithName("sidecar")
	for name, ds := range map[string]*appsv1ac.DaemonSetApplyConfiguration{
		"no joinservice container": other,
		"no spec":                  appsv1ac.DaemonSet("berth-joinservice", "berth-system"),
		"nil":                      nil,
	} {
		if err := berthsystem.AddTDXGuest(ds, berthsystem.TDXConfigfsTSM); !errors.Is(err, berthsystem.ErrNoJoinServiceContainer) {
			t.Errorf("AddTDXGuest(%s) = %v, want %v", name, err, berthsystem.ErrNoJoinServiceContainer)
		}
	}
}

// TestAddTDXGuestOnAPIServer server-side applies the DaemonSet with each interface to a real API server,
// which validates it, and reads the volume and mount back. The legacy device's privileged container needs
// --allow-privileged=true, as kubeadm sets it.
func TestAddTDXGuestOnAPIServer(t *testing.T) {
	env := apiservertest.Start(t, apiservertest.APIServerArgs("--allow-privileged=true"))
	ctx := context.Background()
	kube := env.Client(t, apiservertest.AdminUser)
	for _, iface := range []berthsystem.TDXGuestInterface{berthsystem.TDXConfigfsTSM, berthsystem.TDXLegacyDevice} {
		ds := joinServiceDaemonSet("default")
		if err := berthsystem.AddTDXGuest(ds, iface); err != nil {
			t.Fatal(err)
		}
		got, err := kube.AppsV1().DaemonSets("default").Apply(ctx, ds, metav1.ApplyOptions{FieldManager: "berth-test", Force: true})
		if err != nil {
			t.Fatalf("applying the joinservice DaemonSet with %s: %v", iface, err)
		}
		pod := got.Spec.Template.Spec
		var vol *corev1.Volume
		for i := range pod.Volumes {
			if pod.Volumes[i].Name == "tdx-guest" {
				vol = &pod.Volumes[i]
			}
		}
		if vol == nil || vol.HostPath == nil || *vol.HostPath.Type != *ds.Spec.Template.Spec.Volumes[2].HostPath.Type {
			t.Fatalf("%s: the API server holds volumes %+v", iface, pod.Volumes)
		}
		c := pod.Containers[0]
		if len(c.VolumeMounts) != 3 || !strings.HasPrefix(c.VolumeMounts[2].MountPath, berthsystem.TDXRoot+"/") {
			t.Fatalf("%s: the API server holds mounts %+v", iface, c.VolumeMounts)
		}
		if privileged := *c.SecurityContext.Privileged; privileged != (iface == berthsystem.TDXLegacyDevice) {
			t.Fatalf("%s: privileged = %t", iface, privileged)
		}
	}
}

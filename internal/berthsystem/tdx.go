package berthsystem

import (
	"errors"
	"fmt"
	"path"
	"slices"

	corev1 "k8s.io/api/core/v1"
	appsv1ac "k8s.io/client-go/applyconfigurations/apps/v1"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"

	"github.com/berth-k8s/berth/internal/joinconfig"
)

// TDXGuestInterface names the TD guest interface the joinservice quotes through on a TDX control plane.
type TDXGuestInterface string

const (
	// TDXConfigfsTSM is configfs-tsm (mainline kernels from 6.7): the host's configfs is mounted into the
	// joinservice. This is what the joinservice `make build` makes uses.
	TDXConfigfsTSM TDXGuestInterface = "configfs-tsm"
	// TDXLegacyDevice is the pre-upstream /dev/tdx-guest device. Only a joinservice built with the tag
	// berth_qpl (go-tdx-qpl, AGPL-3.0) can quote through it, and opening a host device from a container
	// takes a privileged container.
	TDXLegacyDevice TDXGuestInterface = "legacy-device"
)

// TDXRoot is where the joinservice container sees its node's TD guest interfaces; the joinservice gets it
// as joinconfig.EnvTDXRoot (its --tdx-root). It lies outside /sys because container runtimes' default AppArmor
// profiles deny writes below /sys, and a configfs-tsm quote creates a report directory and writes the
// report data there.
const TDXRoot = "/run/berth/tdx"

const (
	// tdxContainer is the joinservice DaemonSet's container that quotes.
	tdxContainer = "joinservice"
	// hostConfigfs is where systemd mounts configfs; configfs-tsm's report directory is below it.
	hostConfigfs = "/sys/kernel/config"
	// legacyGuestDevice is the kernel's pre-upstream TD guest device. These two are the kernel's names,
	// not Berth's; TestAddTDXGuest checks that the joinservice opens its interface inside the mount.
	legacyGuestDevice = "/dev/tdx-guest"
	// tdxVolume names the volume that carries the guest interface.
	tdxVolume = "tdx-guest"
)

// Named errors of AddTDXGuest.
var (
	ErrNoJoinServiceContainer   = errors.New("the DaemonSet has no joinservice container")
	ErrUnknownTDXGuestInterface = errors.New("unknown TDX guest interface")
)

// AddTDXGuest adds to the joinservice DaemonSet ds what its container needs to attest on a TDX control
// plane: a hostPath volume with the guest interface (the host's configfs for TDXConfigfsTSM, the character
// device /dev/tdx-guest for TDXLegacyDevice), mounted below TDXRoot at the path it has on the host, and
// BERTH_TDX_ROOT=TDXRoot. configfs-tsm needs no privileges beyond running as root (the report directory is
// root's); the legacy device makes the container privileged, as device access from a container needs.
// The joinservice must run as root either way. Calling it again with the same interface changes nothing.
// JoinServiceDaemonSet calls it for a control plane whose variant is tdx.
func AddTDXGuest(ds *appsv1ac.DaemonSetApplyConfiguration, iface TDXGuestInterface) error {
	var hostPath string
	var hostPathType corev1.HostPathType
	switch iface {
	case TDXConfigfsTSM:
		hostPath, hostPathType = hostConfigfs, corev1.HostPathDirectory
	case TDXLegacyDevice:
		hostPath, hostPathType = legacyGuestDevice, corev1.HostPathCharDev
	default:
		return fmt.Errorf("adding the TDX guest interface %q: %w", iface, ErrUnknownTDXGuestInterface)
	}
	if ds == nil || ds.Spec == nil || ds.Spec.Template == nil || ds.Spec.Template.Spec == nil {
		return fmt.Errorf("adding the TDX guest interface: %w", ErrNoJoinServiceContainer)
	}
	pod := ds.Spec.Template.Spec
	var c *corev1ac.ContainerApplyConfiguration
	for i := range pod.Containers {
		if is(pod.Containers[i].Name, tdxContainer) {
			c = &pod.Containers[i]
		}
	}
	if c == nil {
		return fmt.Errorf("adding the TDX guest interface: %w", ErrNoJoinServiceContainer)
	}

	pod.Volumes = slices.DeleteFunc(pod.Volumes, func(v corev1ac.VolumeApplyConfiguration) bool { return is(v.Name, tdxVolume) })
	pod.WithVolumes(corev1ac.Volume().WithName(tdxVolume).
		WithHostPath(corev1ac.HostPathVolumeSource().WithPath(hostPath).WithType(hostPathType)))
	c.VolumeMounts = slices.DeleteFunc(c.VolumeMounts, func(m corev1ac.VolumeMountApplyConfiguration) bool { return is(m.Name, tdxVolume) })
	c.WithVolumeMounts(corev1ac.VolumeMount().WithName(tdxVolume).WithMountPath(path.Join(TDXRoot, hostPath)))
	c.Env = slices.DeleteFunc(c.Env, func(e corev1ac.EnvVarApplyConfiguration) bool { return is(e.Name, joinconfig.EnvTDXRoot) })
	c.WithEnv(corev1ac.EnvVar().WithName(joinconfig.EnvTDXRoot).WithValue(TDXRoot))
	if iface == TDXLegacyDevice {
		if c.SecurityContext == nil {
			c.WithSecurityContext(corev1ac.SecurityContext())
		}
		// A privileged container has every capability and may not forbid privilege escalation.
		c.SecurityContext.WithPrivileged(true)
		c.SecurityContext.AllowPrivilegeEscalation = nil
		c.SecurityContext.Capabilities = nil
	}
	return nil
}

// is reports whether name is set to want.
func is(name *string, want string) bool {
	return name != nil && *name == want
}

// Package metadata describes what the platform tells a node about itself and its cluster: who am I,
// who are my peers, where is the control plane, and which init secret may initialize me. Providers
// live in subpackages: static (a file) and mini (the HTTP API `berth mini up` serves to its nodes).
package metadata

import (
	"errors"
	"fmt"
	"net"
)

// Role is the role the platform assigned to an instance.
type Role string

// Roles.
const (
	RoleControlPlane Role = "control-plane"
	RoleWorker       Role = "worker"
)

// Valid reports whether r is a known role.
func (r Role) Valid() bool { return r == RoleControlPlane || r == RoleWorker }

// Instance is one machine as the platform sees it.
type Instance struct {
	// Name is the instance name; it becomes the Kubernetes node name.
	Name string `json:"name"`
	// Role is the instance's role.
	Role Role `json:"role"`
	// IPs are the instance's addresses inside the cluster network; the first is its primary address.
	IPs []string `json:"ips"`
}

// Validate reports the first problem with i.
func (i Instance) Validate() error {
	if i.Name == "" {
		return errors.New("instance has no name")
	}
	if !i.Role.Valid() {
		return fmt.Errorf("instance %s: unknown role %q", i.Name, i.Role)
	}
	if len(i.IPs) == 0 {
		return fmt.Errorf("instance %s has no IPs", i.Name)
	}
	for _, ip := range i.IPs {
		if net.ParseIP(ip) == nil {
			return fmt.Errorf("instance %s: invalid IP %q", i.Name, ip)
		}
	}
	return nil
}

// HasIP reports whether ip is one of the instance's addresses.
func (i Instance) HasIP(ip net.IP) bool {
	for _, s := range i.IPs {
		if p := net.ParseIP(s); p != nil && p.Equal(ip) {
			return true
		}
	}
	return false
}

// ErrNotFound is returned when the platform has no answer for the caller yet (unknown instance,
// no control-plane endpoint published). Callers may retry.
var ErrNotFound = errors.New("not found in metadata")

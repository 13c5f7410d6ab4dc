// Package machines is the cluster's record of the attested machines that joined it and of the ones
// an operator removed: the contract between the joinservice, which records every machine it admits
// and refuses removed ones (reason REVOKED), and `berth node remove` / `berth node readmit`, which
// remove and re-admit them, and `berth status`, which shows them.
//
// The record is ConfigMap berth-machines in Berth's namespace. Its key machines.json holds a JSON
// array of Machine values, one per machine identity, in the order they were first admitted. A
// machine is known by its attested identity (Identity), never by the name it had: removing node w1
// revokes the machine that joined as w1, which then cannot join or get a rejoin ticket under any
// name until it is re-admitted.
//
// A removed control plane's etcd member is removed by a joinservice replica (etcd's client
// certificates are on the control planes, not with the operator): `berth node remove` records the
// removal with its etcd member Pending, a replica removes the member (refusing to break quorum
// unless the removal is forced) and records the outcome, which the CLI waits for.
//
// Every write is a read-modify-write with the read resourceVersion (Update), so the joinservice's
// replicas and the CLI never overwrite each other's changes. A record takes about 250 bytes: the
// ConfigMap holds about 4,000 machines.
package machines

import (
	"context"
	"encoding/hex"
	"errors"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/configmapkey"
	"github.com/berth-k8s/berth/internal/joinconfig"
)

// Names.
const (
	// ConfigMapName is the record's ConfigMap.
	ConfigMapName = joinconfig.MachinesName
	// DataKey is the ConfigMap key holding the machines as a JSON array.
	DataKey = "machines.json"
	// RevokedNodesKey is the ConfigMap key holding the node names of the revoked machines, sorted
	// and separated by single spaces: the list the API server's revocation policy reads
	// (berthsystem.Revocation). Update writes it with DataKey in one write.
	RevokedNodesKey = joinconfig.MachinesRevokedNodesKey
)

// Roles of a machine's node.
const (
	RoleWorker       = "worker"
	RoleControlPlane = "control-plane"
)

// instancePrefix marks an identity that names the instance, not the hardware.
const instancePrefix = "instance/"

// Identity encodes a machine identity for the record. An attested identity
// (attestation.Result.Identity, the SHA-256 of a TPM's endorsement key) is its hex; a machine whose
// attestation carries no per-machine identity (TDX, or none) is "instance/" + the instance name the
// platform gives its address, a weaker binding: it revokes whatever machine holds that instance.
func Identity(attested []byte, instance string) string {
	if len(attested) > 0 {
		return hex.EncodeToString(attested)
	}
	return instancePrefix + instance
}

// Short is identity shortened for tables: the first 16 hex digits of an attested identity.
func Short(identity string) string {
	if strings.HasPrefix(identity, instancePrefix) || len(identity) <= 16 {
		return identity
	}
	return identity[:16]
}

// Machine is one machine the cluster admitted.
type Machine struct {
	// Identity is the machine's identity (see Identity).
	Identity string `json:"identity"`
	// Node is the node name it joined as.
	Node string `json:"node"`
	// Role is RoleWorker or RoleControlPlane.
	Role string `json:"role"`
	// Admitted is when a joinservice first recorded it.
	Admitted time.Time `json:"admitted"`
	// Removal is set while an operator has removed the machine.
	Removal *Removal `json:"removal,omitempty"`
}

// Removal is an operator's removal of a machine.
type Removal struct {
	Time time.Time `json:"time"`
	// Force removes a control plane's etcd member even when that leaves etcd without quorum.
	Force bool `json:"force,omitempty"`
	// Etcd is where the removal of a control plane's etcd member stands; empty for a worker.
	Etcd EtcdState `json:"etcd,omitempty"`
	// EtcdMessage says why, for Refused, or what went wrong last, for Pending.
	EtcdMessage string `json:"etcdMessage,omitempty"`
}

// EtcdState is where the removal of a control plane's etcd member stands.
type EtcdState string

// States of an etcd member's removal.
const (
	// EtcdPending: no joinservice replica has removed the member yet.
	EtcdPending EtcdState = "pending"
	// EtcdRemoved: a replica removed the member.
	EtcdRemoved EtcdState = "removed"
	// EtcdAbsent: etcd had no member for the node.
	EtcdAbsent EtcdState = "absent"
	// EtcdRefused: removing the member would have left etcd without quorum, and the removal was not
	// forced. The machine is not revoked; `berth node remove` takes the removal back.
	EtcdRefused EtcdState = "refused"
)

// Revoked reports whether the machine is removed: it may not join or rejoin.
func (m Machine) Revoked() bool { return m.Removal != nil && m.Removal.Etcd != EtcdRefused }

// ErrNoRecord is returned by Read when the cluster has no record yet.
var ErrNoRecord = errors.New("the cluster has no machine record yet")

// Read returns the machines of the record in namespace.
func Read(ctx context.Context, client kubernetes.Interface, namespace string) ([]Machine, error) {
	return configmapkey.ReadList[Machine](ctx, client, configmapkey.Ref{Namespace: namespace, Name: ConfigMapName, Key: DataKey}, "machine record", ErrNoRecord)
}

// Decode parses the value of DataKey.
func Decode(s string) ([]Machine, error) {
	return configmapkey.DecodeList[Machine](s, "machine record")
}

// Encode returns the value of DataKey for ms.
func Encode(ms []Machine) (string, error) {
	return configmapkey.EncodeList(ms, "machine record")
}

// conflictBackoff spaces the rounds of an Update that lost a race with another writer: from 10 ms,
// growing by half each time, jittered by half (every replica of the joinservice and the CLI may write
// at once). Reaching the one-second cap ends the rounds (wait.Backoff's Cap sets Steps to 0): 12
// rounds over about 2.5 s, before Steps' 20.
var conflictBackoff = wait.Backoff{Duration: 10 * time.Millisecond, Factor: 1.5, Jitter: 0.5, Cap: time.Second, Steps: 20}

// ErrUnchanged, returned by an Update's change function, ends the Update without writing.
var ErrUnchanged = errors.New("machine record unchanged")

// Update applies change to the record in namespace and writes the result with the read
// resourceVersion, creating the ConfigMap when there is none and starting over on a conflict. It
// returns the machines as written, or as read when change returned ErrUnchanged; any other error of
// change ends it with that error.
func Update(ctx context.Context, client kubernetes.Interface, namespace string, change func([]Machine) ([]Machine, error)) ([]Machine, error) {
	var read, changed []Machine
	ref := configmapkey.Ref{Namespace: namespace, Name: ConfigMapName, Key: DataKey,
		Labels: map[string]string{joinconfig.PartOfLabel: joinconfig.PartOf},
		Derived: func(string) map[string]string {
			return map[string]string{RevokedNodesKey: strings.Join(RevokedNodes(changed), " ")}
		}}
	_, err := configmapkey.Update(ctx, client, ref, conflictBackoff, func(data string) (string, error) {
		ms, err := Decode(data)
		if err != nil {
			return "", err
		}
		read = ms
		if changed, err = change(ms); err != nil {
			return "", err
		}
		return Encode(changed)
	})
	switch {
	case errors.Is(err, ErrUnchanged):
		return read, nil
	case err != nil:
		return nil, err
	}
	return changed, nil
}

// RevokedNodes returns the sorted node names of the revoked machines in ms, each once. A kubelet
// credential names its node, not its machine: while any machine that joined as a node is revoked,
// the API server refuses every credential of that node name, including one a replacement machine
// joining under the same name would get, until the operator re-admits the revoked machine.
func RevokedNodes(ms []Machine) []string {
	var names []string
	for _, m := range ms {
		if m.Revoked() && m.Node != "" {
			names = append(names, m.Node)
		}
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// Admit adds the machines of more that ms does not hold yet (by identity) and returns the result and
// whether anything was added. It never changes a recorded machine: a removed machine stays removed
// however often it is admitted again.
func Admit(ms []Machine, more ...Machine) ([]Machine, bool) {
	known := make(map[string]bool, len(ms))
	for _, m := range ms {
		known[m.Identity] = true
	}
	added := false
	for _, m := range more {
		if known[m.Identity] {
			continue
		}
		known[m.Identity] = true
		ms = append(ms, m)
		added = true
	}
	return ms, added
}

// ByNode returns the machine that last joined as node: the removed one if asked for (removed), else
// one that is not removed.
func ByNode(ms []Machine, node string, removed bool) (Machine, bool) {
	var found Machine
	ok := false
	for _, m := range ms {
		if m.Node != node || m.Revoked() != removed {
			continue
		}
		if !ok || m.Admitted.After(found.Admitted) {
			found, ok = m, true
		}
	}
	return found, ok
}

// Index returns the position of the machine with identity in ms, or -1.
func Index(ms []Machine, identity string) int {
	for i, m := range ms {
		if m.Identity == identity {
			return i
		}
	}
	return -1
}

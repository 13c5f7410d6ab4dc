package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// MachineState is where a machine stands in the cluster.
type MachineState string

// States of a machine.
const (
	// StateAdmitted: the joinservice admitted the machine and it is not removed.
	StateAdmitted MachineState = "Admitted"
	// StateLocked: an operator removed the machine and the removal of its control plane's etcd
	// member is still pending; the machine is already refused.
	StateLocked MachineState = "Locked"
	// StateRemoved: an operator removed the machine (berth node remove); it may not join or rejoin
	// until it is re-admitted.
	StateRemoved MachineState = "Removed"
)

// Machine is one attested machine the cluster admitted, named by its identity (records.NameFor).
//
// +genclient
// +k8s:deepcopy-gen:interfaces=k8s.io/apimachinery/pkg/runtime.Object
type Machine struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   MachineSpec   `json:"spec"`
	Status MachineStatus `json:"status,omitempty"`
}

// MachineSpec is who the machine is.
type MachineSpec struct {
	// Identity is the machine's identity in the machine record's encoding (machines.Identity): the
	// hex SHA-256 of its TPM's endorsement key, or "instance/" and its instance name.
	Identity string `json:"identity"`
	// Node is the node name it last joined as.
	Node string `json:"node"`
	// Role is worker or control-plane.
	Role string `json:"role"`
}

// MachineStatus is what the cluster knows of the machine.
type MachineStatus struct {
	// State is Admitted, Locked or Removed.
	State MachineState `json:"state"`
	// Admitted is when a joinservice first admitted the machine.
	Admitted metav1.Time `json:"admitted"`
	// LastJoin is the machine's latest accepted join or rejoin.
	LastJoin *JoinSeen `json:"lastJoin,omitempty"`
	// Evidence is the machine's latest verified attestation: enough to judge it again against
	// another policy (berth policy diff).
	Evidence *Evidence `json:"evidence,omitempty"`
	// Removed is when an operator removed the machine; unset while it is admitted.
	Removed *metav1.Time `json:"removed,omitempty"`
	// JoinTrace is the phases of the machine's latest join as its node reported them
	// (internal/jointrace); unset until the node reports.
	JoinTrace *JoinTrace `json:"joinTrace,omitempty"`
}

// JoinTrace is a node's own account of its join: phase by phase, with durations and a failed
// phase's reason.
type JoinTrace struct {
	// Reported is when a joinservice stored the trace.
	Reported metav1.Time `json:"reported"`
	// Phases are the join's phases, oldest first.
	Phases []JoinPhase `json:"phases"`
}

// Phases of a join (internal/jointrace), in their order.
const (
	PhaseMetadata = "metadata"
	PhaseTicket   = "ticket"
	PhaseJoin     = "kubeadm-join"
	PhaseReady    = "node-ready"
)

// JoinPhases lists the phases of a join in their order.
var JoinPhases = []string{PhaseMetadata, PhaseTicket, PhaseJoin, PhaseReady}

// Outcomes of a phase.
const (
	PhaseOutcomeSucceeded = "succeeded"
	PhaseOutcomeFailed    = "failed"
	PhaseOutcomeRunning   = "running"
)

// Bounds of a join trace.
const (
	// MaxTracePhases bounds a trace's phases.
	MaxTracePhases = 8
	// MaxTraceReason bounds a phase's reason code.
	MaxTraceReason = 64
	// MaxTraceMessage bounds a phase's message.
	MaxTraceMessage = 400
)

// JoinPhase is one phase of a join, by the node's clock.
type JoinPhase struct {
	// Name is metadata, ticket, kubeadm-join or node-ready.
	Name string `json:"name"`
	// Start is when the phase began.
	Start metav1.Time `json:"start"`
	// Duration is how long it took (or ran until the report).
	Duration metav1.Duration `json:"duration"`
	// Outcome is succeeded, failed or running.
	Outcome string `json:"outcome"`
	// Reason is a failed phase's reason code.
	Reason string `json:"reason,omitempty"`
	// Message says more about the outcome.
	Message string `json:"message,omitempty"`
}

// JoinSeen is one accepted join as a joinservice replica saw it.
type JoinSeen struct {
	Time metav1.Time `json:"time"`
	// RPC is join or rejoin.
	RPC string `json:"rpc"`
	// Peer is the address the call came from.
	Peer string `json:"peer,omitempty"`
	// Replica is the joinservice replica (its node) that answered.
	Replica string `json:"replica,omitempty"`
}

// Evidence is a verified attestation, reduced to what a policy judges.
type Evidence struct {
	// SHA256 is the hex SHA-256 of the attestation document.
	SHA256 string `json:"sha256"`
	// Variant is the attestation variant (tpm, tdx).
	Variant string `json:"variant"`
	// Measurements are the attested measurement values by index (decimal), in hex.
	Measurements map[string]string `json:"measurements,omitempty"`
}

// MachineList is a list of Machines.
//
// +k8s:deepcopy-gen:interfaces=k8s.io/apimachinery/pkg/runtime.Object
type MachineList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []Machine `json:"items"`
}

// Classes of join records: what the refused peer proved (the join ledger's kinds).
const (
	// ClassEvidence: refusals that cost the peer a verified attestation.
	ClassEvidence = "evidence"
	// ClassUnverified: refusals of what a peer sent without proving anything.
	ClassUnverified = "unverified"
)

// JoinRecord is the refusals of one machine (or, without an attested identity, one peer address)
// for one reason, aggregated: how many, the first and the latest.
//
// +genclient
// +k8s:deepcopy-gen:interfaces=k8s.io/apimachinery/pkg/runtime.Object
type JoinRecord struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   JoinRecordSpec   `json:"spec"`
	Status JoinRecordStatus `json:"status,omitempty"`
}

// JoinRecordSpec is what the refusals of a record share.
type JoinRecordSpec struct {
	// Class is evidence or unverified.
	Class string `json:"class"`
	// Identity is the refused machine's identity, when its attestation verified.
	Identity string `json:"identity,omitempty"`
	// Peer is the address the refusals came from ("*" for the overflow record of a class).
	Peer string `json:"peer"`
	// Node is the instance name the platform gives the peer; empty when unknown.
	Node string `json:"node,omitempty"`
	// RPC is the refused call (join, rejoin, handshake).
	RPC string `json:"rpc,omitempty"`
	// Reason is the refusals' reason code.
	Reason string `json:"reason"`
}

// JoinRecordStatus counts the refusals.
type JoinRecordStatus struct {
	// Count is how many refusals the record stands for.
	Count int64 `json:"count"`
	// First and Last are the times of the first and the latest refusal.
	First metav1.Time `json:"first"`
	Last  metav1.Time `json:"last"`
	// Message is the latest refusal's message.
	Message string `json:"message,omitempty"`
	// EvidenceSHA256 is the hex SHA-256 of the latest refused attestation document, if any.
	EvidenceSHA256 string `json:"evidenceSHA256,omitempty"`
	// Replica is the joinservice replica that refused last.
	Replica string `json:"replica,omitempty"`
}

// JoinRecordList is a list of JoinRecords.
//
// +k8s:deepcopy-gen:interfaces=k8s.io/apimachinery/pkg/runtime.Object
type JoinRecordList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []JoinRecord `json:"items"`
}

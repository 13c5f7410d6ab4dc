// Package reasons explains every reason code Berth refuses with: what caused the refusal, what to
// check and what to do next. The joinservice's RPC and handshake refusals, the join ledger's and
// the record API's reasons, the node's refusal of a joinservice and the certificate keeper's CSR
// denials all have an entry here; a test at the repository root fails when a reason constant in
// the code has none, and REASONS.md is generated from the table (make reasons-docs).
//
// The CLI prints an entry's short form next to every refusal it shows (berth status, berth status
// NODE) and the whole entry on request (berth explain CODE).
package reasons

import (
	"bytes"
	"fmt"
	"slices"
	"strings"
)

// Entry explains one reason code.
type Entry struct {
	// Code is the reason as the code, the ledger and the records spell it.
	Code string
	// Where names who refuses with it and where an operator sees it.
	Where string
	// Cause says what happened, in one sentence.
	Cause string
	// Check says what to look at to find out why.
	Check string
	// Next is what to do about it.
	Next string
}

// Short is the entry's one-line form: the cause and what to do next.
func (e Entry) Short() string {
	return e.Cause + " Next: " + e.Next
}

// Where refusals appear.
const (
	whereAdmin     = "joinservice admin RPC (berth kubeconfig's error; join ledger RPC \"admin-credential\")"
	whereRPC       = "joinservice RPC (gRPC ErrorInfo, domain berth.joinservice); join ledger and JoinRecords"
	whereHandshake = "joinservice attested TLS handshake (join ledger RPC \"handshake\"); JoinRecords"
	whereCSR       = "certificate keeper: the CSR's Denied condition (kubectl get csr) and berth_certkeeper_csr_decisions_total"
)

// catalog is every reason, sorted by Code (TestCatalogSorted).
var catalog = []Entry{
	{
		Code:  "ADMIN_CHALLENGE_STALE",
		Where: whereAdmin,
		Cause: "The admin credential request's nonce is not one this joinservice replica issued in the last minute, or it was used already.",
		Check: "Whether the request went to the same control plane as its challenge (one --endpoint) and the operator machine's clock.",
		Next:  "Run berth kubeconfig again; it asks for a fresh challenge.",
	},
	{
		Code:  "ADMIN_PROOF_MISMATCH",
		Where: whereAdmin,
		Cause: "The admin credential request's proof was not made with this cluster's master secret.",
		Check: "Which master secret file berth kubeconfig read (--master-secret, --workspace) and which cluster --endpoint names.",
		Next:  "Use the master secret berth init wrote for this cluster; repeated refusals from one address are someone guessing.",
	},
	{
		Code:  "AddressNotOfNode",
		Where: whereCSR,
		Cause: "A kubelet serving-certificate request names an IP address the node's instance does not have.",
		Check: "kubectl get csr NAME -o yaml (the requested IP addresses) against the instance's addresses in the cloud metadata.",
		Next:  "Fix the node's address configuration; the kubelet asks again by itself.",
	},
	{
		Code:  "BAD_CSR",
		Where: whereRPC,
		Cause: "The kubelet certificate request in a join does not parse, or its key cannot be certified.",
		Check: "The node's bootstrapper log around the join (journalctl -u berth-bootstrapper).",
		Next:  "A genuine bootstrapper never sends one: rebuild or reinstall the node's image.",
	},
	{
		Code:  "BAD_DISK_UUID",
		Where: whereRPC,
		Cause: "The join or rejoin names a state disk UUID that is not a canonical UUID.",
		Check: "The node's state disk header (blkid) and its bootstrapper log.",
		Next:  "A genuine bootstrapper never sends one: re-provision the node's state disk.",
	},
	{
		Code:  "BAD_PUBLIC_KEY",
		Where: whereAdmin,
		Cause: "The public key of an admin credential request does not parse or is of a type or size the cluster CA does not certify.",
		Check: "The berth CLI's version against the cluster's.",
		Next:  "Use a berth CLI of the cluster's version; it generates a key the CA certifies.",
	},
	{
		Code:  "BAD_SIGNATURE",
		Where: whereHandshake,
		Cause: "The attestation's quote or report signature does not verify against its attestation key.",
		Check: "berth status (the peer and count); a garbage certificate from a scanner looks like this.",
		Next:  "Nothing for a stranger; for a node of yours, its TPM or TDX module is broken: replace the machine.",
	},
	{
		Code:  "BAD_TRACE",
		Where: "joinservice ReportTrace RPC (the node's log: \"reporting the join trace\")",
		Cause: "A node sent a join trace the joinservice will not store: an unknown or repeated phase, too many phases, a duration out of range, text that is not printable.",
		Check: "The node's own trace, join-trace.json in its state directory, and whether node and joinservice run the same Berth version.",
		Next:  "Nothing is lost: the node keeps its trace. Update the node's image to the cluster's version.",
	},
	{
		Code:  "BAD_VALIDITY",
		Where: whereAdmin,
		Cause: "An admin credential request asks for a validity outside the bounds the joinservice issues (one minute to one week).",
		Check: "The --validity given to berth kubeconfig.",
		Next:  "Ask for a validity within the bounds.",
	},
	{
		Code:  "BadRequest",
		Where: whereCSR,
		Cause: "A kubelet serving-certificate request is not a PEM certificate request, does not parse, or its signature does not verify.",
		Check: "kubectl get csr NAME -o yaml.",
		Next:  "The kubelet asks again; if it persists, check the kubelet's version and configuration.",
	},
	{
		Code:  "BadUsages",
		Where: whereCSR,
		Cause: "A kubelet serving-certificate request asks for key usages other than a serving certificate's.",
		Check: "kubectl get csr NAME -o yaml (spec.usages).",
		Next:  "Check what created the request: a genuine kubelet asks for digital signature and server auth only.",
	},
	{
		Code:  "CONTROL_PLANE_JOIN_BUSY",
		Where: whereRPC,
		Cause: "Another control plane is joining (or a certificate renewal holds the control-plane slot); control planes join one at a time.",
		Check: "berth status (the slot's holder) and kubectl -n berth-system get lease.",
		Next:  "Nothing: the node retries and joins when the slot frees (at the latest after the join timeout).",
	},
	{
		Code:  "CONTROL_PLANE_JOIN_TIMEOUT",
		Where: "join ledger membership event; berth status",
		Cause: "A control-plane join did not finish (etcd member voting and healthy, API server ready) within the join timeout, which freed the slot.",
		Check: "The joining node's bootstrapper and kubeadm log, and etcdctl member list on a healthy control plane.",
		Next:  "Remove the half-joined member (berth node remove NODE) and let the node join again.",
	},
	{
		Code:  "DISK_NOT_BOUND",
		Where: whereRPC,
		Cause: "A rejoin asks for the key of a state disk that was never bound to the attested machine.",
		Check: "berth status NODE (the machine's recorded disk) and whether the disk was moved between machines.",
		Next:  "Put the disk back in its machine; a disk moved on purpose needs berth recover.",
	},
	{
		Code:  "HANDSHAKE_FAILED",
		Where: "joinservice metrics only (berth_joinservice_*, reason HANDSHAKE_FAILED)",
		Cause: "A TLS handshake failed without an attestation verdict: an identity probe, a port scan, a client that hung up.",
		Check: "The metrics' rate; a steady stream from one address is a scanner.",
		Next:  "Nothing unless the rate is high; the handshake budget bounds its cost.",
	},
	{
		Code:  "INTERNAL",
		Where: whereRPC,
		Cause: "The joinservice could not complete the request (it could not read the KMS key spec, the control-plane files or its records).",
		Check: "The joinservice's log on the replica named in berth status (kubectl -n berth-system logs).",
		Next:  "The node retries by itself; fix what the joinservice's log names.",
	},
	{
		Code:  "JOINSERVICE_NOT_BOUND",
		Where: "the node (bootstrapper log); the node refuses the joinservice",
		Cause: "The joinservice's attestation does not show its lock register holding this cluster's control-plane value: it is not a control plane of this cluster.",
		Check: "The address the node dialed (its join endpoint) and the lock register of the machine answering there.",
		Next:  "Point the node at a real control plane; a machine posing as the joinservice is an attack.",
	},
	{
		Code:  "KEY_BINDING",
		Where: whereHandshake,
		Cause: "A genuine quote was made for this handshake's nonce but is bound to another connection's TLS key: a relayed attestation.",
		Check: "berth status (the peer and the evidence digest); the ledger keeps these among the evidence.",
		Next:  "Treat it as an attack from that peer: find who relays the quote of which machine.",
	},
	{
		Code:  "KUBEADM_JOIN_FAILED",
		Where: "the node's join trace (phase kubeadm-join): berth status NODE, the Machine's status.joinTrace, join-trace.json",
		Cause: "The node got a ticket, but kubeadm join failed, or kept failing, on it.",
		Check: "The phase's message, then the node's bootstrapper log (kubeadm's output at debug level) and the API server's reachability from the node.",
		Next:  "Fix what kubeadm names; a node whose join failed after it took the lock starts fresh after a reboot.",
	},
	{
		Code:  "MACHINE_RECORD_UNAVAILABLE",
		Where: whereRPC,
		Cause: "This joinservice replica has not read the machine record yet, so it cannot tell whether the machine was removed.",
		Check: "The joinservice's log and whether the API server answers (kubectl get --raw /readyz).",
		Next:  "The node retries; the refusal ends when the replica has read the record.",
	},
	{
		Code:  "MALFORMED_EVIDENCE",
		Where: whereHandshake,
		Cause: "The attestation document does not parse, or the measurements a node claims in its handshake do not decode.",
		Check: "berth status (the peer); a scanner or an incompatible bootstrapper version sends these.",
		Next:  "For a node of yours, check that its image and the cluster run compatible Berth versions.",
	},
	{
		Code:  "MEASUREMENT_MISMATCH",
		Where: whereRPC + "; also in the handshake, on the measurements a node claims",
		Cause: "The node's measured boot (PCRs or TDX registers) differs from the cluster's attestation policy. On join and rejoin the lock register (TPM PCR 15, TDX RTMR3) must still be zero; on a check-in it may also hold this cluster's worker or control-plane value, and any other value there means the node booted into another cluster.",
		Check: "berth status NODE or the ledger's message (the index and the expected value; index 15 or RTMR3 is the lock register); berth verify against the node.",
		Next:  "If the node runs an image you meant to admit, add its measurements to the policy (berth policy diff OLD NEW first); otherwise the node is not trusted.",
	},
	{
		Code:  "NODE_NOT_READY",
		Where: "the node's join trace (phase node-ready): berth status NODE, the Machine's status.joinTrace, join-trace.json",
		Cause: "kubeadm join succeeded, but the Node did not report Ready within the node's wait.",
		Check: "kubectl describe node NODE (its conditions), the node's kubelet log and the cluster's network plugin.",
		Next:  "Fix what the Node's conditions name; the Node becomes Ready by itself once it can.",
	},
	{
		Code:  "NONCE_MISMATCH",
		Where: whereHandshake,
		Cause: "A genuine quote signed for another handshake's nonce was presented: a replayed attestation.",
		Check: "berth status (the peer and the evidence digest); the ledger keeps these among the evidence.",
		Next:  "Treat it as an attack from that peer.",
	},
	{
		Code:  "NOT_ACTIVATED",
		Where: whereHandshake,
		Cause: "The peer did not activate its attestation key: it could not prove the key lives in the TPM whose endorsement key it named.",
		Check: "berth status (the peer); a client without a TPM sends these.",
		Next:  "For a node of yours, check its TPM (the bootstrapper's log).",
	},
	{
		Code:  "NO_EVIDENCE",
		Where: whereRPC,
		Cause: "The request came without an attestation: the client did not connect over attested TLS.",
		Check: "The client's version and the address it dialed.",
		Next:  "Connect with a Berth bootstrapper; nothing else is admitted.",
	},
	{
		Code:  "NO_MACHINE",
		Where: "joinservice ReportTrace RPC (the node's log: \"reporting the join trace\")",
		Cause: "A node reported its join trace, but the cluster holds no Machine for its attested identity: it was never admitted, or its Machine was deleted.",
		Check: "kubectl get bm and berth status NODE (the node's JoinRecords show why it was refused).",
		Next:  "Nothing to do for the trace itself: it stays in join-trace.json on the node.",
	},
	{
		Code:  "NameNotOfNode",
		Where: whereCSR,
		Cause: "A kubelet serving-certificate request names a DNS name that is not the node's.",
		Check: "kubectl get csr NAME -o yaml (the requested DNS names).",
		Next:  "Check the node's hostname configuration; the kubelet asks again.",
	},
	{
		Code:  "NodeRevoked",
		Where: whereCSR,
		Cause: "The certificate request comes from a node whose machine an operator removed.",
		Check: "berth status NODE (state removed).",
		Next:  "berth node readmit NODE if the removal was a mistake; otherwise nothing.",
	},
	{
		Code:  "NotANode",
		Where: whereCSR,
		Cause: "A kubelet serving-certificate request comes from a user that is not a node (not system:node:NAME in system:nodes).",
		Check: "kubectl get csr NAME -o yaml (spec.username and groups).",
		Next:  "Find who created it; only kubelets may ask for serving certificates.",
	},
	{
		Code:  "RATE_LIMITED",
		Where: whereRPC,
		Cause: "The peer exceeded its request budget (per peer, or the class of peers it belongs to).",
		Check: "berth status (the peer and count) and the joinservice's metrics.",
		Next:  "Nothing for a genuine node: it backs off and retries. Many from one peer is a flood.",
	},
	{
		Code:  "REVOKED",
		Where: whereRPC + "; the check-in of a joined node",
		Cause: "An operator removed this machine (berth node remove); it gets no ticket, no disk key, and a check-in locks it.",
		Check: "berth status NODE (state removed, who and when).",
		Next:  "berth node readmit NODE if the machine should come back.",
	},
	{
		Code:  "ROLE_MISMATCH",
		Where: whereRPC,
		Cause: "The node asked to join in a role (control plane or worker) its instance's metadata does not give it.",
		Check: "The instance's role in the cloud metadata (berth metadata) and the node's configuration.",
		Next:  "Correct the instance's role tag, or start the node with the role it has.",
	},
	{
		Code:  "SubjectMismatch",
		Where: whereCSR,
		Cause: "A kubelet serving-certificate request's subject is not system:node:NAME of the requesting node.",
		Check: "kubectl get csr NAME -o yaml.",
		Next:  "Find who created it: a node may only ask for its own name.",
	},
	{
		Code:  "UNKNOWN_PEER",
		Where: whereRPC,
		Cause: "The caller's address belongs to no instance of the cluster.",
		Check: "berth metadata (the cluster's instances and addresses) against the peer address in berth status.",
		Next:  "Register the instance with the cluster's metadata, or ignore a stranger.",
	},
	{
		Code:  "UNKNOWN_VARIANT",
		Where: whereHandshake,
		Cause: "The attestation is of a variant (TPM, TDX) the cluster's policy does not accept.",
		Check: "The attestation policy file's variant and the node's platform.",
		Next:  "Run the node on the platform the policy names.",
	},
	{
		Code:  "UNTRUSTED_ROOT",
		Where: whereHandshake,
		Cause: "The attestation key is not rooted in a CA the policy trusts (an unknown TPM endorsement key CA or TDX collateral).",
		Check: "The policy's trusted roots and the node's TPM manufacturer; any software key with a CA of its own lands here.",
		Next:  "Add the manufacturer's CA to the policy if the machine is yours; otherwise nothing.",
	},
	{
		Code:  "UnknownInstance",
		Where: whereCSR,
		Cause: "The node asking for a serving certificate is not an instance the cloud metadata knows.",
		Check: "berth metadata and the Node's provider ID.",
		Next:  "The request stays denied; register the instance or remove the Node.",
	},
	{
		Code:  "WRONG_CLUSTER",
		Where: whereRPC + "; the check-in of a joined node",
		Cause: "A node checked in naming another cluster's ID: its disk or sealed key belongs to a different cluster.",
		Check: "The node's bootstrapper log (the cluster ID it holds) and where its disk came from.",
		Next:  "Wipe and re-provision the node for this cluster.",
	},
}

// Lookup returns the entry of code and whether there is one.
func Lookup(code string) (Entry, bool) {
	i, ok := slices.BinarySearchFunc(catalog, code, func(e Entry, c string) int { return strings.Compare(e.Code, c) })
	if !ok {
		return Entry{}, false
	}
	return catalog[i], true
}

// Short returns code's one-line explanation, or "" for a code without an entry.
func Short(code string) string {
	e, ok := Lookup(code)
	if !ok {
		return ""
	}
	return e.Short()
}

// All returns every entry, sorted by code.
func All() []Entry {
	return slices.Clone(catalog)
}

// Reference is the reasons' reference (REASONS.md), generated from the table.
func Reference() []byte {
	var b bytes.Buffer
	b.WriteString("<!-- Generated from internal/reasons by `make reasons-docs`; do not edit. -->\n\n")
	b.WriteString("# Reason codes\n\n")
	b.WriteString("Every code Berth refuses with, what caused it, what to check and what to do next.\n")
	b.WriteString("`berth explain CODE` prints one entry; `berth status` prints the short form under its refusals.\n")
	for _, e := range catalog {
		fmt.Fprintf(&b, "\n## %s\n\n", e.Code)
		fmt.Fprintf(&b, "- **Where:** %s\n", e.Where)
		fmt.Fprintf(&b, "- **Cause:** %s\n", e.Cause)
		fmt.Fprintf(&b, "- **Check:** %s\n", e.Check)
		fmt.Fprintf(&b, "- **Next:** %s\n", e.Next)
	}
	return b.Bytes()
}

// Package records is Berth's record API (group records.berth.dev, version v1alpha1): the custom
// resources in which the cluster keeps its memory, and the CustomResourceDefinitions that serve them.
//
//	kind        plural       short   one object per
//	Machine     machines     bm      attested machine the joinservice admitted (named NameFor)
//	JoinRecord  joinrecords  bjr     machine or peer and reason of refused join attempts (RecordName)
//
// Both live in Berth's namespace. A Machine says who the machine is (identity, node, role), where it
// stands (Admitted, Locked, Removed), its latest accepted join and the evidence of its latest verified
// attestation, with its measurements, so that a policy can judge it again offline, and the phases
// of its join as its node reported them (internal/jointrace). A JoinRecord
// counts the refusals of one machine (or of one peer address, when nothing was verified) for one
// reason; each class of refusal has a bounded number of records (ClassQuota), so that a flood of
// unverified refusals never displaces the records of attested machines.
//
// The CustomResourceDefinitions are written here in Go (CRDs): an OpenAPI schema that prunes and
// validates every field, CEL rules for what a schema cannot say (an identity never changes; a
// removed machine has a removal time), printer columns for `kubectl get`. The Go types are in
// v1alpha1; the typed clientset and apply configurations are generated from them
// (make generate-records).
package records

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
)

// Names of the resources.
const (
	Group              = v1alpha1.GroupName
	Version            = "v1alpha1"
	MachinePlural      = "machines"
	MachineShort       = "bm"
	JoinRecordPlural   = "joinrecords"
	JoinRecordShort    = "bjr"
	MachineKind        = "Machine"
	JoinRecordKind     = "JoinRecord"
	MachineCRDName     = MachinePlural + "." + Group
	JoinRecordCRDName  = JoinRecordPlural + "." + Group
	categoryBerth      = "berth"
	maxIdentityLength  = 320
	maxMessageLength   = 1024
	maxNameFieldLength = 253
)

// ClassQuota is how many JoinRecords each class may have. A writer that finds its class full folds
// new keys into the class's overflow record (OverflowPeer) instead of creating another object.
var ClassQuota = map[string]int{v1alpha1.ClassEvidence: 1024, v1alpha1.ClassUnverified: 256}

// OverflowPeer is the peer of a class's overflow record: refusals of keys that found the class full.
const OverflowPeer = "*"

// NameFor is the name of the Machine of identity (machines.Identity's encoding). An attested
// identity (64 hex digits) is its own name; any other identity is "instance-" and the first 40 hex
// digits of its SHA-256, since an instance name need not be a valid object name.
func NameFor(identity string) string {
	if len(identity) == 64 && strings.Trim(identity, "0123456789abcdef") == "" {
		return identity
	}
	sum := sha256.Sum256([]byte(identity))
	return "instance-" + hex.EncodeToString(sum[:])[:40]
}

// RecordName is the name of the JoinRecord that aggregates refusals with spec's class, identity (or
// peer, when there is none), RPC, node and reason.
func RecordName(spec v1alpha1.JoinRecordSpec) string {
	who := spec.Identity
	if who == "" {
		who = "peer/" + spec.Peer
	}
	sum := sha256.Sum256([]byte(strings.Join([]string{spec.Class, who, spec.RPC, spec.Node, spec.Reason}, "\x00")))
	return spec.Class + "-" + hex.EncodeToString(sum[:])[:32]
}

// CRDs returns the CustomResourceDefinitions of the record API, Machine first.
func CRDs() []*apiextensionsv1.CustomResourceDefinition {
	return []*apiextensionsv1.CustomResourceDefinition{machineCRD(), joinRecordCRD()}
}

func crd(plural, short, kind string, schema apiextensionsv1.JSONSchemaProps, columns []apiextensionsv1.CustomResourceColumnDefinition) *apiextensionsv1.CustomResourceDefinition {
	return &apiextensionsv1.CustomResourceDefinition{
		TypeMeta: metav1.TypeMeta{APIVersion: "apiextensions.k8s.io/v1", Kind: "CustomResourceDefinition"},
		ObjectMeta: metav1.ObjectMeta{
			Name:   plural + "." + Group,
			Labels: map[string]string{joinconfig.PartOfLabel: joinconfig.PartOf},
		},
		Spec: apiextensionsv1.CustomResourceDefinitionSpec{
			Group: Group,
			Scope: apiextensionsv1.NamespaceScoped,
			Names: apiextensionsv1.CustomResourceDefinitionNames{
				Plural: plural, Singular: strings.ToLower(kind), Kind: kind, ListKind: kind + "List",
				ShortNames: []string{short}, Categories: []string{categoryBerth},
			},
			Versions: []apiextensionsv1.CustomResourceDefinitionVersion{{
				Name: Version, Served: true, Storage: true,
				Schema:                   &apiextensionsv1.CustomResourceValidation{OpenAPIV3Schema: &schema},
				AdditionalPrinterColumns: columns,
			}},
		},
	}
}

// object is the schema of a kind with spec and status.
func object(description string, spec, status apiextensionsv1.JSONSchemaProps) apiextensionsv1.JSONSchemaProps {
	return apiextensionsv1.JSONSchemaProps{
		Type: "object", Description: description, Required: []string{"spec"},
		Properties: map[string]apiextensionsv1.JSONSchemaProps{
			"apiVersion": {Type: "string"},
			"kind":       {Type: "string"},
			"metadata":   {Type: "object"},
			"spec":       spec,
			"status":     status,
		},
	}
}

func str(description string, maxLength int64) apiextensionsv1.JSONSchemaProps {
	return apiextensionsv1.JSONSchemaProps{Type: "string", Description: description, MaxLength: &maxLength}
}

func enum(description string, values ...string) apiextensionsv1.JSONSchemaProps {
	p := apiextensionsv1.JSONSchemaProps{Type: "string", Description: description}
	for _, v := range values {
		p.Enum = append(p.Enum, apiextensionsv1.JSON{Raw: []byte(`"` + v + `"`)})
	}
	return p
}

func timestamp(description string) apiextensionsv1.JSONSchemaProps {
	return apiextensionsv1.JSONSchemaProps{Type: "string", Format: "date-time", Description: description}
}

var hexDigest = apiextensionsv1.JSONSchemaProps{Type: "string", Pattern: "^[0-9a-f]{64}$", Description: "hex SHA-256"}

func machineCRD() *apiextensionsv1.CustomResourceDefinition {
	spec := apiextensionsv1.JSONSchemaProps{
		Type: "object", Required: []string{"identity", "node", "role"},
		Properties: map[string]apiextensionsv1.JSONSchemaProps{
			"identity": str("the machine's identity: hex SHA-256 of its TPM's endorsement key, or instance/ and its instance name", maxIdentityLength),
			"node":     str("the node name it last joined as", maxNameFieldLength),
			"role":     enum("the role of its node", "worker", "control-plane"),
		},
		XValidations: apiextensionsv1.ValidationRules{{
			Rule: "self.identity == oldSelf.identity", Message: "a machine's identity never changes",
		}},
	}
	minOne := int64(1)
	status := apiextensionsv1.JSONSchemaProps{
		Type: "object", Required: []string{"state", "admitted"},
		Properties: map[string]apiextensionsv1.JSONSchemaProps{
			"state":    enum("Admitted, Locked (removed, its etcd member's removal pending) or Removed", string(v1alpha1.StateAdmitted), string(v1alpha1.StateLocked), string(v1alpha1.StateRemoved)),
			"admitted": timestamp("when a joinservice first admitted the machine"),
			"removed":  timestamp("when an operator removed the machine"),
			"lastJoin": {
				Type: "object", Description: "the latest accepted join or rejoin", Required: []string{"time", "rpc"},
				Properties: map[string]apiextensionsv1.JSONSchemaProps{
					"time":    timestamp("when the call was accepted"),
					"rpc":     enum("the call", "join", "rejoin"),
					"peer":    str("the address the call came from", maxNameFieldLength),
					"replica": str("the joinservice replica that answered", maxNameFieldLength),
				},
			},
			"evidence": {
				Type: "object", Description: "the latest verified attestation, reduced to what a policy judges", Required: []string{"sha256", "variant"},
				Properties: map[string]apiextensionsv1.JSONSchemaProps{
					"sha256":  hexDigest,
					"variant": str("the attestation variant", 32),
					"measurements": {
						Type: "object", Description: "measurement values by index, in hex", MaxProperties: ptr(int64(64)),
						AdditionalProperties: &apiextensionsv1.JSONSchemaPropsOrBool{Allows: true, Schema: &apiextensionsv1.JSONSchemaProps{
							Type: "string", Pattern: "^([0-9a-f]{2}){1,64}$", MinLength: &minOne,
						}},
						XValidations: apiextensionsv1.ValidationRules{{
							Rule: "self.all(k, k.matches('^[0-9]{1,3}$'))", Message: "measurement indices are decimal numbers",
						}},
					},
				},
			},
			"joinTrace": joinTraceSchema(),
		},
		XValidations: apiextensionsv1.ValidationRules{{
			Rule: "has(self.removed) == (self.state != 'Admitted')", Message: "removed is set exactly when the machine is not admitted",
		}},
	}
	return crd(MachinePlural, MachineShort, MachineKind,
		object("an attested machine the cluster admitted", spec, status),
		[]apiextensionsv1.CustomResourceColumnDefinition{
			{Name: "Node", Type: "string", JSONPath: ".spec.node"},
			{Name: "Role", Type: "string", JSONPath: ".spec.role"},
			{Name: "State", Type: "string", JSONPath: ".status.state"},
			{Name: "Last Join", Type: "date", JSONPath: ".status.lastJoin.time"},
			{Name: "Evidence", Type: "string", JSONPath: ".status.evidence.sha256", Priority: 1},
			{Name: "Identity", Type: "string", JSONPath: ".spec.identity", Priority: 1},
			{Name: "Age", Type: "date", JSONPath: ".metadata.creationTimestamp"},
		})
}

// joinTraceSchema is the schema of a Machine's join trace (internal/jointrace checks what a node
// sends; the schema bounds what any writer may store).
func joinTraceSchema() apiextensionsv1.JSONSchemaProps {
	phase := apiextensionsv1.JSONSchemaProps{
		Type: "object", Required: []string{"name", "start", "duration", "outcome"},
		Properties: map[string]apiextensionsv1.JSONSchemaProps{
			"name":     enum("the phase", v1alpha1.JoinPhases...),
			"start":    timestamp("when the phase began, by the node's clock"),
			"duration": str("how long the phase took, or ran until the report", 32),
			"outcome":  enum("how the phase ended", v1alpha1.PhaseOutcomeSucceeded, v1alpha1.PhaseOutcomeFailed, v1alpha1.PhaseOutcomeRunning),
			"reason":   {Type: "string", Description: "a failed phase's reason code", MaxLength: ptr(int64(v1alpha1.MaxTraceReason)), Pattern: "^[A-Z0-9_]*$"},
			"message":  str("more about the outcome", v1alpha1.MaxTraceMessage),
		},
	}
	return apiextensionsv1.JSONSchemaProps{
		Type: "object", Description: "the phases of the machine's latest join as its node reported them", Required: []string{"reported", "phases"},
		Properties: map[string]apiextensionsv1.JSONSchemaProps{
			"reported": timestamp("when a joinservice stored the trace"),
			"phases": {
				Type: "array", MaxItems: ptr(int64(v1alpha1.MaxTracePhases)),
				Items: &apiextensionsv1.JSONSchemaPropsOrArray{Schema: &phase},
			},
		},
	}
}

func joinRecordCRD() *apiextensionsv1.CustomResourceDefinition {
	spec := apiextensionsv1.JSONSchemaProps{
		Type: "object", Required: []string{"class", "peer", "reason"},
		Properties: map[string]apiextensionsv1.JSONSchemaProps{
			"class":    enum("what the refused peer proved", v1alpha1.ClassEvidence, v1alpha1.ClassUnverified),
			"identity": str("the refused machine's identity, when its attestation verified", maxIdentityLength),
			"peer":     str("the address the refusals came from (* for a class's overflow record)", maxNameFieldLength),
			"node":     str("the instance name the platform gives the peer", maxNameFieldLength),
			"rpc":      str("the refused call", 32),
			"reason":   str("the refusals' reason code", 64),
		},
		XValidations: apiextensionsv1.ValidationRules{
			{Rule: "self == oldSelf", Message: "a join record's key never changes"},
			{Rule: "self.class == 'evidence' || !has(self.identity)", Message: "only an evidence record names an identity"},
		},
	}
	zero := float64(1)
	status := apiextensionsv1.JSONSchemaProps{
		Type: "object", Required: []string{"count", "first", "last"},
		Properties: map[string]apiextensionsv1.JSONSchemaProps{
			"count":          {Type: "integer", Format: "int64", Minimum: &zero, Description: "how many refusals the record stands for"},
			"first":          timestamp("the first refusal"),
			"last":           timestamp("the latest refusal"),
			"message":        str("the latest refusal's message", maxMessageLength),
			"evidenceSHA256": hexDigest,
			"replica":        str("the joinservice replica that refused last", maxNameFieldLength),
		},
		XValidations: apiextensionsv1.ValidationRules{{
			Rule: "timestamp(self.last) >= timestamp(self.first)", Message: "the latest refusal is not before the first",
		}},
	}
	return crd(JoinRecordPlural, JoinRecordShort, JoinRecordKind,
		object("the refused join attempts of one machine or peer for one reason", spec, status),
		[]apiextensionsv1.CustomResourceColumnDefinition{
			{Name: "Class", Type: "string", JSONPath: ".spec.class"},
			{Name: "Node", Type: "string", JSONPath: ".spec.node"},
			{Name: "Peer", Type: "string", JSONPath: ".spec.peer"},
			{Name: "Reason", Type: "string", JSONPath: ".spec.reason"},
			{Name: "Count", Type: "integer", JSONPath: ".status.count"},
			{Name: "Last", Type: "date", JSONPath: ".status.last"},
			{Name: "Message", Type: "string", JSONPath: ".status.message", Priority: 1},
		})
}

func ptr[T any](v T) *T { return &v }

// ClassLabel is the label of a JoinRecord that carries its class, so that a writer counts a class's
// records with a label selector.
const ClassLabel = Group + "/class"

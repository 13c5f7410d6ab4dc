// Package joinconfig is the contract between Berth's binaries about what they share through the
// Kubernetes API and the network: the names of the objects in berth-system, the joinservice's ports
// and environment, the annotations Berth keeps on Nodes, and the keys and encodings of the join
// ConfigMap and the cluster Secret.
//
// The bootstrapper writes these objects at init, the joinservice reads them on every start and watch,
// and the CLI reads the join ledger. All of them import this package and none imports another's, so
// a change to the contract is a change here, seen by every side at compile time.
package joinconfig

import (
	"encoding/hex"
	"errors"
	"fmt"
)

// Names of the objects Berth keeps in the cluster.
const (
	// Namespace holds every object Berth installs.
	Namespace = "berth-system"
	// SecretName is the Secret with the cluster secrets the joinservice derives join keys from.
	SecretName = "berth-cluster-secrets"
	// JoinConfigName is the ConfigMap with the join configuration (Config).
	JoinConfigName = "berth-join-config"
	// JoinLedgerName is the ConfigMap the joinservice records every join attempt in.
	JoinLedgerName = "berth-join-ledger"
	// JoinServiceName names the joinservice's DaemonSet and its pods' app label.
	JoinServiceName = "berth-joinservice"
	// ServiceAccountName is the joinservice's ServiceAccount.
	ServiceAccountName = "berth-joinservice"
	// ControlPlaneSlotLease is the control-plane slot (internal/cpslot): the Lease every operation
	// that disrupts a control plane takes, from the joinservice and the bootstrapper.
	ControlPlaneSlotLease = "berth-control-plane-slot"
	// CertKeeperLease elects the joinservice replica that keeps the cluster's certificates
	// (joinservice/certkeeper); its holder is NODE_suffix.
	CertKeeperLease = "berth-cert-keeper"
	// MachinesName is the ConfigMap recording every attested machine that joined and the ones an
	// operator removed (its format is package machines').
	MachinesName = "berth-machines"
	// MachinesRevokedNodesKey is the key of ConfigMap MachinesName listing the node names of revoked
	// machines, separated by spaces (internal/machines writes it, the API server's revocation policy
	// of internal/berthsystem reads it).
	MachinesRevokedNodesKey = "revoked-nodes"
	// KMSConfigName is the ConfigMap with the control planes' KMS key spec (internal/kmsstate), which
	// control-plane join tickets carry.
	KMSConfigName = "berth-kms"
	// BackupName is the Lease that elects the joinservice replica taking the scheduled etcd
	// snapshots, and the ConfigMap of their status and of `berth backup now`'s requests
	// (internal/backup).
	BackupName = "berth-backup"
	// BackupStoreSecretName is the optional Secret naming the S3-compatible object store the etcd
	// snapshots go to besides the control plane's state disk (keys BackupStore*).
	BackupStoreSecretName = "berth-backup-store"
	// BackupDir is where a control plane keeps its etcd snapshots, on its state disk.
	BackupDir = "/var/lib/berth/backups"
	// ClusterConfigNamespace and ClusterConfigName name the ConfigMap that keeps the cluster
	// configuration in force (internal/clusterconfig writes its content); the joinservice reads it
	// for the files a control-plane join ticket carries (internal/cpfiles).
	ClusterConfigNamespace = "kube-system"
	ClusterConfigName      = "berth-cluster-config"
)

// Keys of Secret BackupStoreSecretName.
const (
	BackupStoreEndpoint  = "endpoint"
	BackupStoreRegion    = "region"
	BackupStoreBucket    = "bucket"
	BackupStorePrefix    = "prefix"
	BackupStoreAccessKey = "accessKey"
	BackupStoreSecretKey = "secretKey"
	// BackupStorePathStyle is "true" for a store that addresses buckets in the path.
	BackupStorePathStyle = "pathStyle"
)

// Labels on Berth's objects (Kubernetes' recommended labels). Objects two writers apply, such as the
// join ledger (berthsystem creates it, the joinservice rewrites it), carry the same labels from both.
const (
	// PartOfLabel is PartOf on every object Berth creates.
	PartOfLabel = "app.kubernetes.io/part-of"
	PartOf      = "berth"
	// NameLabel names the component an object belongs to (JoinServiceName, webhookconfig.Name).
	NameLabel = "app.kubernetes.io/name"
)

// Ports of the joinservice on the host network of every control plane. Berth's host ports are one
// block, 9000-9003: the bootstrapper's init server (9000) and recovery server (9001, recoverproto),
// then these two. They stay out of Kubernetes' NodePort range (30000-32767), where kube-proxy forwards
// a port the API server hands to any NodePort Service on every node's addresses, which would take the
// join traffic; out of the kernel's ephemeral range (32768-60999), where an outgoing connection may
// hold the port; and off the ports of the usual monitoring and control-plane components (Prometheus
// 9090-9094, node exporter 9100, Calico 9091/9099, the Kubernetes components' 10248-10259, etcd
// 2379-2381, the API server 6443).
const (
	// JoinPort serves the JoinService gRPC API over mutual attested TLS, on every address of the node:
	// joining nodes dial it.
	JoinPort = 9002
	// MetricsPort serves /metrics, /livez and /readyz over plain HTTP. The DaemonSet binds it to the
	// node's own address (the pod's status.hostIP), not every interface: the kubelet probes it there
	// and Prometheus scrapes it there (pod discovery gives the pod's IP, the node's with host network,
	// and the port named "metrics").
	MetricsPort = 9003
)

// The joinservice's environment: what its DaemonSet (internal/berthsystem) and whoever deploys it (the
// bootstrapper, berth manifests --joinservice-env) set, and its command (joinservice/cmd/joinservice)
// reads. Each BERTH_* variable is the twin of the flag of the same name (BERTH_TDX_ROOT is --tdx-root).
const (
	// EnvNodeName is the pod's node (spec.nodeName): the replica's name in the join ledger and the
	// control-plane Lease (--replica).
	EnvNodeName       = "NODE_NAME"
	EnvMetadata       = "BERTH_METADATA"
	EnvMetadataURL    = "BERTH_METADATA_URL"
	EnvMetadataAPIURL = "BERTH_METADATA_API_URL"
	EnvMetadataFile   = "BERTH_METADATA_FILE"
	EnvAttestation    = "BERTH_ATTESTATION"
	EnvTPM            = "BERTH_TPM"
	// EnvTDXRoot is where the joinservice finds its node's TD guest interface
	// (berthsystem.AddTDXGuest mounts it there and sets it).
	EnvTDXRoot   = "BERTH_TDX_ROOT"
	EnvLogLevel  = "BERTH_LOG_LEVEL"
	EnvLogFormat = "BERTH_LOG_FORMAT"
)

// Annotations a control plane's certificate renewer (bootstrapper/certrenew) keeps on its Node and
// berth status reads.
const (
	// NodeCertExpiryAnnotation is the earliest NotAfter of the node's kubeadm certificates (RFC 3339).
	NodeCertExpiryAnnotation = "berth.dev/control-plane-cert-expiry"
	// NodeCertsRenewedAnnotation is when the node last renewed them (RFC 3339).
	NodeCertsRenewedAnnotation = "berth.dev/control-plane-certs-renewed"
)

// Keys of the join ConfigMap.
const (
	KeyAttestationPolicy = "attestationPolicy"
	KeyMeasurementSalt   = "measurementSalt"
	KeyClusterID         = "clusterID"
	KeyKubernetesVersion = "kubernetesVersion"
	KeyAPIServerEndpoint = "apiServerEndpoint"
)

// Keys of the cluster Secret.
const (
	KeyMasterSecret = "masterSecret"
	KeySalt         = "salt"
)

// ErrMissingKey is returned when a required key is absent or empty.
var ErrMissingKey = errors.New("missing key")

// ErrMalformed is returned when a value does not decode.
var ErrMalformed = errors.New("malformed value")

// Config is the join configuration: what a joining node needs to know about the cluster, and the
// policy it is judged by. It is public to anyone who can read berth-system.
type Config struct {
	// AttestationPolicy is the cluster's attestation policy (self-contained YAML).
	AttestationPolicy []byte
	// MeasurementSalt salts the measurements of the cluster (the init request's salt).
	MeasurementSalt []byte
	// ClusterID is the ID extended into every node's lock register.
	ClusterID []byte
	// KubernetesVersion is the version the cluster was initialized with.
	KubernetesVersion string
	// APIServerEndpoint is the control-plane endpoint (host:port) joining nodes use.
	APIServerEndpoint string
}

// Data encodes c as the ConfigMap's data.
func (c Config) Data() map[string]string {
	return map[string]string{
		KeyAttestationPolicy: string(c.AttestationPolicy),
		KeyMeasurementSalt:   hex.EncodeToString(c.MeasurementSalt),
		KeyClusterID:         hex.EncodeToString(c.ClusterID),
		KeyKubernetesVersion: c.KubernetesVersion,
		KeyAPIServerEndpoint: c.APIServerEndpoint,
	}
}

// DecodeConfig decodes the ConfigMap's data. Absent keys decode to empty values (the policy is judged
// by whoever enforces it); values that are present must decode.
func DecodeConfig(data map[string]string) (Config, error) {
	c := Config{
		AttestationPolicy: []byte(data[KeyAttestationPolicy]),
		KubernetesVersion: data[KeyKubernetesVersion],
		APIServerEndpoint: data[KeyAPIServerEndpoint],
	}
	var err error
	if c.MeasurementSalt, err = hex.DecodeString(data[KeyMeasurementSalt]); err != nil {
		return Config{}, fmt.Errorf("decoding %s: %w", KeyMeasurementSalt, ErrMalformed)
	}
	if c.ClusterID, err = hex.DecodeString(data[KeyClusterID]); err != nil {
		return Config{}, fmt.Errorf("decoding %s: %w", KeyClusterID, ErrMalformed)
	}
	return c, nil
}

// ClusterSecrets are the roots of every key in the cluster. They are never logged; a Secret is
// their only place in the cluster.
type ClusterSecrets struct {
	MasterSecret []byte
	Salt         []byte
}

// Data encodes s as the Secret's data.
func (s ClusterSecrets) Data() map[string][]byte {
	return map[string][]byte{KeyMasterSecret: s.MasterSecret, KeySalt: s.Salt}
}

// DecodeSecrets decodes the Secret's data. Errors name the key, never the value.
func DecodeSecrets(data map[string][]byte) (ClusterSecrets, error) {
	s := ClusterSecrets{MasterSecret: data[KeyMasterSecret], Salt: data[KeySalt]}
	for _, k := range []struct {
		name  string
		value []byte
	}{{KeyMasterSecret, s.MasterSecret}, {KeySalt, s.Salt}} {
		if len(k.value) == 0 {
			return ClusterSecrets{}, fmt.Errorf("reading %s: %w", k.name, ErrMissingKey)
		}
	}
	return s, nil
}

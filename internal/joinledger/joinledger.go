// Package joinledger is the format of the join ledger: the contract between the joinservice, which
// writes it (joinservice/ledger), and `berth status`, which reads it.
//
// The ledger is ConfigMap berth-join-ledger in Berth's namespace. Its key entries.json holds a JSON
// array of Entry values, oldest first: the newest join attempts of all joinservice replicas, accepted
// and rejected. An empty or missing key means no entries.
package joinledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/joinconfig"
)

// Names.
const (
	// ConfigMapName is the ledger's ConfigMap.
	ConfigMapName = joinconfig.JoinLedgerName
	// DataKey is the ConfigMap key holding the entries as a JSON array.
	DataKey = "entries.json"
)

// Outcomes.
const (
	OutcomeAccepted = "accepted"
	OutcomeRejected = "rejected"
)

// Entry is one join attempt.
type Entry struct {
	Time time.Time `json:"time"`
	// Peer is the address the attempt came from.
	Peer string `json:"peer"`
	// Node is the instance name metadata reports for Peer; empty when unknown.
	Node string `json:"node,omitempty"`
	// Role is the role the node claimed.
	Role string `json:"role,omitempty"`
	// RPC is the method: join or rejoin.
	RPC string `json:"rpc,omitempty"`
	// EvidenceSHA256 is the hex SHA-256 of the peer's attestation document; empty without attestation.
	EvidenceSHA256 string `json:"evidenceSHA256,omitempty"`
	Outcome        string `json:"outcome"`
	// Reason is the rejection's reason code; empty when accepted.
	Reason  string `json:"reason,omitempty"`
	Message string `json:"message,omitempty"`
	// Replica is the joinservice replica (its node) that answered.
	Replica string `json:"replica,omitempty"`
	// Count is how many attempts this entry stands for when above 1 (rate-limited attempts).
	Count int `json:"count,omitempty"`
}

// ErrNoLedger is returned by Read when the cluster has no ledger yet (no join was attempted).
var ErrNoLedger = errors.New("the cluster has no join ledger yet")

// Read returns the ledger's entries, oldest first.
func Read(ctx context.Context, client kubernetes.Interface, namespace string) ([]Entry, error) {
	cm, err := client.CoreV1().ConfigMaps(namespace).Get(ctx, ConfigMapName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, ErrNoLedger
	}
	if err != nil {
		return nil, fmt.Errorf("reading ConfigMap %s/%s: %w", namespace, ConfigMapName, err)
	}
	return Decode(cm.Data[DataKey])
}

// Decode parses the value of DataKey.
func Decode(s string) ([]Entry, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var es []Entry
	if err := json.Unmarshal([]byte(s), &es); err != nil {
		return nil, fmt.Errorf("decoding ledger: %w", err)
	}
	return es, nil
}

// Encode returns the value of DataKey for es.
func Encode(es []Entry) (string, error) {
	data, err := json.Marshal(es)
	if err != nil {
		return "", fmt.Errorf("encoding ledger: %w", err)
	}
	return string(data), nil
}

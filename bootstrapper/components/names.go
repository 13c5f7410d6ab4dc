package components

import "github.com/berth-k8s/berth/internal/joinconfig"

// Transitional names while the restructuring moves their users to internal/joinconfig; this file goes
// once nothing uses them.
const (
	Namespace              = joinconfig.Namespace
	SecretName             = joinconfig.SecretName
	JoinConfigName         = joinconfig.JoinConfigName
	JoinLedgerName         = joinconfig.JoinLedgerName
	JoinServiceName        = joinconfig.JoinServiceName
	JoinServicePort        = joinconfig.JoinPort
	JoinServiceMetricsPort = joinconfig.MetricsPort
	controlPlaneLabel      = "node-role.kubernetes.io/control-plane"
)

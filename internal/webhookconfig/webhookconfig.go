// Package webhookconfig is the contract about the image-policy webhook's objects in the cluster: the
// names every side of it uses. The installer (internal/webhook/install) creates them at init, the
// joinservice's certificate keeper renews the TLS Secret and the configuration's caBundle and keeps the
// Deployment's replicas apart (its Role names the Deployment, internal/berthsystem), berth status and
// berth manifests read them, and an operator pauses the configuration with PausedAnnotation.
//
// The webhook is a component of its own (its own binary, objects and life cycle, and a cluster may run
// without it), so its names stand here rather than among the join contract's in joinconfig. Every
// object is in joinconfig.Namespace except the cluster-scoped configuration and the canary namespace.
package webhookconfig

// Names of the image-policy webhook's objects.
const (
	// Name names the webhook's Deployment, Service, ServiceAccount, PodDisruptionBudget and its pods'
	// app label.
	Name = "berth-webhook"
	// ConfigName is the ValidatingWebhookConfiguration.
	ConfigName = "berth-image-policy"
	// TLSSecret holds the webhook's CA and serving certificate.
	TLSSecret = "berth-webhook-tls"
	// PolicyConfigMap holds the image policy the webhook enforces.
	PolicyConfigMap = "berth-webhook-policy"
	// CanaryNamespace is the namespace the configuration is armed for first, to prove the webhook
	// end to end before it is widened.
	CanaryNamespace = "berth-webhook-canary"
	// HookName is the webhook's name inside the configuration.
	HookName = "image-policy.berth-webhook.berth-system.svc"
	// CertificatesConfigMap holds the operator's settings for the webhook's certificates (its keys
	// and defaults are internal/webhook/install's Settings); without it the defaults apply.
	CertificatesConfigMap = "berth-webhook-certificates"
)

// PausedAnnotation on the configuration (value "true") makes the installer and the certificate keeper
// leave it alone: the operator's break-glass marker.
const PausedAnnotation = "berth.dev/paused"

package joinproto

import "time"

// Bounds of IssueAdminCredentialRequest.validity_seconds: the joinservice refuses a validity outside
// them with reason ReasonBadValidity, and berth kubeconfig refuses one before it sends anything. The
// minimum leaves the operator time to use the credential across a clock skew of seconds; the
// maximum keeps a lost kubeconfig from working longer than a week.
const (
	MinAdminValidity = time.Minute
	MaxAdminValidity = 7 * 24 * time.Hour
)

// Reason codes (google.rpc.ErrorInfo) of IssueAdminCredential's refusals that berth kubeconfig
// branches on.
const (
	// ReasonAdminProofMismatch: the proof is not the cluster's master secret's.
	ReasonAdminProofMismatch = "ADMIN_PROOF_MISMATCH"
	// ReasonAdminChallengeStale: the nonce is not one this replica issued in the last minute, or it
	// was used already; ask AdminChallenge for a new one.
	ReasonAdminChallengeStale = "ADMIN_CHALLENGE_STALE"
	// ReasonBadValidity: validity_seconds is outside MinAdminValidity..MaxAdminValidity.
	ReasonBadValidity = "BAD_VALIDITY"
	// ReasonBadPublicKey: public_key does not parse or is of a type or size the CA does not certify.
	ReasonBadPublicKey = "BAD_PUBLIC_KEY"
)

// Package kmsplugin is Berth's KMS v2 plugin: the API server on every control plane encrypts
// Secrets at rest with data-encryption keys that it has this plugin encrypt under the cluster's
// key-encryption key, derived from the master secret (clusterkeys.KMSKey, one key per generation).
//
// The pieces:
//
//   - Service answers the KMS v2 API (k8s.io/kms): AES-256-GCM under the active generation's key
//     for Encrypt, the key a stored key ID names for Decrypt, and a Status that seals and opens a
//     probe under the active key, so a plugin that cannot decrypt is unhealthy, and the API server's
//     kms-providers health check with it.
//   - Listen and Serve put it on a unix socket (DefaultSocket, owner-only) for the API server.
//   - RunPlugin is the plugin process (`bootstrapper kms-plugin`): it reads key sets from its stdin
//     and reports which key its API server encrypts under on its stdout (pipe.go has the format).
//   - Supervisor runs that process as a child of the bootstrapper, the process that holds the keys,
//     and restarts it when it exits.
//   - EncryptionConfig renders the API server's EncryptionConfiguration for the socket.
//   - Metrics are its Prometheus metrics (berth_kms_*).
//
// The keys live in the memory of the bootstrapper and of the plugin process; the bootstrapper
// persists them only on the node's encrypted state disk (bootstrapper/kmskeeper). A key ID
// ("berth:g<generation>:<fingerprint>", KeyID) is stored in plaintext next to every encrypted
// object; it names the generation and fingerprints the key without revealing it.
package kmsplugin

// Package e2e holds the end-to-end tests of Berth on a real mini cluster (berth mini up): real
// Kubernetes built from source, real containerd, swtpm and the Berth daemons in namespace nodes.
// The tests carry the build tag e2e and need root; run them with `make test-e2e`.
package e2e

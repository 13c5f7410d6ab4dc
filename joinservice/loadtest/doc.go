// Package loadtest holds the join load harness (make bench-join), in its test file; it is skipped
// unless BERTH_BENCH_JOIN=1.
//
// What it measures, honestly: the real joinservice server (package server: rate limiter, policy
// evaluation, metadata lookup, role check, kubelet certificate signed by the cluster CA, bootstrap
// token, join ledger, Prometheus metrics) driven in-process over loopback gRPC by
// concurrent clients, each from its own loopback address (127.0.x.y, a distinct peer). Transport is
// plain gRPC: no attested TLS handshake, no quote. The attestation check evaluates the real cluster
// policy (PCR 4 and the lock PCR 15) against measurements the harness assigns to each client address
// (genuine or tampered) instead of measurements from a verified quote; see internal/atls benchmarks
// for the handshake cost that a real join adds per connection.
//
// Tokens: BENCH_JOIN_TOKENS=apiserver (default) writes each bootstrap token as a Secret into a real
// kube-apiserver + etcd run as processes (joinservice/apiservertest), and the ledger writes its
// ConfigMap and Events there; =fake keeps both in memory (the joinservice's own cost).
//
// CA: BENCH_JOIN_CA=rsa (default; RSA-2048, kubeadm's default encryptionAlgorithm) or ecdsa (P-256,
// kubeadm's ECDSA-P256). The clients' CSRs carry RSA-2048 keys made before the run.
//
// Output, last line: joins/s=<accepted tickets per second> p50_ms=<n> p99_ms=<n> (client-observed
// latency of accepted joins) reject_cost_ratio=<CPU per rejected attempt / CPU per accepted attempt>,
// where CPU is the user+system time of this process and, with the API server, of kube-apiserver and
// etcd, over a phase of only accepted and a phase of only rejected (MEASUREMENT_MISMATCH) attempts.
// The in-process clients' own gRPC cost is in both, so the ratio is an upper bound on the server's.
package loadtest

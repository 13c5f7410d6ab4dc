// Package loadtest holds the join load harness (make bench-join), in its test file; it is skipped
// unless BERTH_BENCH_JOIN=1.
//
// What it measures, honestly: the real joinservice server (package server: rate limiter, policy
// evaluation, metadata lookup, role check, kubelet certificate signed by the cluster CA, join ledger,
// Prometheus metrics) in the test process, driven over loopback gRPC by concurrent clients in a
// child process (TestJoinLoadClients, so that the server's CPU time is measured without theirs),
// each from its own loopback address (127.0.x.y, a distinct peer) and each with an ECDSA P-256
// kubelet key as the bootstrapper makes. Every client is a worker, so, as in production, a ticket needs no bootstrap
// token: the API writes are the ledger's batched ConfigMap updates and rate-limited Events only.
// Transport is plain gRPC: no attested TLS handshake, no quote. The attestation check evaluates the
// real cluster policy (PCR 4 and the lock PCR 15) against measurements the harness assigns to each
// client address (genuine or tampered) instead of measurements from a verified quote; see
// internal/atls benchmarks for the handshake cost that a real join adds per connection.
//
// API: BENCH_JOIN_API=apiserver (default) writes the ledger's ConfigMap and Events into a real
// kube-apiserver + etcd run as processes (joinservice/apiservertest); =fake keeps them in memory (the
// joinservice's own cost).
//
// CA: BENCH_JOIN_CA=ecdsa (default; P-256, what berth init's kubeadm configuration gives the cluster:
// encryptionAlgorithm ECDSA-P256) or rsa (RSA-2048, kubeadm's own default).
//
// Clients: BENCH_JOIN_CLIENTS (default 16), each issuing its next request when the previous one
// returns (closed loop: p50 ≈ clients / rate).
//
// Output: every 30 s of the accepted phase the heap in use (no forced GC), goroutines and resident
// memory of this process and of etcd and kube-apiserver; BENCH_JOIN_CPUPROFILE=FILE writes CPU
// profiles of the server process in the accepted phase (FILE) and the rejected phase
// (FILE.rejected). Last line: joins/s=<accepted tickets per second> p50_ms=<n> p99_ms=<n>
// (client-observed latency of accepted joins) reject_cost_ratio=<CPU per rejected attempt / CPU per
// accepted attempt>, where CPU is the user+system time of the server process and, with the API
// server, of kube-apiserver and etcd, over a phase of only accepted and a phase of only rejected
// (MEASUREMENT_MISMATCH) attempts. The clients' CPU is printed beside it, not counted.
package loadtest

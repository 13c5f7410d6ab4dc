// Package loadtest holds the join load harnesses (make bench-join), in its test files; they are
// skipped unless BERTH_BENCH_JOIN=1.
//
// # Attested (TestJoinLoadAttested, the default of make bench-join)
//
// What runs: the real joinservice binary (built by the test) with --attestation=tpm on its own swtpm
// process, whose lock register is set to the cluster's ID; a real kube-apiserver + etcd as processes
// (internal/apiservertest) holding what berth init installs (berth-system, cluster secrets, the
// join configuration with the cluster policy, RBAC); the binary's own rate limits lifted (--rate-*,
// --attest-rate-*), because the harness measures capacity.
//
// The nodes: a child process (TestJoinLoadAttestedClients) runs BENCH_JOIN_CLIENTS concurrent nodes,
// each from its own loopback address (127.0.x.y, listed in the static metadata as a worker), each
// with BENCH_JOIN_IDENTITIES software TPMs (vtpmtest.SoftTPM: RSA EK certified by a test EK CA that
// the cluster policy trusts, ECDSA AK with a creation certificate, TPM-format quotes over 24 PCRs,
// credential activation in software) used in turn. Every join is what the bootstrapper's JoinClient
// does: a new gRPC connection with a new validator for the join policy (a new node has never seen
// the joinservice), so an identity probe plus a mutual attested TLS handshake in which the joinservice
// activates its TPM key for the node's challenge and quotes, and challenges the node (once per
// identity; it remembers activated keys) and validates its document; then IssueJoinTicket, and the
// node's check that the joinservice's lock register holds the ticket's cluster ID. With
// BENCH_JOIN_SESSION=1 (the default) the join policy also lists the cluster's attestation-key CA
// (akRoots), which certified the joinservice's AK when it started: then a node makes no probe and
// takes the joinservice's session proof (quoted every 10 s), and the joinservice's TPM does nothing
// per join; BENCH_JOIN_SESSION=0 is the activation per join described above.
//
// The joinservice runs with GOMAXPROCS at its DaemonSet's CPU limit (berthsystem.JoinServiceCPUs),
// the cores it has in a cluster, so that the rates measured are the rates it can give there.
//
// Phases: accepted (genuine PCRs, BENCH_JOIN_DURATION), rejected on claims (PCR 4 deviates; the nodes
// claim their PCRs in the ClientHello as vtpm.Issuer does, half the duration), rejected after full
// validation (the same nodes without claims, as a TDX node, half the duration).
//
// Output: per phase the count and rate, and the CPU milliseconds per attempt of the joinservice
// process, of swtpm (the TPM's work) and of kube-apiserver + etcd, with the clients' CPU beside it;
// every 30 s of the accepted phase the joinservice's heap, goroutines and resident memory (from its
// /metrics), swtpm's and the API server's. Last line: joins/s=<accepted tickets per second>
// p50_ms=<n> p99_ms=<n> (client-observed latency of a whole join: probe, handshake, ticket)
// reject_cost_ratio=<server CPU per rejection on claims / server CPU per accepted join>
// server_ms_per_join=<server CPU milliseconds per accepted join>, server meaning joinservice + swtpm +
// API server (each is printed apart above, and the nodes' CPU beside them: the figure does not
// depend on where the nodes run). With BENCH_JOIN_CHART=FILE (make bench-join:
// bin/bench-join.png) both harnesses also draw a PNG chart (internal/loadchart) of their phases one
// after the other: attempts per second, and p50 and p99 latency, by the second they began in.
//
// The clients share the machine's CPUs with the server: on a 2-core machine each accepted join costs
// the clients about 1.3 ms of CPU (software TPM quotes, their own handshakes and first-contact
// validation of the joinservice) against the server's 0.9 ms, which bounds what the harness can drive
// (about 900 joins/s with both cores free of other work).
//
// # In process (TestJoinLoad, BENCH_JOIN_MODE=inprocess)
//
// The real joinservice server code (package server: rate limiter, policy evaluation, metadata lookup,
// role check, kubelet certificate signed by the cluster CA, join ledger, Prometheus metrics) in the
// test process, driven over loopback plain gRPC by clients in a child process (TestJoinLoadClients),
// each from its own loopback address and each with an ECDSA P-256 kubelet key. No handshake, no
// quote: the attestation check evaluates the real cluster policy (PCR 4 and the lock PCR 15) against
// measurements the harness assigns to each client address (genuine or tampered). This is the cost of
// the ticket path alone.
//
// API: BENCH_JOIN_API=apiserver (default) writes the ledger's ConfigMap and Events into a real
// kube-apiserver + etcd; =fake keeps them in memory (the joinservice's own cost). CA:
// BENCH_JOIN_CA=ecdsa (default; P-256, what berth init's kubeadm configuration gives the cluster) or
// rsa (RSA-2048, kubeadm's own default). BENCH_JOIN_CPUPROFILE=FILE writes CPU profiles of the
// accepted (FILE) and rejected (FILE.rejected) phases. Its reject_cost_ratio is CPU per rejected
// attempt / CPU per accepted attempt of the server process and, with the API server, kube-apiserver
// and etcd.
package loadtest

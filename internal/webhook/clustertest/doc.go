// Package clustertest tests the image-policy webhook and its installer against a real kube-apiserver
// and etcd of the default Kubernetes release (internal/k8sversion) run as processes. Everything runs in a private network namespace the test
// binary re-executes itself into, so that webhook "pods" (berth-webhook processes) get documentation
// addresses (198.51.100.0/24) on that namespace's loopback device, which EndpointSlices accept and the
// API server, with --enable-aggregator-routing=true, dials directly. The test plays kubelet and
// endpoint controller for the berth-webhook Deployment: it starts one process per replica, follows
// their /readyz into the EndpointSlice and the Deployment status, and terminates them like a kubelet
// (SIGTERM, endpoint removed a little later).
//
// The package has test files only. The tests skip at once when not run as root or when the binaries
// are not built (scripts/build-k8s.sh k8s etcd); the load test and the benchmark need
// BERTH_WEBHOOK_LOAD=1 (make test-webhook-load, make bench-webhook).
package clustertest

// Package initproto is the Init protocol between `berth init` and a fresh node's InitServer: one
// server-streaming RPC that reports progress and ends with the admin kubeconfig or a named failure.
// The Go code is generated from init.proto by `make generate`.
package initproto

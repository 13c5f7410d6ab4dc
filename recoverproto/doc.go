// Package recoverproto is the Recovery protocol between `berth recover` and a node that cannot open
// its state disk on its own (its sealed key does not unseal and no joinservice answers): the node
// attests, says which disk it waits for, and receives the key derived for that disk only. The Go
// code is generated from recover.proto by `make generate`.
package recoverproto

// DefaultPort is the port the node's recovery server listens on.
const DefaultPort = 9001

// Package joinproto is the Join protocol between a fresh node's JoinClient and the cluster's joinservice:
// IssueJoinTicket and IssueRejoinTicket. The Go code is generated from join.proto by `make generate`.
package joinproto

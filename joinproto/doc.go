// Package joinproto is the Join protocol between a fresh node's JoinClient and the cluster's joinservice:
// IssueJoinTicket, IssueRejoinTicket and CheckIn; and the operator's way back to an admin credential
// (AdminChallenge, IssueAdminCredential, admin.go). The Go code is generated from join.proto by `make generate`.
package joinproto

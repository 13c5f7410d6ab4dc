package joinservice

import (
	"github.com/berth-k8s/berth/joinservice/server"
)

// traceOption makes the server store join traces on Machines. A node reports its trace after it
// joined, with its lock register extended to this cluster's value, so its attestation is judged by
// the check-in's view of the policy in force (server.CheckInPolicy; nil without attestation:
// nothing judged).
func traceOption(store server.TraceStore, checkIn *server.CheckInPolicy) server.Option {
	if checkIn == nil {
		return server.WithTraceStore(store, nil)
	}
	return server.WithTraceStore(store, checkIn.Check)
}

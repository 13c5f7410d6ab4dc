package server

import (
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/machines"
	"github.com/berth-k8s/berth/joinservice/recordwriter"
)

// Admissions learns every accepted join and rejoin of a machine with the evidence it proved
// (recordwriter.Writer). Admit must return at once.
type Admissions interface {
	Admit(recordwriter.Admission)
}

// WithAdmissions makes the server tell adm of every accepted join and rejoin.
func WithAdmissions(adm Admissions) Option { return func(s *Server) { s.admissions = adm } }

// recordAdmission tells the admissions of a's accepted call. The role of a rejoin, which claims
// none, is the one the machine record holds, else a worker's.
func (s *Server) recordAdmission(a *attempt) {
	if s.admissions == nil || a.entry.Identity == "" {
		return
	}
	role := a.entry.Role
	if role == "" && s.record != nil {
		if m, ok, err := s.record.Lookup(a.entry.Identity); err == nil && ok {
			role = m.Role
		}
	}
	if role != machines.RoleControlPlane {
		role = machines.RoleWorker
	}
	adm := recordwriter.Admission{Time: a.start.UTC(), Identity: a.entry.Identity, Node: a.entry.Node, Role: role,
		RPC: a.rpc, Peer: a.entry.Peer}
	if a.evidence != nil {
		adm.Evidence = recordwriter.NewEvidence(a.entry.EvidenceSHA256, a.evidence.Variant, a.evidence.Result.Measurements)
	}
	s.admissions.Admit(adm)
}

// evidenceOf is the verified evidence of a call, or nil.
func evidenceOf(ev *atls.Evidence, verified bool) *atls.Evidence {
	if !verified {
		return nil
	}
	return ev
}

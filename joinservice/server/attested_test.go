package server

import (
	"bytes"
	"context"
	"errors"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/joindial"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ca"
	"github.com/berth-k8s/berth/joinservice/ca/catest"
	"github.com/berth-k8s/berth/joinservice/ledger"
	"github.com/berth-k8s/berth/nodelock"
)

// TestAttestedJoin runs a join over mutual attested TLS between two swtpm-backed parties: the
// joinservice (a bootstrapped control plane) and a joining node.
func TestAttestedJoin(t *testing.T) {
	swCA := vtpmtest.NewSwtpmCA(t) // skips without swtpm
	ctx := context.Background()
	zero := strings.Repeat("00", 32)
	// The CA files exist once the first swtpm was manufactured.
	vtpmtest.StartSwtpm(t, swCA)
	roots := "trustRoots:\n  - pem: |\n" + indent(string(swCA.RootPEM(t))+string(swCA.IssuerPEM(t)), "      ")
	clusterPolicy := mustPolicy(t, "variant: tpm\nmeasurements:\n  4: {expected: "+zero+", source: the image}\n  15: {expected: "+zero+", source: fresh node}\n"+roots)
	joinPolicy := mustPolicy(t, "variant: tpm\nmeasurements:\n  4: {expected: "+zero+", source: the image}\n  15: {nonZero: true, source: bootstrapped}\n"+roots)

	keys, _ := clusterkeys.New(bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32))

	// startWith runs a joinservice whose TPM's lock register holds lockID (nil: not bootstrapped).
	j := &journal{}
	akCA, err := vtpm.ClusterAKCA(keys.AKCASeed(), keys.ClusterID())
	if err != nil {
		t.Fatal(err)
	}
	// With session, the joinservice certifies its AK with the cluster's AK CA and serves a session
	// proof, as the binary does.
	startWith := func(t *testing.T, lockID []byte, srvOpts []Option, session bool, opts ...atls.Option) string {
		sw := vtpmtest.StartSwtpm(t, swCA)
		if lockID != nil {
			if err := vtpm.NewLockRegister(sw.Open, 15).MarkBootstrapped(ctx, lockID); err != nil {
				t.Fatal(err)
			}
		}
		validator, err := NewHandshakeValidator(clusterPolicy, zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		issuer := vtpm.NewIssuer(sw.Open, zap.NewNop())
		if session {
			if err := issuer.CertifyAK(ctx, akCA.Certify); err != nil {
				t.Fatal(err)
			}
			sp := atls.NewSessionProof(issuer, zap.NewNop())
			if err := sp.Renew(ctx); err != nil {
				t.Fatal(err)
			}
			opts = append(opts, atls.WithSessionProof(sp))
		}
		creds, err := atls.NewCredentials(issuer, validator, opts...)
		if err != nil {
			t.Fatal(err)
		}
		pki := catest.WriteControlPlaneDir(t)
		authority, err := ca.Load(pki)
		if err != nil {
			t.Fatal(err)
		}
		srv := New(Config{APIServerEndpoint: "198.51.100.10:6443", PKIDir: pki}, zap.NewNop(), keys, bytes.Repeat([]byte{2}, 32),
			authority, peers{{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}}, PolicyCheck(clusterPolicy), append([]Option{WithJournal(j)}, srvOpts...)...)
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		g := grpc.NewServer(grpc.Creds(RecordHandshakes(creds, j, nil)))
		joinproto.RegisterJoinServiceServer(g, srv)
		done := make(chan struct{})
		go func() { defer close(done); _ = g.Serve(lis) }()
		t.Cleanup(func() { g.Stop(); <-done })
		return lis.Addr().String()
	}
	// start runs the joinservice as the binary does: it judges claimed measurements first.
	start := func(t *testing.T, lockID []byte) string {
		return startWith(t, lockID, nil, false, atls.WithClaimCheck(ClaimCheck(func() *policy.Policy { return clusterPolicy }, j, nil)))
	}

	// dialWith connects to the joinservice at addr as the node whose TPM is sw and whose join policy
	// is p, with opts for its attested TLS.
	dialWith := func(t *testing.T, addr string, sw *vtpmtest.Swtpm, p *policy.Policy, opts ...atls.Option) joinproto.JoinServiceClient {
		validator, err := choose.NewValidator(p, zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		dial, err := joindial.New(vtpm.NewIssuer(sw.Open, zap.NewNop()), validator,
			joindial.LockRegisterCheck(15, vtpm.ExpectedLockValue), opts...)
		if err != nil {
			t.Fatal(err)
		}
		client, closer, err := dial(ctx, addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = closer.Close() })
		return client
	}
	// dialAs connects to the joinservice at addr as the node whose TPM is sw.
	dialAs := func(t *testing.T, addr string, sw *vtpmtest.Swtpm) joinproto.JoinServiceClient {
		return dialWith(t, addr, sw, joinPolicy)
	}
	joinWith := func(t *testing.T, addr string, tamper []byte, manufacturer *vtpmtest.SwtpmCA) (*joinproto.IssueJoinTicketResponse, error) {
		sw := vtpmtest.StartSwtpm(t, manufacturer)
		if tamper != nil {
			if err := vtpm.NewLockRegister(sw.Open, 4).MarkBootstrapped(ctx, tamper); err != nil {
				t.Fatal(err)
			}
		}
		return dialAs(t, addr, sw).IssueJoinTicket(ctx, &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: testDiskUUID})
	}
	// join asks for a ticket as a node whose PCR 4 was extended with tamper (nil: genuine).
	join := func(t *testing.T, addr string, tamper []byte) (*joinproto.IssueJoinTicketResponse, error) {
		return joinWith(t, addr, tamper, swCA)
	}

	t.Run("genuine node joins a bound joinservice", func(t *testing.T) {
		resp, err := join(t, start(t, keys.ClusterID()), nil)
		if err != nil {
			t.Fatalf("IssueJoinTicket() = %v", err)
		}
		if resp.GetNodeName() != "worker-0" {
			t.Fatalf("ticket for %q", resp.GetNodeName())
		}
	})
	t.Run("tampered node is refused on its claims before the joinservice quotes", func(t *testing.T) {
		_, err := join(t, start(t, keys.ClusterID()), []byte("extra boot component"))
		rej, ok := atls.ParseRejection(status.Convert(err).Message())
		if !ok || rej.Reason != ReasonMeasurements || rej.Message != atls.ClaimVerdict || strings.Contains(err.Error(), "index 4") {
			t.Fatalf("IssueJoinTicket() = %v, want the one refusal on claims in the handshake", err)
		}
		t.Logf("refusal: %v", err)
		es := j.all()
		last := es[len(es)-1]
		if last.RPC != "handshake" || last.Reason != ReasonMeasurements || len(last.EvidenceSHA256) != 64 || !strings.Contains(last.Message, "index 4: expected "+zero) || last.Peer != "127.0.0.1" {
			t.Fatalf("ledger entry %+v, want %s in the handshake with the claims' digest", last, ReasonMeasurements)
		}
	})
	t.Run("tampered node is told which measurement deviated after full validation", func(t *testing.T) {
		_, err := join(t, startWith(t, keys.ClusterID(), nil, false), []byte("extra boot component"))
		if status.Code(err) != codes.PermissionDenied || reason(err) != ReasonMeasurements || !strings.Contains(status.Convert(err).Message(), "index 4") {
			t.Fatalf("IssueJoinTicket() = %v (reason %q), want PermissionDenied %s naming index 4", err, reason(err), ReasonMeasurements)
		}
		t.Logf("rejection: %v", err)
		es := j.all()
		last := es[len(es)-1]
		if last.Reason != ReasonMeasurements || len(last.EvidenceSHA256) != 64 || !strings.Contains(last.Message, "index 4") {
			t.Fatalf("ledger entry %+v, want %s with the evidence digest", last, ReasonMeasurements)
		}
	})
	t.Run("node with an unrooted attestation key is refused in the handshake and recorded", func(t *testing.T) {
		otherCA := vtpmtest.NewSwtpmCA(t)
		_, err := joinWith(t, start(t, keys.ClusterID()), nil, otherCA)
		if err == nil {
			t.Fatal("a node whose EK is not rooted in the policy's CAs got a ticket")
		}
		// The server records the refused handshake after the client has seen it fail.
		var last ledger.Entry
		if err := wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
			es := j.all()
			last = es[len(es)-1]
			return last.RPC == "handshake", nil
		}); err != nil {
			t.Fatalf("no handshake entry in the ledger: %+v", j.all())
		}
		if last.Reason != ReasonNotActivated && last.Reason != ReasonUntrustedRoot || last.Peer != "127.0.0.1" {
			t.Fatalf("ledger entry %+v, want a named handshake rejection", last)
		}
		t.Logf("ledger: %s: %s", last.Reason, last.Message)
	})
	t.Run("joinservice locked to another cluster is refused", func(t *testing.T) {
		_, err := join(t, start(t, []byte("some other cluster")), nil)
		if reason(err) != joindial.ReasonNotBound {
			t.Fatalf("IssueJoinTicket() = %v (reason %q), want %s", err, reason(err), joindial.ReasonNotBound)
		}
	})
	t.Run("rejoin: only the machine the disk was bound to gets its key", func(t *testing.T) {
		// Limits lifted: this subtest asks more often a second than a node ever does.
		lifted := atls.Limits{PerPeer: 1000, PerPeerBurst: 1000, Global: 1000, GlobalBurst: 1000, MaxPeers: 10}
		addr := startWith(t, keys.ClusterID(), []Option{WithLimits(lifted)}, false,
			atls.WithClaimCheck(ClaimCheck(func() *policy.Policy { return clusterPolicy }, j, nil)), atls.WithLimiter(atls.NewLimiter(lifted)))
		mine, other := vtpmtest.StartSwtpm(t, swCA), vtpmtest.StartSwtpm(t, swCA)
		ticket, err := dialAs(t, addr, mine).IssueJoinTicket(ctx, &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: testDiskUUID})
		if err != nil {
			t.Fatalf("IssueJoinTicket() = %v", err)
		}
		// Each on a new connection, as after a reboot: probe, mutual attested TLS (key activation the
		// first time), the call. The times are printed, not judged.
		var (
			resp  *joinproto.IssueRejoinTicketResponse
			took  []time.Duration
			begin time.Time
		)
		for range 5 {
			begin = time.Now()
			resp, err = dialAs(t, addr, mine).IssueRejoinTicket(ctx, &joinproto.IssueRejoinTicketRequest{DiskUuid: testDiskUUID, DiskBinding: ticket.GetDiskBinding()})
			if err != nil {
				t.Fatalf("IssueRejoinTicket(own binding) = %v", err)
			}
			took = append(took, time.Since(begin))
		}
		slices.Sort(took)
		t.Logf("rejoin over a new attested connection (swtpm on both sides, 5 runs): min %s, median %s, max %s", took[0], took[2], took[4])
		if !bytes.Equal(resp.GetDiskKey(), ticket.GetDiskKey()) || !bytes.Equal(resp.GetClusterId(), keys.ClusterID()) {
			t.Fatal("the rejoin ticket's disk key or cluster ID differ from the join ticket's")
		}
		// Another TPM at the same address, with the same instance name: only its EK differs.
		_, err = dialAs(t, addr, other).IssueRejoinTicket(ctx, &joinproto.IssueRejoinTicketRequest{DiskUuid: testDiskUUID, DiskBinding: ticket.GetDiskBinding()})
		if status.Code(err) != codes.PermissionDenied || reason(err) != ReasonDiskNotBound {
			t.Fatalf("IssueRejoinTicket(other TPM) = %v (reason %q), want PermissionDenied %s", err, reason(err), ReasonDiskNotBound)
		}
		t.Logf("refusal: %v", err)
		es := j.all()
		if last := es[len(es)-1]; last.RPC != "rejoin" || last.Reason != ReasonDiskNotBound || last.Node != "worker-0" || len(last.EvidenceSHA256) != 64 {
			t.Fatalf("ledger entry %+v, want the refused rejoin of worker-0 with %s and its evidence digest", last, ReasonDiskNotBound)
		}
		_, err = dialAs(t, addr, mine).IssueRejoinTicket(ctx, &joinproto.IssueRejoinTicketRequest{DiskUuid: otherDiskUUID, DiskBinding: ticket.GetDiskBinding()})
		if reason(err) != ReasonDiskNotBound {
			t.Fatalf("IssueRejoinTicket(other disk) = %v, want %s", err, ReasonDiskNotBound)
		}
	})
	t.Run("rejoin: a disk key from a joinservice locked to another cluster is refused", func(t *testing.T) {
		sw := vtpmtest.StartSwtpm(t, swCA)
		addr := start(t, []byte("some other cluster"))
		// The binding is for this machine (the joinservice holds the master secret but its lock
		// register names another cluster): the node refuses the answer.
		ticket, err := dialAs(t, start(t, keys.ClusterID()), sw).IssueJoinTicket(ctx, &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: testDiskUUID})
		if err != nil {
			t.Fatalf("IssueJoinTicket() = %v", err)
		}
		_, err = dialAs(t, addr, sw).IssueRejoinTicket(ctx, &joinproto.IssueRejoinTicketRequest{DiskUuid: testDiskUUID, DiskBinding: ticket.GetDiskBinding()})
		if reason(err) != joindial.ReasonNotBound {
			t.Fatalf("IssueRejoinTicket() = %v (reason %q), want %s", err, reason(err), joindial.ReasonNotBound)
		}
	})
	// The joinservice as the binary runs it, with its AK certified by the cluster's AK CA and a
	// session proof; nodes whose join policy lists the CA in akRoots.
	certifiedJoinPolicy := mustPolicy(t, "variant: tpm\nmeasurements:\n  4: {expected: "+zero+", source: the image}\n  15: {nonZero: true, source: bootstrapped}\n"+roots+
		"akRoots:\n  - pem: |\n"+indent(string(akCA.PEM()), "      "))
	startSession := func(t *testing.T, lockID []byte) string {
		return startWith(t, lockID, nil, true, atls.WithClaimCheck(ClaimCheck(func() *policy.Policy { return clusterPolicy }, j, nil)))
	}
	var verdicts []error // every verdict of the last joinSession on the joinservice
	joinSession := func(t *testing.T, addr string, opts ...atls.Option) (*joinproto.IssueJoinTicketResponse, *atls.Evidence, error) {
		var mu sync.Mutex
		var seen *atls.Evidence
		verdicts = nil
		observe := atls.WithObserver(func(ev atls.Evidence, err error) {
			mu.Lock()
			defer mu.Unlock()
			seen = &ev
			verdicts = append(verdicts, err)
		})
		resp, err := dialWith(t, addr, vtpmtest.StartSwtpm(t, swCA), certifiedJoinPolicy, append(opts, observe)...).IssueJoinTicket(ctx,
			&joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: testDiskUUID})
		mu.Lock()
		defer mu.Unlock()
		return resp, seen, err
	}
	t.Run("session proof: genuine nodes join on the same proof", func(t *testing.T) {
		addr := startSession(t, keys.ClusterID())
		var first time.Time
		for i := range 2 {
			resp, ev, err := joinSession(t, addr)
			if err != nil || resp.GetNodeName() != "worker-0" {
				t.Fatalf("join %d over the session proof: %v", i, err)
			}
			if ev == nil || ev.IssuedAt.IsZero() || i > 0 && !ev.IssuedAt.Equal(first) {
				t.Fatalf("join %d: evidence %+v, want the session proof of the first join", i, ev)
			}
			first = ev.IssuedAt
		}
	})
	t.Run("session proof: refused once stale; the node then asks for a document of its own nonce", func(t *testing.T) {
		// The node's clock runs ahead: the proof is stale for it. It refuses it, and joindial asks
		// again for a document of its own nonce.
		later := func() time.Time { return time.Now().Add(atls.DefaultSessionMaxAge + time.Minute) }
		resp, ev, err := joinSession(t, startSession(t, keys.ClusterID()), atls.WithClock(later))
		if err != nil || resp.GetNodeName() != "worker-0" {
			t.Fatalf("IssueJoinTicket() = %v, want a ticket over the second connection", err)
		}
		if len(verdicts) != 2 || !errors.Is(verdicts[0], atls.ErrStale) || verdicts[1] != nil {
			t.Fatalf("verdicts %v, want ErrStale on the session proof, then acceptance", verdicts)
		}
		if ev == nil || !ev.IssuedAt.IsZero() {
			t.Fatalf("evidence %+v, want a document for this connection's nonce", ev)
		}
	})
	t.Run("session proof: joinservice locked to another cluster is refused", func(t *testing.T) {
		_, _, err := joinSession(t, startSession(t, []byte("some other cluster")))
		if reason(err) != joindial.ReasonNotBound {
			t.Fatalf("IssueJoinTicket() = %v (reason %q), want %s", err, reason(err), joindial.ReasonNotBound)
		}
	})
	t.Run("session proof: joinservice on a fresh node is refused in the handshake", func(t *testing.T) {
		_, _, err := joinSession(t, startSession(t, nil))
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "15") {
			t.Fatalf("IssueJoinTicket() = %v, want a failed handshake naming PCR 15", err)
		}
	})
	t.Run("session proof: a joinservice whose AK the cluster did not certify is refused", func(t *testing.T) {
		_, _, err := joinSession(t, startWith(t, keys.ClusterID(), nil, false))
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "not certified") {
			t.Fatalf("IssueJoinTicket() = %v, want a failed handshake: key not certified", err)
		}
	})
	t.Run("joinservice on a fresh node is refused in the handshake", func(t *testing.T) {
		_, err := join(t, start(t, nil), nil)
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "15") {
			t.Fatalf("IssueJoinTicket() = %v, want a failed handshake naming PCR 15", err)
		}
		t.Logf("refusal: %v", err)
	})
	t.Run("check-in: a node that booted checks in with its lock register extended, and only that", func(t *testing.T) {
		// The joinservice as the binary runs it: claims and the check-in judged by the check-in's
		// policy, join and rejoin by the cluster's.
		checkIn := NewCheckInPolicy(func() *policy.Policy { return clusterPolicy }, keys.ClusterID())
		addr := startWith(t, keys.ClusterID(), []Option{WithCheckInAttestation(checkIn.Check)}, false,
			atls.WithClaimCheck(ClaimCheck(checkIn.Policy, j, nil)))
		// booted is a node whose boot stage extended lock into its lock register (real PCR 15).
		booted := func(t *testing.T, lock []byte) joinproto.JoinServiceClient {
			sw := vtpmtest.StartSwtpm(t, swCA)
			if err := vtpm.NewLockRegister(sw.Open, 15).MarkBootstrapped(ctx, lock); err != nil {
				t.Fatal(err)
			}
			return dialAs(t, addr, sw)
		}
		req := &joinproto.CheckInRequest{DiskUuid: testDiskUUID, ClusterId: keys.ClusterID()}
		for name, lock := range map[string][]byte{"worker": keys.ClusterID(), "control plane": nodelock.ControlPlaneLockID(keys.ClusterID())} {
			resp, err := booted(t, lock).CheckIn(ctx, req)
			if err != nil || resp.GetNodeName() != "worker-0" {
				t.Fatalf("check-in of a booted %s of this cluster = %v, %v; want admitted", name, resp, err)
			}
		}
		// A node locked to another cluster: refused on its claims, before the joinservice quotes.
		_, err := booted(t, []byte("some other cluster")).CheckIn(ctx, req)
		if rej, ok := atls.ParseRejection(status.Convert(err).Message()); !ok || rej.Reason != ReasonMeasurements {
			t.Fatalf("check-in of a node locked to another cluster = %v; want refused %s", err, ReasonMeasurements)
		}
		// A booted node gets no ticket: its claims pass (the handshake cannot know the RPC), its
		// verified evidence is refused by the join's policy.
		c := booted(t, keys.ClusterID())
		_, err = c.IssueJoinTicket(ctx, &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: testDiskUUID})
		if status.Code(err) != codes.PermissionDenied || reason(err) != ReasonMeasurements || !strings.Contains(status.Convert(err).Message(), "index 15") {
			t.Fatalf("join of a booted node = %v (reason %q); want PermissionDenied %s naming index 15", err, reason(err), ReasonMeasurements)
		}
		_, err = c.IssueRejoinTicket(ctx, &joinproto.IssueRejoinTicketRequest{DiskUuid: testDiskUUID, DiskBinding: []byte("any")})
		if status.Code(err) != codes.PermissionDenied || reason(err) != ReasonMeasurements {
			t.Fatalf("rejoin of a booted node = %v (reason %q); want PermissionDenied %s", err, reason(err), ReasonMeasurements)
		}
	})
}

func mustPolicy(t *testing.T, doc string) *policy.Policy {
	t.Helper()
	p, err := policy.Parse([]byte(doc), "test policy", nil)
	if err != nil {
		t.Fatalf("%v\n%s", err, doc)
	}
	return p
}

func indent(s, prefix string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	for i := range lines {
		lines[i] = prefix + lines[i]
	}
	return strings.Join(lines, "\n") + "\n"
}

package attack

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/joinproto"
)

// Disk UUIDs of the suite's nodes.
const (
	diskA = "0f8b9c2e-5d1a-4b7e-9a3c-2e6f1d4b8a70"
	diskB = "7c1e4a9b-2f3d-4e8a-b6c5-9d0e1f2a3b4c"
	// diskC is the victim's disk in "another machine's disk UUID on the join RPC".
	diskC = "5e2d8f1a-3b4c-4d6e-8f0a-1b2c3d4e5f60"
)

// replaying answers every handshake after its first with the document of its first.
type replaying struct {
	*vtpmtest.SoftTPM
	mu  sync.Mutex
	doc []byte
}

func (r *replaying) Issue(ctx context.Context, userData, nonce []byte) ([]byte, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.doc != nil {
		return r.doc, nil
	}
	doc, err := r.SoftTPM.Issue(ctx, userData, nonce)
	r.doc = doc
	return doc, err
}

// transplanting makes a fresh, genuine document for this handshake's nonce, but bound to another TLS
// key than the one its certificate holds: evidence moved from one connection into another.
type transplanting struct{ *vtpmtest.SoftTPM }

func (x transplanting) Issue(ctx context.Context, _, nonce []byte) ([]byte, error) {
	other := sha256.Sum256([]byte("the TLS key of another connection"))
	return x.SoftTPM.Issue(ctx, other[:], nonce)
}

// garbage presents size random bytes as its document.
type garbage struct {
	*vtpmtest.SoftTPM
	size int
}

func (g garbage) Issue(context.Context, []byte, []byte) ([]byte, error) {
	b := make([]byte, g.size)
	_, _ = rand.Read(b)
	return b, nil
}

// claiming is a peer without a TPM that claims what it likes.
type claiming struct{ claims attestation.Measurements }

func (claiming) Variant() string { return "tpm" }
func (claiming) Issue(context.Context, []byte, []byte) ([]byte, error) {
	return nil, errors.New("no TPM")
}
func (c claiming) Claims(context.Context) (attestation.Measurements, error) { return c.claims, nil }

// lying quotes a tampered image but claims the genuine one's PCRs.
type lying struct{ *vtpmtest.SoftTPM }

func (lying) Claims(context.Context) (attestation.Measurements, error) { return genuinePCRs(), nil }

// TestJoinServiceUnderAttack attacks one joinservice in turn with every attack of the package's table;
// after each, a genuine node still joins.
func TestJoinServiceUnderAttack(t *testing.T) {
	c := startJoinCluster(t)
	ctx := context.Background()
	next := 0
	// ip hands out the next worker address: every attack comes from a known instance, so that the
	// refusal is the attack's, and the per-peer limits of one attack do not touch the next.
	ip := func() string { next++; return workerIP(next) }
	genuineJoin := func(t *testing.T) {
		t.Helper()
		addr := ip()
		resp, err := c.join(t, addr, softTPM(t, c.nodeCA, genuinePCRs()), workerRequest(t, diskA))
		if err != nil {
			t.Fatalf("a genuine node at %s was refused: %v", addr, err)
		}
		if want := "worker-" + addr[len("127.0.1."):]; resp.GetNodeName() != want {
			t.Fatalf("genuine ticket for %q, want %q", resp.GetNodeName(), want)
		}
	}
	genuineJoin(t)

	t.Run("replayed evidence", func(t *testing.T) {
		// Evidence is fresh per connection: the document binds the nonce the joinservice chose for
		// this handshake, so yesterday's document proves nothing today.
		addr := ip()
		r := &replaying{SoftTPM: softTPM(t, c.nodeCA, genuinePCRs())}
		if _, err := c.join(t, addr, r, workerRequest(t, diskA)); err != nil {
			t.Fatalf("the join that recorded the document: %v", err)
		}
		if _, err := c.join(t, addr, r, workerRequest(t, diskA)); err == nil {
			t.Fatal("a node replaying its evidence got a ticket")
		}
		c.waitLedger(t, "the replay as NONCE_MISMATCH", ledgerRefusal(addr, "NONCE_MISMATCH"))
		genuineJoin(t)
	})
	t.Run("transplanted evidence", func(t *testing.T) {
		// The document must bind the key this TLS connection proved: evidence relayed from a genuine
		// machine into an attacker's connection binds the wrong key.
		addr := ip()
		if _, err := c.join(t, addr, transplanting{softTPM(t, c.nodeCA, genuinePCRs())}, workerRequest(t, diskA)); err == nil {
			t.Fatal("transplanted evidence got a ticket")
		}
		c.waitLedger(t, "the transplant as KEY_BINDING", ledgerRefusal(addr, "KEY_BINDING"))
		genuineJoin(t)
	})
	t.Run("EK from an untrusted manufacturer", func(t *testing.T) {
		// Only an EK certificate from a CA the policy trusts says the key lives in a real TPM; a
		// software key with a self-made certificate could quote anything.
		addr := ip()
		other, err := vtpmtest.NewCA("untrusted EK CA")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.join(t, addr, softTPM(t, other, genuinePCRs()), workerRequest(t, diskA)); err == nil {
			t.Fatal("a node with an untrusted EK got a ticket")
		}
		c.waitLedger(t, "the untrusted EK as UNTRUSTED_ROOT", ledgerRefusal(addr, "UNTRUSTED_ROOT"))
		genuineJoin(t)
	})
	t.Run("garbage document", func(t *testing.T) {
		// Bytes that do not parse prove nothing; the parser must refuse them by name and stay up.
		addr := ip()
		if _, err := c.join(t, addr, garbage{softTPM(t, c.nodeCA, genuinePCRs()), 4096}, workerRequest(t, diskA)); err == nil {
			t.Fatal("a garbage document got a ticket")
		}
		c.waitLedger(t, "the garbage as MALFORMED_EVIDENCE", ledgerRefusal(addr, "MALFORMED_EVIDENCE"))
		genuineJoin(t)
	})
	t.Run("oversized document", func(t *testing.T) {
		// A document far beyond any real one is refused before it is parsed (the TLS layer bounds a
		// handshake message to 64 KiB), and the joinservice keeps serving.
		if _, err := c.join(t, ip(), garbage{softTPM(t, c.nodeCA, genuinePCRs()), 300 << 10}, workerRequest(t, diskA)); err == nil {
			t.Fatal("a 300 KB document got a ticket")
		}
		if err := c.ready(ctx); err != nil {
			t.Fatalf("the joinservice is not ready after an oversized document: %v", err)
		}
		genuineJoin(t)
	})
	t.Run("claims that lie", func(t *testing.T) {
		// Claims are unauthenticated and can only refuse: a node that claims the genuine image but
		// quotes another is judged on its verified quote.
		addr := ip()
		_, err := c.join(t, addr, lying{softTPM(t, c.nodeCA, tamperedPCRs())}, workerRequest(t, diskA))
		if err == nil || reasonOf(err) != "MEASUREMENT_MISMATCH" {
			t.Fatalf("a node with lying claims: %v, want MEASUREMENT_MISMATCH after validation", err)
		}
		e := c.waitLedger(t, "the lie as MEASUREMENT_MISMATCH on the verified quote", func(e joinledger.Entry) bool {
			return ledgerRefusal(addr, "MEASUREMENT_MISMATCH")(e) && e.RPC == "join"
		})
		if e.EvidenceSHA256 == "" {
			t.Error("the refusal on the verified quote carries no evidence digest")
		}
		genuineJoin(t)
	})
	t.Run("forged CSR", func(t *testing.T) {
		// The kubelet certificate names the instance metadata reports for the attested address and
		// nothing the CSR asks for: a node cannot speak for another or for an administrator.
		addr := ip()
		req := workerRequest(t, diskA)
		req.KubeletCsr = newCSR(t, pkix.Name{CommonName: "system:node:cp-1", Organization: []string{"system:masters"}}, "kubernetes.default")
		resp, err := c.join(t, addr, softTPM(t, c.nodeCA, genuinePCRs()), req)
		if err != nil {
			t.Fatal(err)
		}
		block, _ := pem.Decode(resp.GetKubeletCert())
		if block == nil {
			t.Fatal("the ticket's certificate is not PEM")
		}
		cert, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		want := "system:node:worker-" + addr[len("127.0.1."):]
		if cert.Subject.CommonName != want || !slices.Equal(cert.Subject.Organization, []string{"system:nodes"}) ||
			len(cert.DNSNames) != 0 || len(cert.IPAddresses) != 1 || !cert.IPAddresses[0].Equal(net.ParseIP(addr)) {
			t.Fatalf("certificate for a forged CSR: %v, DNS %v, IP %v; want %s in system:nodes for %s only",
				cert.Subject, cert.DNSNames, cert.IPAddresses, want, addr)
		}
		// A CSR that does not parse: nothing to certify. (Its signature is not checked: the
		// certificate says only what was attested, and the kubelet proves its key to the API server.)
		req = workerRequest(t, diskA)
		req.KubeletCsr = []byte("not a certificate request")
		if _, err := c.join(t, ip(), softTPM(t, c.nodeCA, genuinePCRs()), req); reasonOf(err) != "BAD_CSR" {
			t.Fatalf("a CSR that does not parse: %v, want BAD_CSR", err)
		}
	})
	t.Run("no attestation", func(t *testing.T) {
		// A ticket is bound to an attested machine: without attestation there is nothing to bind it to.
		addr := ip()
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(addr)}}
		plain, err := grpc.NewClient("passthrough:///"+c.addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) { return d.DialContext(ctx, "tcp", a) }))
		if err != nil {
			t.Fatal(err)
		}
		defer plain.Close()
		callCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if _, err := joinproto.NewJoinServiceClient(plain).IssueJoinTicket(callCtx, workerRequest(t, diskA)); err == nil {
			t.Fatal("a plaintext call got a ticket")
		}
		// Plain TLS with a certificate that carries no attestation.
		conn, err := tls.DialWithDialer(&d, "tcp", c.addr, &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS13, //nolint:gosec // the attacker trusts anything
			NextProtos: []string{"h2"}, ServerName: "joinservice"})
		if err == nil {
			conn.Close()
			t.Fatal("a TLS handshake without attestation succeeded")
		}
		genuineJoin(t)
	})
	t.Run("attested TLS without a client certificate", func(t *testing.T) {
		// The joinservice serves a client that attests nothing (berth kubeconfig on an operator's
		// machine), but no join RPC answers it, and an admin credential takes the master secret's proof.
		addr := ip()
		client := joinproto.NewJoinServiceClient(c.conn(t, addr, nil))
		callCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		if _, err := client.IssueJoinTicket(callCtx, workerRequest(t, diskA)); reasonOf(err) != "NO_EVIDENCE" {
			t.Fatalf("a join without attestation: %v, want NO_EVIDENCE", err)
		}
		if _, err := client.IssueRejoinTicket(callCtx, &joinproto.IssueRejoinTicketRequest{DiskUuid: diskA}); reasonOf(err) != "NO_EVIDENCE" {
			t.Fatalf("a rejoin without attestation: %v, want NO_EVIDENCE", err)
		}
		if _, err := client.CheckIn(callCtx, &joinproto.CheckInRequest{DiskUuid: diskA, ClusterId: apiservertest.ClusterID()}); reasonOf(err) != "NO_EVIDENCE" {
			t.Fatalf("a check-in without attestation: %v, want NO_EVIDENCE", err)
		}
		wrong, err := clusterkeys.New(make([]byte, clusterkeys.MasterSecretSize), make([]byte, clusterkeys.SaltSize))
		if err != nil {
			t.Fatal(err)
		}
		// Another address: each address has a budget of its own of a few calls.
		admin := ip()
		client = joinproto.NewJoinServiceClient(c.conn(t, admin, nil))
		pub := adminPublicKey(t)
		for _, k := range []*clusterkeys.Keys{wrong, apiservertest.ClusterKeys()} {
			ch, err := client.AdminChallenge(callCtx, &joinproto.AdminChallengeRequest{})
			if err != nil {
				t.Fatal(err)
			}
			resp, err := client.IssueAdminCredential(callCtx, &joinproto.IssueAdminCredentialRequest{Nonce: ch.GetNonce(), PublicKey: pub,
				ValiditySeconds: 60, Proof: k.AdminProof(ch.GetNonce(), pub, 60)})
			if k == wrong {
				if reasonOf(err) != joinproto.ReasonAdminProofMismatch {
					t.Fatalf("an admin credential with another master secret: %v, want %s", err, joinproto.ReasonAdminProofMismatch)
				}
				continue
			}
			if err != nil || len(resp.GetCertificate()) == 0 {
				t.Fatalf("an admin credential with the master secret: %v", err)
			}
		}
		c.waitLedger(t, joinproto.ReasonAdminProofMismatch, ledgerRefusal(admin, joinproto.ReasonAdminProofMismatch))
		genuineJoin(t)
	})
	t.Run("another node's role", func(t *testing.T) {
		// The role comes from metadata: a worker cannot ask for the control plane's shared keys.
		addr := ip()
		req := workerRequest(t, diskA)
		req.Role = joinproto.Role_ROLE_CONTROL_PLANE
		_, err := c.join(t, addr, softTPM(t, c.nodeCA, genuinePCRs()), req)
		if reasonOf(err) != "ROLE_MISMATCH" {
			t.Fatalf("a worker asking to join as a control plane: %v, want ROLE_MISMATCH", err)
		}
		c.waitLedger(t, "ROLE_MISMATCH", ledgerRefusal(addr, "ROLE_MISMATCH"))
	})
	t.Run("an address metadata does not know", func(t *testing.T) {
		// A genuine machine that is no instance of the cluster gets nothing: the identity comes from
		// metadata.
		_, err := c.join(t, unknownIP, softTPM(t, c.nodeCA, genuinePCRs()), workerRequest(t, diskA))
		if reasonOf(err) != "UNKNOWN_PEER" {
			t.Fatalf("a genuine node at an unknown address: %v, want UNKNOWN_PEER", err)
		}
	})
	t.Run("another node's disk key", func(t *testing.T) {
		// A disk key goes only to the machine its disk is bound to: an attested member that names
		// another node's disk, with that node's binding or a made-up one, gets DISK_NOT_BOUND.
		owner, thief := ip(), ip()
		ownerTPM, thiefTPM := softTPM(t, c.nodeCA, genuinePCRs()), softTPM(t, c.nodeCA, genuinePCRs())
		ticket, err := c.join(t, owner, ownerTPM, workerRequest(t, diskA))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.join(t, thief, thiefTPM, workerRequest(t, diskB)); err != nil {
			t.Fatal(err)
		}
		rejoin := func(addr string, tpm *vtpmtest.SoftTPM, disk string, binding []byte) (*joinproto.IssueRejoinTicketResponse, error) {
			callCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			return joinproto.NewJoinServiceClient(c.conn(t, addr, tpm)).IssueRejoinTicket(callCtx,
				&joinproto.IssueRejoinTicketRequest{DiskUuid: disk, DiskBinding: binding})
		}
		for name, binding := range map[string][]byte{"the owner's binding": ticket.GetDiskBinding(), "a made-up binding": make([]byte, 32)} {
			resp, err := rejoin(thief, thiefTPM, diskA, binding)
			if reasonOf(err) != "DISK_NOT_BOUND" || resp.GetDiskKey() != nil {
				t.Fatalf("another member asking for the owner's disk key with %s: %v, want DISK_NOT_BOUND", name, err)
			}
		}
		c.waitLedger(t, "the theft as DISK_NOT_BOUND", ledgerRefusal(thief, "DISK_NOT_BOUND"))
		// The owner itself gets its key (the check can pass).
		resp, err := rejoin(owner, ownerTPM, diskA, ticket.GetDiskBinding())
		if err != nil || string(resp.GetDiskKey()) != string(ticket.GetDiskKey()) {
			t.Fatalf("the owner's rejoin: %v", err)
		}
	})
	t.Run("another machine's disk UUID on the join RPC", func(t *testing.T) {
		// Disk UUIDs are public (the LUKS header, the recovery server's Info). The victim's disk is
		// bound to it; a fresh TPM at another worker's address that names that UUID on the join RPC
		// must not get the victim's disk key, nor a binding that gets it on the rejoin RPC later. The
		// same holds for the disk of the control plane that initialized the cluster: it was keyed by
		// the same derivation (BindWithKeys), and before disk keys named the machine, that key was
		// the legacy per-UUID key the join RPC handed to anyone.
		owner, thief := ip(), ip()
		ownerTPM, thiefTPM := softTPM(t, c.nodeCA, genuinePCRs()), softTPM(t, c.nodeCA, genuinePCRs())
		ownerTicket, err := c.join(t, owner, ownerTPM, workerRequest(t, diskC))
		if err != nil {
			t.Fatalf("the victim's join: %v", err)
		}
		stolen, err := c.join(t, thief, thiefTPM, workerRequest(t, diskC))
		if err == nil && string(stolen.GetDiskKey()) == string(ownerTicket.GetDiskKey()) {
			t.Fatalf("a fresh TPM at %s naming the disk %s of %s got its disk key", thief, diskC, owner)
		}
		if err == nil && string(stolen.GetDiskKey()) == string(apiservertest.ClusterKeys().LegacyDiskKey(diskC)) {
			t.Fatalf("a fresh TPM at %s naming disk %s got the disk's per-UUID key", thief, diskC)
		}
		got := "no ticket (" + reasonOf(err) + ")"
		if err == nil {
			got = "a ticket whose disk key differs from the victim's"
			callCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			resp, err := joinproto.NewJoinServiceClient(c.conn(t, thief, thiefTPM)).IssueRejoinTicket(callCtx,
				&joinproto.IssueRejoinTicketRequest{DiskUuid: diskC, DiskBinding: stolen.GetDiskBinding()})
			if err == nil && string(resp.GetDiskKey()) == string(ownerTicket.GetDiskKey()) {
				t.Fatal("the binding from that ticket gets the victim's disk key on the rejoin RPC")
			}
			got += "; its binding on the rejoin RPC: " + map[bool]string{true: "its own useless key again", false: "refused (" + reasonOf(err) + ")"}[err == nil]
		}
		e := c.waitLedger(t, "the join naming "+diskC, func(e joinledger.Entry) bool { return e.Peer == thief && e.RPC == "join" && e.DiskUUID == diskC })
		t.Logf("a fresh TPM at %s naming the disk %s of %s on the join RPC got %s; the ledger records it: %s %s disk %s, identity %s",
			thief, diskC, owner, got, e.RPC, e.Outcome, e.DiskUUID, e.Identity)
	})
	t.Run("a thousand idle connections", func(t *testing.T) {
		// Connections that never speak must not hold the joinservice's handshakes: a genuine node
		// joins while a thousand of them are open.
		var idle []net.Conn
		defer func() {
			for _, conn := range idle {
				conn.Close()
			}
		}()
		for i := range 1000 {
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 5, byte(1+i%250))}}
			conn, err := d.DialContext(ctx, "tcp", c.addr)
			if err != nil {
				t.Fatalf("idle connection %d: %v", i, err)
			}
			idle = append(idle, conn)
		}
		genuineJoin(t)
	})
	t.Run("claims that probe the policy", func(t *testing.T) {
		// Claims are judged as a whole and the verdict names nothing: a node claiming one random
		// value at one index, at every index, or the genuine values with an enforced index left out,
		// gets the same answer, so it cannot learn which indices the policy enforces.
		addr := ip()
		random := func() []byte {
			b := make([]byte, 32)
			_, _ = rand.Read(b)
			return b
		}
		genuineWithout := func(i uint32) attestation.Measurements {
			m := attestation.Measurements(genuinePCRs())
			delete(m, i)
			return m
		}
		cases := map[string]attestation.Measurements{
			"a random PCR 0 (not judged)": {0: random()},
			"a random PCR 4 (enforced)":   {4: random()},
			"a random PCR 15 (enforced)":  {15: random()},
			"the genuine PCRs but 4":      genuineWithout(4),
			"the genuine PCRs but 9":      genuineWithout(9),
		}
		every := attestation.Measurements{}
		for i := range uint32(24) {
			every[i] = random()
		}
		cases["a random value at every index"] = every
		var first *atls.Rejection
		for name, claims := range cases {
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(addr)}}
			conn, err := d.DialContext(ctx, "tcp", c.addr)
			if err != nil {
				t.Fatal(err)
			}
			_, err = atls.ProbeIdentity(ctx, conn, claiming{claims})
			var r *atls.Rejection
			if name == "the genuine PCRs but 9" {
				// Index 9 is not enforced: these claims are complete and genuine.
				if err != nil {
					t.Fatalf("%s: %v, want the joinservice's identity", name, err)
				}
				continue
			}
			if !errors.As(err, &r) {
				t.Fatalf("%s: %v, want a refusal on claims", name, err)
			}
			if first == nil {
				first = r
			}
			if *r != *first {
				t.Fatalf("%s: verdict %+v differs from %+v: the verdict tells what the policy judges", name, *r, *first)
			}
		}
		if strings.ContainsAny(first.Message, "0123456789") {
			t.Fatalf("the verdict %q names an index", first.Message)
		}
		t.Logf("every probing claim got: %v", first)
	})
	t.Run("ten nodes behind one address", func(t *testing.T) {
		// A probe and the handshake it precedes are one attempt: nodes that share an address (a NAT,
		// a load balancer) and activate the joinservice's key (a probe, then the handshake) pay one
		// token of the address's budget per attempt. Were the probe and the handshake charged apart,
		// the neighbours' probes would take the tokens that the handshakes after answered probes
		// need, and nodes behind a busy address would retry forever.
		validator, err := choose.NewValidator(c.activating, zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		// First the rule itself: a node's probe is answered, then its neighbours' probes spend every
		// token the address has left; the node's handshake still goes through, on its probe's credit.
		addr := ip()
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(addr)}}
		probe := func(issuer atls.Issuer) ([]byte, error) {
			conn, err := d.DialContext(ctx, "tcp", c.addr)
			if err != nil {
				t.Fatal(err)
			}
			return atls.ProbeIdentity(ctx, conn, issuer)
		}
		node := softTPM(t, c.nodeCA, genuinePCRs())
		id, err := probe(node)
		if err != nil {
			t.Fatalf("the node's probe: %v", err)
		}
		neighbours := 0
		for ; ; neighbours++ {
			if _, err := probe(nil); errors.Is(err, atls.ErrRateLimited) {
				break
			} else if err != nil {
				t.Fatalf("a neighbour's probe: %v", err)
			}
			if neighbours > 100 {
				t.Fatal("the address's probes are never limited")
			}
		}
		cfg, err := atls.NewClientConfig(ctx, node, validator, atls.WithPeerIdentity(id))
		if err != nil {
			t.Fatal(err)
		}
		raw, err := d.DialContext(ctx, "tcp", c.addr)
		if err != nil {
			t.Fatal(err)
		}
		hsCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		conn := tls.Client(raw, cfg)
		err = conn.HandshakeContext(hsCtx)
		_ = conn.Close()
		if err != nil {
			t.Fatalf("the handshake of an answered probe, after %d neighbours' probes spent the address's tokens: %v", neighbours, err)
		}

		// Then ten genuine nodes behind another address join at once, retrying as the JoinClient
		// does while no joinservice rejects it (a jittered wait under half a second).
		addr = ip()
		tpms := make([]*vtpmtest.SoftTPM, 10)
		reqs := make([]*joinproto.IssueJoinTicketRequest, len(tpms))
		for i := range tpms {
			tpms[i], reqs[i] = softTPM(t, c.nodeCA, genuinePCRs()), workerRequest(t, diskA)
		}
		joinCtx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		var wg sync.WaitGroup
		errs, attempts := make([]error, len(tpms)), make([]int, len(tpms))
		for i := range tpms {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var last error
				retry := wait.DelayFunc(func() time.Duration { return wait.Jitter(250*time.Millisecond, 1) })
				err := retry.Until(joinCtx, true, false, func(ctx context.Context) (bool, error) {
					attempts[i]++
					conn, err := c.dial(addr, tpms[i], c.activating)
					if err != nil {
						return false, err
					}
					defer conn.Close()
					callCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
					defer cancel()
					_, last = joinproto.NewJoinServiceClient(conn).IssueJoinTicket(callCtx, reqs[i])
					return last == nil, nil
				})
				if err != nil {
					errs[i] = fmt.Errorf("%w; the last attempt: %w", err, last)
				}
			}()
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Errorf("node %d behind the shared address never joined in %d attempts: %v", i, attempts[i], err)
			}
		}
		t.Logf("after %d neighbours' probes, the answered probe's handshake went through; ten nodes behind %s joined in %v attempts",
			neighbours, addr, attempts)
	})
	t.Run("malformed policy update", func(t *testing.T) {
		// A policy update that does not parse is refused with an Event; the policy in force stays, so
		// nobody can switch attestation off by breaking the ConfigMap.
		cms := c.admin.CoreV1().ConfigMaps(joinconfig.Namespace)
		cm, err := cms.Get(ctx, joinconfig.JoinConfigName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cm.Data[joinconfig.KeyAttestationPolicy] = "variant: [tpm\nmeasurements: {4: {expected: nothex}}\n"
		if _, err := cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
			evs, err := c.admin.CoreV1().Events(joinconfig.Namespace).List(ctx, metav1.ListOptions{FieldSelector: "reason=PolicyRejected"})
			return err == nil && len(evs.Items) > 0, nil
		}); err != nil {
			t.Fatalf("no PolicyRejected Event for a malformed policy: %v", err)
		}
		genuineJoin(t)
		if _, err := c.join(t, ip(), softTPM(t, c.nodeCA, tamperedPCRs()), workerRequest(t, diskA)); err == nil {
			t.Fatal("a tampered node joined after a malformed policy update")
		}
	})
}

// adminPublicKey is the DER public key of a fresh P-256 key, as berth kubeconfig sends it.
func adminPublicKey(t *testing.T) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		t.Fatal(err)
	}
	return der
}

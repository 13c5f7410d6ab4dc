package main

import (
	"context"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joindial"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/proctest"
	"github.com/berth-k8s/berth/internal/records"
	recordsclient "github.com/berth-k8s/berth/internal/records/clientset"
	recordsv1alpha1 "github.com/berth-k8s/berth/internal/records/v1alpha1"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ledger"
)

func indent(s, prefix string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	for i := range lines {
		lines[i] = prefix + lines[i]
	}
	return strings.Join(lines, "\n") + "\n"
}

// TestAttestedBinaryPolicyHotReload runs the real joinservice binary with swtpm attestation against
// a real API server: a genuine node joins; a node replaying its evidence and a node whose EK comes
// from an untrusted manufacturer are refused in the handshake; an update of the cluster policy in ConfigMap
// berth-join-config takes effect without a restart (the same node is now refused, naming PCR 4); a
// malformed update is refused with a PolicyRejected Event and the policy in force stays; the ledger
// holds every attempt with the digest of the node's evidence. Its metrics show the TPM work each
// join cost: a node whose join policy lists no attestation-key CA gets an activation and a quote of
// its own; one whose policy lists the cluster's CA takes the session proof, and its join costs the
// joinservice's TPM nothing.
func TestAttestedBinaryPolicyHotReload(t *testing.T) {
	swCA := vtpmtest.NewSwtpmCA(t) // skips without swtpm
	env := apiservertest.Shared(t) // skips without kube-apiserver and etcd
	ctx := context.Background()
	started := time.Now().Add(-time.Second)

	serviceTPM := vtpmtest.StartSwtpm(t, swCA) // the CA's files exist from here on
	if err := vtpm.NewLockRegister(serviceTPM.Open, 15).MarkBootstrapped(ctx, apiservertest.ClusterID()); err != nil {
		t.Fatal(err)
	}
	nodeTPM := vtpmtest.StartSwtpm(t, swCA)

	zero, ones := strings.Repeat("00", 32), strings.Repeat("11", 32)
	roots := "trustRoots:\n  - pem: |\n" + indent(string(swCA.RootPEM(t))+string(swCA.IssuerPEM(t)), "      ")
	clusterPolicy := func(pcr4 string) string {
		return "variant: tpm\nmeasurements:\n  4: {expected: " + pcr4 + ", source: the image}\n  15: {expected: " + zero + ", source: fresh node}\n" + roots
	}
	if err := env.InstallBerth(ctx, clusterPolicy(zero)); err != nil {
		t.Fatal(err)
	}
	imagePolicy := "variant: tpm\nmeasurements:\n  4: {expected: " + zero + ", source: the image}\n  15: {nonZero: true, source: bootstrapped}\n" + roots
	joinPolicy, err := policy.Parse([]byte(imagePolicy), "join policy", nil)
	if err != nil {
		t.Fatal(err)
	}
	keys := apiservertest.ClusterKeys()
	akCA, err := vtpm.ClusterAKCA(keys.AKCASeed(), keys.ClusterID())
	if err != nil {
		t.Fatal(err)
	}
	clusterJoinPolicy, err := policy.Parse([]byte(imagePolicy+"akRoots:\n  - pem: |\n"+indent(string(akCA.PEM()), "      ")), "cluster join policy", nil)
	if err != nil {
		t.Fatal(err)
	}

	metricsAddr := proctest.FreeAddr(t)
	js, addr := startJoinService(t, env, "self: {name: cp-0, role: control-plane, ips: [198.51.100.10]}\npeers:\n  - {name: worker-9, role: worker, ips: [127.0.0.1]}\n",
		nil, "--attestation=tpm", "--tpm="+serviceTPM.Spec, "--metrics-listen="+metricsAddr,
		// One node address makes every attempt here: room for them in its bursts.
		"--attest-rate-per-peer-burst=32", "--rate-per-peer-burst=16")

	joinWith := func(p *policy.Policy, issuer atls.Issuer) (*joinproto.IssueJoinTicketResponse, error) {
		validator, err := choose.NewValidator(p, zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		dial, err := joindial.New(issuer, validator, joindial.LockRegisterCheck(15, vtpm.ExpectedLockValue))
		if err != nil {
			t.Fatal(err)
		}
		client, closer, err := dial(ctx, addr)
		if err != nil {
			return nil, err
		}
		defer closer.Close()
		return client.IssueJoinTicket(ctx, &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t), Role: joinproto.Role_ROLE_WORKER, DiskUuid: "0f8b9c2e-5d1a-4b7e-9a3c-2e6f1d4b8a70"})
	}
	joinAs := func(issuer atls.Issuer) (*joinproto.IssueJoinTicketResponse, error) {
		return joinWith(joinPolicy, issuer)
	}
	join := func() (*joinproto.IssueJoinTicketResponse, error) {
		return joinAs(vtpm.NewIssuer(nodeTPM.Open, zap.NewNop()))
	}
	// The first join waits until the joinservice serves; any answer but Unavailable ends the wait.
	var resp *joinproto.IssueJoinTicketResponse
	if err := proctest.WaitReady(ctx, 200*time.Millisecond, 30*time.Second, func(context.Context) error {
		if resp, err = join(); status.Code(err) == codes.Unavailable {
			return err
		}
		return nil
	}, js); err != nil {
		t.Fatalf("waiting for the joinservice: %v", err)
	}
	if err != nil || resp.GetNodeName() != "worker-9" {
		t.Fatalf("genuine join: %v", err)
	}
	// The TPM work per join, by the node's join policy. The first join activated the joinservice's
	// key for the node and quoted for it (the session proof is no use to a node that must challenge).
	work := func() (quotes, activations float64) {
		m := scrapeMetrics(t, metricsAddr)
		return m[`berth_joinservice_attestation_operations_total{operation="quote",purpose="connection"}`],
			m[`berth_joinservice_attestation_operations_total{operation="activation",purpose="connection"}`]
	}
	q0, a0 := work()
	if q0 < 1 || a0 < 1 {
		t.Fatalf("a join without the attestation-key CA: %v quotes, %v activations for connections, want at least 1 each", q0, a0)
	}
	if _, err := joinWith(clusterJoinPolicy, vtpm.NewIssuer(nodeTPM.Open, zap.NewNop())); err != nil {
		t.Fatalf("join with the cluster's join policy: %v", err)
	}
	if q1, a1 := work(); q1 != q0 || a1 != a0 {
		t.Fatalf("a join through the session proof cost the joinservice's TPM %v quotes and %v activations, want none", q1-q0, a1-a0)
	}
	if s := scrapeMetrics(t, metricsAddr)[`berth_joinservice_attestation_operations_total{operation="quote",purpose="session"}`]; s < 1 {
		t.Fatalf("no session proof quoted (%v)", s)
	}
	// A node with the image's policy, which does not know the cluster, still joins; it costs a quote.
	if _, err := join(); err != nil {
		t.Fatalf("join with the image's join policy after the session one: %v", err)
	}
	if q2, _ := work(); q2 != q0+1 {
		t.Fatalf("a join with the image's policy cost %v connection quotes, want 1", q2-q0)
	}

	// Replayed evidence: a node that answers a second handshake with the document of its first.
	replay := &replayingIssuer{Issuer: vtpm.NewIssuer(nodeTPM.Open, zap.NewNop())}
	if _, err := joinAs(replay); err != nil {
		t.Fatalf("join that recorded the document: %v", err)
	}
	// The server ends the handshake with an alert; the reason is in its ledger (checked below).
	if _, err = joinAs(replay); err == nil {
		t.Fatal("a node replaying its evidence got a ticket")
	}
	// An attestation key not rooted in the policy's EK CAs: a TPM from another manufacturer.
	if _, err = joinAs(vtpm.NewIssuer(vtpmtest.StartSwtpm(t, vtpmtest.NewSwtpmCA(t)).Open, zap.NewNop())); err == nil {
		t.Fatal("a node whose EK is from an untrusted CA got a ticket")
	}

	admin := env.Client(t, apiservertest.AdminUser)
	cms := admin.CoreV1().ConfigMaps(joinconfig.Namespace)
	// setPolicy returns the ConfigMap's new resourceVersion: the joinservice's Event about it names
	// that version, so an Event about an earlier update (of another run on a shared API server) does
	// not count.
	setPolicy := func(doc string) string {
		cm, err := cms.Get(ctx, joinconfig.JoinConfigName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cm.Data[joinconfig.KeyAttestationPolicy] = doc
		cm, err = cms.Update(ctx, cm, metav1.UpdateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return cm.ResourceVersion
	}
	waitEvent := func(reason, resourceVersion string) corev1.Event {
		var found corev1.Event
		if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
			evs, err := admin.CoreV1().Events(joinconfig.Namespace).List(ctx, metav1.ListOptions{FieldSelector: "reason=" + reason})
			if err != nil {
				return false, nil
			}
			for _, ev := range evs.Items {
				if ev.InvolvedObject.ResourceVersion == resourceVersion {
					found = ev
					return true, nil
				}
			}
			return false, nil
		}); err != nil {
			t.Fatalf("no %s event about resourceVersion %s: %v", reason, resourceVersion, err)
		}
		return found
	}

	t.Logf("event: %s", waitEvent("PolicyApplied", setPolicy(clusterPolicy(ones))).Message)
	// The node claims its PCRs up front (vtpm.Issuer is an atls.Claimer): the new policy refuses it
	// in the handshake, before the joinservice quotes.
	_, err = join()
	if rej, ok := atls.ParseRejection(status.Convert(err).Message()); !ok || rej.Reason != "MEASUREMENT_MISMATCH" || rej.Message != atls.ClaimVerdict {
		t.Fatalf("join after the policy update = %v, want the refusal on claims", err)
	}

	t.Logf("event: %s", waitEvent("PolicyRejected", setPolicy("variant: tpm\nmeasurements: {4: [")).Message)
	_, err = join()
	if rej, ok := atls.ParseRejection(status.Convert(err).Message()); !ok || rej.Reason != "MEASUREMENT_MISMATCH" || rej.Message != atls.ClaimVerdict {
		t.Fatalf("join after a malformed update = %v, want the previous policy's refusal on claims", err)
	}

	var mine []ledger.Entry
	// The ledger is written asynchronously: wait until the eight attempts are in (or time out and judge
	// what is there). The two refusals on claims are one entry of two attempts (refusals of one peer
	// and reason are aggregated).
	_ = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 20*time.Second, true, func(ctx context.Context) (bool, error) {
		entries, _ := joinledger.Read(ctx, admin, joinconfig.Namespace)
		mine = mine[:0]
		attempts := 0
		for _, e := range entries {
			if e.Peer == "127.0.0.1" && (e.RPC == "join" || e.RPC == "handshake") && e.Time.After(started) { // a rejected node is not attested: no name
				mine = append(mine, e)
				attempts += max(e.Count, 1)
			}
		}
		return attempts >= 8, nil
	})
	// Accepted three times (the image's and the cluster's join policy, the image's again), accepted
	// (the replay's first), the replay, the unrooted key, two refusals on claims.
	if len(mine) != 7 || mine[6].Count != 2 {
		t.Fatalf("%d ledger entries from the node, want 7 (the last of 2 attempts): %+v", len(mine), mine)
	}
	for i, want := range []struct{ rpc, reason, text string }{
		{"join", "", ""}, {"join", "", ""}, {"join", "", ""}, {"join", "", ""},
		{"handshake", "NONCE_MISMATCH", "another nonce"},
		{"handshake", "UNTRUSTED_ROOT", "EK certificate"},
		{"handshake", "MEASUREMENT_MISMATCH", "claimed measurements: measurement mismatch: index 4: expected " + ones},
	} {
		e := mine[i]
		if e.RPC != want.rpc || e.Reason != want.reason || !strings.Contains(e.Message, want.text) {
			t.Errorf("ledger entry %d = %+v, want %s %q containing %q", i, e, want.rpc, want.reason, want.text)
		}
		if (want.rpc == "join" || want.reason == "MEASUREMENT_MISMATCH") && len(e.EvidenceSHA256) != 64 {
			t.Errorf("ledger entry %d without evidence digest: %+v", i, e)
		}
	}
	if mine[0].EvidenceSHA256 == mine[1].EvidenceSHA256 {
		t.Fatal("two handshakes share an evidence digest: evidence is not fresh per connection")
	}
	checkRecords(t, env, mine[3].Identity, mine[3].EvidenceSHA256, zero)
}

// checkRecords: the record API holds the node's Machine with the evidence of its latest join (PCR 4
// as the image's policy expects it) and the refusals on claims as one unverified JoinRecord.
func checkRecords(t *testing.T, env *apiservertest.Env, identity, digest, pcr4 string) {
	t.Helper()
	rc, err := recordsclient.NewForConfig(env.Config(apiservertest.AdminUser))
	if err != nil {
		t.Fatal(err)
	}
	var m *recordsv1alpha1.Machine
	if err := wait.PollUntilContextTimeout(t.Context(), 100*time.Millisecond, 20*time.Second, true, func(ctx context.Context) (bool, error) {
		m, err = rc.RecordsV1alpha1().Machines(joinconfig.Namespace).Get(ctx, records.NameFor(identity), metav1.GetOptions{})
		return err == nil && m.Status.Evidence != nil && m.Status.Evidence.SHA256 == digest, nil
	}); err != nil {
		t.Fatalf("no Machine of %s with the evidence of its latest join (%+v): %v", identity, m, err)
	}
	if m.Spec.Node != "worker-9" || m.Status.State != recordsv1alpha1.StateAdmitted || m.Status.Evidence.Measurements["4"] != pcr4 ||
		len(m.Status.Evidence.Measurements["15"]) != 64 {
		t.Errorf("machine = %+v %+v, want worker-9 admitted with PCR 4 %s and PCR 15", m.Spec, m.Status.Evidence, pcr4)
	}
	list, err := rc.RecordsV1alpha1().JoinRecords(joinconfig.Namespace).List(t.Context(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, jr := range list.Items {
		if jr.Spec.Peer == "127.0.0.1" && jr.Spec.Reason == "MEASUREMENT_MISMATCH" && jr.Status.Count >= 2 {
			return
		}
	}
	t.Errorf("no JoinRecord of the refusals on claims among %d records", len(list.Items))
}

// replayingIssuer answers every handshake after its first with the first one's document.
type replayingIssuer struct {
	*vtpm.Issuer
	mu  sync.Mutex
	doc []byte
}

func (r *replayingIssuer) Issue(ctx context.Context, userData, nonce []byte) ([]byte, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.doc != nil {
		return r.doc, nil
	}
	doc, err := r.Issuer.Issue(ctx, userData, nonce)
	r.doc = doc
	return doc, err
}

// scrapeMetrics reads the joinservice's metrics: the value of every sample by its name and labels
// as the exposition format writes them.
func scrapeMetrics(t *testing.T, addr string) map[string]float64 {
	t.Helper()
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatalf("reading metrics: %v", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading metrics: %v", err)
	}
	out := map[string]float64{}
	for _, line := range strings.Split(string(body), "\n") {
		i := strings.LastIndexByte(line, ' ')
		if line == "" || line[0] == '#' || i < 0 {
			continue
		}
		if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
			out[line[:i]] = v
		}
	}
	return out
}

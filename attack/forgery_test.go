package attack

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/joinproto"
)

// forging holds no TPM: it knows a genuine node's activation identity and one of its documents (both
// public: the node sends them to whoever it attests to) and presents that document with its quote's
// signature changed, a quote no TPM signed, made for another handshake's nonce.
type forging struct {
	identity, doc []byte
}

func (forging) Variant() string { return vtpm.Variant }

func (f forging) Issue(context.Context, []byte, []byte) ([]byte, error) {
	var d vtpm.Document
	if err := json.Unmarshal(f.doc, &d); err != nil {
		return nil, err
	}
	d.QuoteSignature = append([]byte(nil), d.QuoteSignature...)
	d.QuoteSignature[len(d.QuoteSignature)-1] ^= 0x5a
	return json.Marshal(d)
}

func (f forging) Identity(context.Context) ([]byte, error) { return f.identity, nil }

func (forging) Activate(context.Context, []byte) ([]byte, error) {
	return nil, errors.New("no TPM to activate with")
}

// TestForgedReplaysLeaveLedgerEvidence: a genuine node joins (the joinservice activates its key), then
// replays its document once (NONCE_MISMATCH, evidence: its TPM signed that quote) and another node
// transplants its evidence (KEY_BINDING). Then 250 addresses present the genuine node's identity with
// a forged quote for another nonce. The joinservice checks who signed before it looks at the nonce:
// the forgeries are BAD_SIGNATURE, unverified refusals, and the replay and the transplant stay in the
// ledger's evidence share. With the nonce checked first, as it was, every forgery counted as a
// replay: 251 NONCE_MISMATCH entries of kind evidence, made without a TPM, beside the genuine one.
func TestForgedReplaysLeaveLedgerEvidence(t *testing.T) {
	const addresses = 250
	c := startJoinCluster(t, "--attest-rate-global=5000", "--attest-rate-global-burst=5000")
	replayIP, transplantIP := workerIP(workers), workerIP(workers-1)
	r := &replaying{SoftTPM: softTPM(t, c.nodeCA, genuinePCRs())}
	if _, err := c.join(t, replayIP, r, workerRequest(t, diskA)); err != nil {
		t.Fatal(err)
	}
	_, _ = c.join(t, replayIP, r, workerRequest(t, diskA))
	_, _ = c.join(t, transplantIP, transplanting{softTPM(t, c.nodeCA, genuinePCRs())}, workerRequest(t, diskA))
	c.waitLedger(t, "the replay", ledgerRefusal(replayIP, "NONCE_MISMATCH"))
	c.waitLedger(t, "the transplant", ledgerRefusal(transplantIP, "KEY_BINDING"))

	identity, err := r.Identity(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	r.mu.Lock()
	forger := forging{identity: identity, doc: r.doc}
	r.mu.Unlock()

	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	var mu sync.Mutex
	codes := map[string]int{}
	handshake := func(ip string) {
		conn, err := c.dial(ip, forger, c.joinPolicy)
		if err != nil {
			t.Error(err)
			return
		}
		defer conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, err = joinproto.NewJoinServiceClient(conn).IssueJoinTicket(ctx, workerRequest(t, diskA))
		if err == nil {
			t.Errorf("a forged quote from %s got a ticket", ip)
		}
		mu.Lock()
		defer mu.Unlock()
		codes[status.Code(err).String()]++
	}
	start := time.Now()
	for i := range addresses {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			handshake(floodIP(i).String())
		}()
	}
	wg.Wait()
	t.Logf("%d forged quotes for another nonce from %d addresses in %.1f s: %v", addresses, addresses, time.Since(start).Seconds(), codes)
	// One more from a last address: once the ledger shows it, it shows every refusal before it. Its
	// reason is the check that refused it: who signed, not which nonce.
	last := floodIP(addresses).String()
	handshake(last)
	e := c.waitLedger(t, "the last forgery", func(e joinledger.Entry) bool { return e.Peer == last })
	if e.Reason != "BAD_SIGNATURE" || joinledger.KindOf(e) != joinledger.KindUnverified {
		t.Errorf("the forgery from %s is in the ledger as %s (kind %s), want BAD_SIGNATURE (kind %s): %s",
			last, e.Reason, joinledger.KindOf(e), joinledger.KindUnverified, oneLine(e.Message, 120))
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	es, err := joinledger.Read(ctx, c.admin, joinconfig.Namespace)
	if err != nil {
		t.Fatal(err)
	}
	forged := map[string]int{} // the forgeries' entries by kind and reason
	for _, e := range es {
		if strings.HasPrefix(e.Peer, "127.10.") {
			forged[joinledger.KindOf(e)+" "+e.Reason]++
		}
	}
	t.Logf("the ledger after the forgeries: %d entries; the forgeries', by kind and reason: %v", len(es), forged)
	for _, want := range []struct{ peer, reason string }{{replayIP, "NONCE_MISMATCH"}, {transplantIP, "KEY_BINDING"}} {
		found := false
		for _, e := range es {
			if ledgerRefusal(want.peer, want.reason)(e) {
				found = true
				t.Logf("  kept: %s %s (kind %s)", e.Peer, e.Reason, joinledger.KindOf(e))
			}
		}
		if !found {
			t.Errorf("the forgeries evicted the %s of %s from the ledger", want.reason, want.peer)
		}
	}
}

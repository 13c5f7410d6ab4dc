package attack

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/joinledger"
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
	c, r, replayIP, transplantIP := startWithEvidence(t)

	identity, err := r.Identity(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	r.mu.Lock()
	forger := forging{identity: identity, doc: r.doc}
	r.mu.Unlock()

	forge := func(ip string) error {
		err := c.askTicket(t, ip, forger)
		if err == nil {
			t.Errorf("a forged quote from %s got a ticket", ip)
		}
		return err
	}
	start := time.Now()
	codes := floodTally(addresses, func(i int) error { return forge(floodIP(i).String()) })
	t.Logf("%d forged quotes for another nonce from %d addresses in %.1f s: %v", addresses, addresses, time.Since(start).Seconds(), codes)
	// One more from a last address: once the ledger shows it, it shows every refusal before it. Its
	// reason is the check that refused it: who signed, not which nonce.
	last := floodIP(addresses).String()
	_ = forge(last)
	e := c.waitLedger(t, "the last forgery", func(e joinledger.Entry) bool { return e.Peer == last })
	if e.Reason != "BAD_SIGNATURE" || joinledger.KindOf(e) != joinledger.KindUnverified {
		t.Errorf("the forgery from %s is in the ledger as %s (kind %s), want BAD_SIGNATURE (kind %s): %s",
			last, e.Reason, joinledger.KindOf(e), joinledger.KindUnverified, oneLine(e.Message, 120))
	}

	c.checkEvidenceKept(t, "forgeries", replayIP, transplantIP)
}

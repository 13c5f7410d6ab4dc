package attack

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/joinproto"
)

// The helpers of the tests that flood the joinservice with cheap refusals and check that the
// ledger's evidence share survives them.

// startWithEvidence starts a join cluster whose handshake budget for unknown peers is raised so
// that every handshake of a flood is judged, and leaves two evidence refusals in its ledger: the
// genuine node r joins and replays its document from replayIP (NONCE_MISMATCH), and another node
// transplants its evidence from transplantIP (KEY_BINDING).
func startWithEvidence(t *testing.T) (c *joinCluster, r *replaying, replayIP, transplantIP string) {
	t.Helper()
	c = startJoinCluster(t, "--attest-rate-global=5000", "--attest-rate-global-burst=5000")
	replayIP, transplantIP = workerIP(workers), workerIP(workers-1)
	r = &replaying{SoftTPM: softTPM(t, c.nodeCA, genuinePCRs())}
	if _, err := c.join(t, replayIP, r, workerRequest(t, diskA)); err != nil {
		t.Fatal(err)
	}
	_, _ = c.join(t, replayIP, r, workerRequest(t, diskA))
	_, _ = c.join(t, transplantIP, transplanting{softTPM(t, c.nodeCA, genuinePCRs())}, workerRequest(t, diskA))
	c.waitLedger(t, "the replay", ledgerRefusal(replayIP, "NONCE_MISMATCH"))
	c.waitLedger(t, "the transplant", ledgerRefusal(transplantIP, "KEY_BINDING"))
	return c, r, replayIP, transplantIP
}

// askTicket dials the joinservice from ip attested by issuer and asks for a worker's join ticket;
// it returns the answer's error. A dial that fails fails the test, and its error is returned.
func (c *joinCluster) askTicket(t *testing.T, ip string, issuer atls.Issuer) error {
	conn, err := c.dial(ip, issuer, c.joinPolicy)
	if err != nil {
		t.Error(err)
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err = joinproto.NewJoinServiceClient(conn).IssueJoinTicket(ctx, workerRequest(t, diskA))
	return err
}

// floodTally runs ask(i) for every i below n, at most 16 at a time, and counts the gRPC codes of
// the errors it returns.
func floodTally(n int, ask func(i int) error) map[string]int {
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	var mu sync.Mutex
	tally := map[string]int{}
	for i := range n {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			err := ask(i)
			mu.Lock()
			defer mu.Unlock()
			tally[status.Code(err).String()]++
		})
	}
	wg.Wait()
	return tally
}

// checkEvidenceKept reads the ledger after the flood of what, logs it, and fails the test when the
// replay from replayIP or the transplant from transplantIP is no longer in it. It returns the
// flood's entries (peers in 127.10.0.0/16, see floodIP) counted by kind and reason.
func (c *joinCluster) checkEvidenceKept(t *testing.T, what, replayIP, transplantIP string) map[string]int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	es, err := joinledger.Read(ctx, c.admin, joinconfig.Namespace)
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[string]int{}
	flood := map[string]int{}
	for _, e := range es {
		kinds[joinledger.KindOf(e)]++
		if strings.HasPrefix(e.Peer, "127.10.") {
			flood[joinledger.KindOf(e)+" "+e.Reason]++
		}
	}
	t.Logf("the ledger after the %s: %d entries (%d accepted, %d evidence, %d unverified); the flood's, by kind and reason: %v",
		what, len(es), kinds[joinledger.KindAccepted], kinds[joinledger.KindEvidence], kinds[joinledger.KindUnverified], flood)
	for _, want := range []struct{ peer, reason string }{{replayIP, "NONCE_MISMATCH"}, {transplantIP, "KEY_BINDING"}} {
		found := false
		for _, e := range es {
			if ledgerRefusal(want.peer, want.reason)(e) {
				found = true
				t.Logf("  kept: %s %s %s (kind %s)", e.Peer, e.Reason, oneLine(e.Message, 80), joinledger.KindOf(e))
			}
		}
		if !found {
			t.Errorf("the %s evicted the %s of %s from the ledger", what, want.reason, want.peer)
		}
	}
	return flood
}

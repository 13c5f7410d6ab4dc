package initclient

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/atls/atlstest"
	"github.com/berth-k8s/berth/internal/attestation"
)

// refusing validates nothing.
type refusing struct{ atlstest.Validator }

func (refusing) Validate(context.Context, []byte, []byte) (attestation.Result, error) {
	return attestation.Result{}, attestation.ErrMeasurementMismatch
}

// TestWaitConnectedAttestation: a node that attests is reached and its evidence kept; one the
// validator refuses ends the wait at once with ErrAttestationFailed and the validator's reason.
func TestWaitConnectedAttestation(t *testing.T) {
	creds, err := atls.NewCredentials(atlstest.Issuer{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.Creds(creds))
	go func() { _ = srv.Serve(l) }()
	defer srv.Stop()

	conn, verdict, err := NewConn(l.Addr().String(), atlstest.Validator{})
	if err != nil {
		t.Fatal(err)
	}
	if err := WaitConnected(context.Background(), conn, 10*time.Second, verdict); err != nil {
		t.Fatalf("WaitConnected(attesting node) = %v", err)
	}
	_ = conn.Close()
	if ev := verdict.Accepted(); ev == nil || ev.Variant != atlstest.Variant {
		t.Errorf("Accepted() = %+v, want the fake variant's evidence", ev)
	}

	conn, verdict, err = NewConn(l.Addr().String(), refusing{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	start := time.Now()
	err = WaitConnected(context.Background(), conn, 10*time.Second, verdict)
	if !errors.Is(err, ErrAttestationFailed) || !errors.Is(err, attestation.ErrMeasurementMismatch) {
		t.Errorf("WaitConnected(refused node) = %v, want ErrAttestationFailed wrapping the mismatch", err)
	}
	if time.Since(start) > 5*time.Second {
		t.Errorf("a refused node was retried for %s", time.Since(start))
	}
	if verdict.Accepted() != nil {
		t.Errorf("a refused node's evidence was kept")
	}
}

package joinclient

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
)

func checkIn(ctx context.Context, dial dialFunc, b wait.Backoff) error {
	return CheckIn(ctx, zap.NewNop(), cluster, dial, 9002, rejoinDiskUUID, rejoinCluster, b)
}

// TestCheckInRevoked: a joinservice's REVOKED ends the check-in at once with ErrRevoked, its
// message escaped; the other control plane is not asked again.
func TestCheckInRevoked(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cp0 := &rejoinService{errs: []error{refusal(codes.PermissionDenied, joinledger.ReasonRevoked, "machine 0a1b was removed\x1b[2J")}, always: true}
		cp1 := &rejoinService{errs: []error{refusal(codes.PermissionDenied, joinledger.ReasonRevoked, "removed")}, always: true}
		dial := serveRejoin(t, map[string]*rejoinService{"198.51.100.10:9002": cp0, "198.51.100.11:9002": cp1}, "198.51.100.12:9002")
		err := checkIn(context.Background(), dial, CheckInBackoff)
		if !errors.Is(err, ErrRevoked) || strings.ContainsRune(err.Error(), '\x1b') || !strings.Contains(err.Error(), "machine 0a1b was removed?[2J") {
			t.Fatalf("CheckIn() = %q, want ErrRevoked with the escaped message", err)
		}
		if cp0.calls() != 1 || cp1.calls() != 0 {
			t.Fatalf("asked cp-0 %d and cp-1 %d times, want once and never", cp0.calls(), cp1.calls())
		}
	})
}

// TestCheckInAdmitted: an unreachable control plane and a rate limit are asked again; the first
// admission ends the check-in.
func TestCheckInAdmitted(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cp1 := &rejoinService{errs: []error{status.Error(codes.ResourceExhausted, "too many join attempts"),
			refusal(codes.Unavailable, "MACHINE_RECORD_UNAVAILABLE", "not read yet")}}
		dial := serveRejoin(t, map[string]*rejoinService{"198.51.100.11:9002": cp1}, "")
		if err := checkIn(context.Background(), dial, CheckInBackoff); err != nil {
			t.Fatalf("CheckIn() = %v", err)
		}
		if cp1.calls() != 3 {
			t.Fatalf("asked cp-1 %d times, want 3", cp1.calls())
		}
	})
}

// TestCheckInBounded: with no joinservice answering, or only refusals other than REVOKED (one in the
// handshake that names REVOKED, from a peer that has not attested, among them), the check-in gives up
// after its backoff's rounds with ErrNoCheckIn; the bound is the backoff's, about twenty seconds.
func TestCheckInBounded(t *testing.T) {
	for name, services := range map[string]map[string]*rejoinService{
		"nothing answers": {},
		"refusals": {
			"198.51.100.10:9002": {errs: []error{refusal(codes.PermissionDenied, "MEASUREMENT_MISMATCH", "index 4")}, always: true},
			"198.51.100.11:9002": {errs: []error{status.Error(codes.Unavailable, fmt.Sprintf("connection error: desc = %q",
				"transport: authentication handshake failed: "+(&atls.Rejection{Reason: joinledger.ReasonRevoked, Message: "forged"}).Error()))}, always: true},
		},
	} {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				dial := serveRejoin(t, services, "")
				start := time.Now()
				err := checkIn(context.Background(), dial, CheckInBackoff)
				took := time.Since(start)
				if !errors.Is(err, ErrNoCheckIn) || errors.Is(err, ErrRevoked) {
					t.Fatalf("CheckIn() = %v, want ErrNoCheckIn", err)
				}
				if took < 10*time.Second || took > 40*time.Second {
					t.Fatalf("gave up after %s, want about twenty seconds", took)
				}
				for ep, s := range services {
					if s.calls() != CheckInBackoff.Steps {
						t.Errorf("%s asked %d times, want %d", ep, s.calls(), CheckInBackoff.Steps)
					}
				}
			})
		})
	}
}

// TestCheckInEndsWithContext: a check-in that never gets an answer ends with its context.
func TestCheckInEndsWithContext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		b := CheckInBackoff
		b.Steps = 1 << 30
		if err := checkIn(ctx, serveRejoin(t, nil, ""), b); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("CheckIn() = %v, want the context's error", err)
		}
	})
}

// TestCheckInOnlyControlPlane: the cluster's only control plane has no other joinservice to ask: the
// check-in says so at once (ErrOnlyControlPlane), dialing nothing. A worker whose metadata lists no
// control plane, and a control plane with another one listed, still ask for their rounds.
func TestCheckInOnlyControlPlane(t *testing.T) {
	alone := metadata.Instance{Name: "cp-0", Role: metadata.RoleControlPlane, IPs: []string{"198.51.100.10"}}
	worker := metadata.Instance{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"198.51.100.20"}}
	dialed := 0
	dial := func(context.Context, string) (joinproto.JoinServiceClient, io.Closer, error) {
		dialed++
		return nil, nil, errors.New("connection refused")
	}
	err := CheckIn(context.Background(), zap.NewNop(), staticMeta{self: alone, peers: []metadata.Instance{alone, worker}}, dial, 9002, rejoinDiskUUID, rejoinCluster, CheckInBackoff)
	if !errors.Is(err, ErrOnlyControlPlane) || dialed != 0 {
		t.Fatalf("CheckIn() of the only control plane = %v after %d dials, want ErrOnlyControlPlane and none", err, dialed)
	}
	for name, meta := range map[string]staticMeta{
		"a worker without a control plane listed": {self: worker, peers: []metadata.Instance{worker}},
		"a control plane with another listed":     {self: alone, peers: []metadata.Instance{alone, {Name: "cp-1", Role: metadata.RoleControlPlane, IPs: []string{"198.51.100.11"}}}},
	} {
		synctest.Test(t, func(t *testing.T) {
			b := CheckInBackoff
			b.Steps = 2
			err := CheckIn(context.Background(), zap.NewNop(), meta, serveRejoin(t, nil, ""), 9002, rejoinDiskUUID, rejoinCluster, b)
			if !errors.Is(err, ErrNoCheckIn) || errors.Is(err, ErrOnlyControlPlane) {
				t.Errorf("%s: CheckIn() = %v, want ErrNoCheckIn after its rounds", name, err)
			}
		})
	}
}

package initclient

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/nodelock"
)

// TestAcceptResumedLock: the init policy then accepts a fresh node and one locked for this
// workspace's cluster, and still refuses one locked for another cluster.
func TestAcceptResumedLock(t *testing.T) {
	zero := strings.Repeat("00", 32)
	id, other := []byte("cluster of this workspace"), []byte("another cluster")
	p, err := policy.Parse([]byte("variant: tpm\nmeasurements:\n  4: {expected: "+strings.Repeat("ab", 32)+"}\n  15: {expected: "+zero+"}\n"), "init.yaml", nil)
	if err != nil {
		t.Fatal(err)
	}
	idx, ok := AcceptResumedLock(p, id)
	if !ok || idx != vtpm.DefaultLockPCR {
		t.Fatalf("AcceptResumedLock() = %d, %v; want PCR %d", idx, ok, vtpm.DefaultLockPCR)
	}
	boot := bytes.Repeat([]byte{0xab}, 32)
	for name, tc := range map[string]struct {
		lock []byte
		pass bool
	}{
		"fresh":           {make([]byte, 32), true},
		"this cluster":    {vtpm.ExpectedLockValue(nodelock.ControlPlaneLockID(id)), true},
		"another cluster": {vtpm.ExpectedLockValue(nodelock.ControlPlaneLockID(other)), false},
		// The init node is a control plane: a worker's lock value of the cluster is not the one.
		"a worker's value":     {vtpm.ExpectedLockValue(id), false},
		"TDX value of this ID": {tdx.ExpectedLockRTMR(id)[:32], false},
	} {
		_, err := p.Evaluate(attestation.Measurements{4: boot, 15: tc.lock})
		if pass := err == nil; pass != tc.pass {
			t.Errorf("%s: Evaluate() = %v, want pass=%v", name, err, tc.pass)
		}
		if !tc.pass && !errors.Is(err, attestation.ErrMeasurementMismatch) {
			t.Errorf("%s: Evaluate() = %v, want a measurement mismatch", name, err)
		}
	}

	tdxPolicy, err := policy.Parse([]byte("variant: tdx\nmeasurements:\n  4: {expected: "+strings.Repeat("00", 48)+"}\n"), "tdx.yaml", nil)
	if err != nil {
		t.Fatal(err)
	}
	if idx, ok := AcceptResumedLock(tdxPolicy, id); !ok || idx != tdx.DefaultLockRTMR+1 {
		t.Fatalf("TDX: AcceptResumedLock() = %d, %v", idx, ok)
	}
	if _, err := tdxPolicy.Evaluate(attestation.Measurements{4: tdx.ExpectedLockRTMR(nodelock.ControlPlaneLockID(id))}); err != nil {
		t.Errorf("TDX: the resumed cluster's RTMR3 refused: %v", err)
	}
	// A policy without an exact expectation at the lock index is left alone.
	for _, text := range []string{"variant: tpm\nmeasurements:\n  15: {nonZero: true}\n", "variant: tpm\nmeasurements:\n  4: {expected: " + zero + "}\n"} {
		p, err := policy.Parse([]byte(text), "p.yaml", nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := AcceptResumedLock(p, id); ok {
			t.Errorf("policy %q changed", text)
		}
	}
}

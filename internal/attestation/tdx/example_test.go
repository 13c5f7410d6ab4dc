package tdx_test

import (
	"context"
	"fmt"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/attestation/tdx"
)

// A node attests with whichever guest interface its kernel offers and takes the node lock in RTMR3.
func ExampleNewIssuer() {
	log := zap.NewNop()
	issuer := tdx.NewIssuer(tdx.OpenAuto(), log)
	lock, err := tdx.NewLockRegister(tdx.OpenAuto(), tdx.DefaultLockRTMR)
	if err != nil {
		panic(err)
	}
	_, _ = issuer, lock
}

// A verifier runs offline on collateral pre-fetched into a cache directory, trusting Intel's SGX root, and
// enforces MRTD and the lock RTMR of its own cluster.
func ExampleNewValidator() {
	collateral := tdx.NewCachingGetter(tdx.CachingGetterConfig{Dir: "/var/lib/berth/tdx-collateral"})
	verifier, err := tdx.NewVerifier(tdx.VerifierConfig{Roots: tdx.IntelSGXRootCA(), Collateral: collateral})
	if err != nil {
		panic(err)
	}
	expected := map[uint32][]byte{
		0:                               make([]byte, tdx.MeasurementSize), // MRTD of the node image
		uint32(tdx.DefaultLockRTMR) + 1: tdx.ExpectedLockRTMR([]byte("cluster ID")),
	}
	validator, err := tdx.NewValidator(verifier, tdx.ExpectMeasurements(expected), zap.NewNop())
	if err != nil {
		panic(err)
	}
	var doc, nonce []byte // from the peer and from this side of the handshake
	res, err := validator.Validate(context.Background(), doc, nonce)
	if err != nil {
		fmt.Println("rejected:", err)
		return
	}
	fmt.Printf("accepted, MRTD %x, warnings %q\n", res.Measurements[0], res.Warnings)
}

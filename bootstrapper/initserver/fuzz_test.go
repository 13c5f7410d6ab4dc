package initserver

import (
	"net"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/berth-k8s/berth/initproto"
)

// FuzzParseRequest decodes arbitrary InitRequest bytes, as a caller holding the init secret sends
// them, and validates them as Init does before it takes the node lock: no input panics, and what is
// accepted has a DNS-label cluster name, a Kubernetes version, CIDRs and SANs that are addresses or
// DNS names (no control characters reach kubeadm's configuration).
func FuzzParseRequest(f *testing.F) {
	seed := request(1)
	seed.ApiserverCertSans = []string{"198.51.100.10", "api.example.com"}
	seed.AttestationPolicy = []byte("variant: tpm\n")
	seed.Components = &initproto.Components{ImagePolicy: []byte("rules: [{name: local, registries: [berth.local]}]\n")}
	b, err := proto.Marshal(seed)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(b)
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		var req initproto.InitRequest
		if proto.Unmarshal(b, &req) != nil {
			return
		}
		parsed, err := parseRequest(&req)
		if err != nil {
			return
		}
		if !dnsLabel.MatchString(parsed.ClusterName) || !kubeVersion.MatchString(parsed.KubernetesVersion) {
			t.Fatalf("accepted cluster name %q, version %q", parsed.ClusterName, parsed.KubernetesVersion)
		}
		for _, cidr := range []string{parsed.ServiceCIDR, parsed.PodCIDR} {
			if _, _, err := net.ParseCIDR(cidr); err != nil {
				t.Fatalf("accepted CIDR %q", cidr)
			}
		}
		for _, san := range parsed.CertSANs {
			if net.ParseIP(san) == nil && (!dnsName.MatchString(san) || strings.ContainsFunc(san, func(r rune) bool { return r < 0x21 || r > 0x7e })) {
				t.Fatalf("accepted SAN %q", san)
			}
		}
		if parsed.Keys == nil || len(parsed.Keys.ClusterID()) == 0 {
			t.Fatal("accepted a request without keys")
		}
	})
}

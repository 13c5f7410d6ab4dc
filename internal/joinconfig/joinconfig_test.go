package joinconfig

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

func TestConfigRoundTrip(t *testing.T) {
	in := Config{
		AttestationPolicy: []byte("variant: tpm\n"),
		MeasurementSalt:   bytes.Repeat([]byte{2}, 32),
		ClusterID:         bytes.Repeat([]byte{0xab}, 32),
		KubernetesVersion: "v1.34.2",
		APIServerEndpoint: "198.51.100.10:6443",
	}
	data := in.Data()
	if data[KeyClusterID] != strings.Repeat("ab", 32) {
		t.Fatalf("clusterID encodes as %q, want lowercase hex", data[KeyClusterID])
	}
	out, err := DecodeConfig(data)
	if err != nil {
		t.Fatal(err)
	}
	if string(out.AttestationPolicy) != string(in.AttestationPolicy) || !bytes.Equal(out.MeasurementSalt, in.MeasurementSalt) ||
		!bytes.Equal(out.ClusterID, in.ClusterID) || out.KubernetesVersion != in.KubernetesVersion || out.APIServerEndpoint != in.APIServerEndpoint {
		t.Fatalf("DecodeConfig(Data()) = %+v, want %+v", out, in)
	}
}

func TestDecodeConfigRejectsMalformedHex(t *testing.T) {
	for _, key := range []string{KeyMeasurementSalt, KeyClusterID} {
		data := Config{}.Data()
		data[key] = "not hex"
		_, err := DecodeConfig(data)
		if !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), key) {
			t.Errorf("DecodeConfig(%s = not hex) = %v, want ErrMalformed naming the key", key, err)
		}
	}
}

func TestDecodeConfigToleratesAbsentKeys(t *testing.T) {
	c, err := DecodeConfig(map[string]string{KeyKubernetesVersion: "v1.34.2"})
	if err != nil || c.KubernetesVersion != "v1.34.2" || len(c.ClusterID) != 0 {
		t.Fatalf("DecodeConfig(partial) = %+v, %v", c, err)
	}
}

func TestSecretsRoundTripAndMissingKeys(t *testing.T) {
	in := ClusterSecrets{MasterSecret: []byte("master-secret-bytes"), Salt: []byte("salt")}
	out, err := DecodeSecrets(in.Data())
	if err != nil || !bytes.Equal(out.MasterSecret, in.MasterSecret) || !bytes.Equal(out.Salt, in.Salt) {
		t.Fatalf("DecodeSecrets(Data()) = %v, %v", out, err)
	}
	for _, key := range []string{KeyMasterSecret, KeySalt} {
		data := in.Data()
		delete(data, key)
		_, err := DecodeSecrets(data)
		if !errors.Is(err, ErrMissingKey) || !strings.Contains(err.Error(), key) {
			t.Errorf("DecodeSecrets(without %s) = %v, want ErrMissingKey naming it", key, err)
		}
		if err != nil && strings.Contains(err.Error(), string(in.MasterSecret)) {
			t.Errorf("error %q leaks the master secret", err)
		}
	}
}

package main

import (
	"strings"
	"testing"

	"github.com/spf13/pflag"
)

func TestApplyEnvAndValidate(t *testing.T) {
	cfg := defaultConfig()
	flags := pflag.NewFlagSet("bootstrapper", pflag.ContinueOnError)
	cfg.register(flags)
	if err := flags.Parse([]string{"--state-dir=/from/flag"}); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{
		"BERTH_STATE_DIR":          "/from/env",
		"BERTH_METADATA":           "mini",
		"BERTH_METADATA_URL":       "http://198.51.100.1:8080",
		"BERTH_ATTESTATION":        "insecure-none",
		"BERTH_KUBELET":            "process",
		"BERTH_KUBELET_EXTRA_ARGS": "cgroup-root=/node1,v=2",
	}
	if err := applyEnv(flags, func(k string) string { return env[k] }); err != nil {
		t.Fatal(err)
	}
	if cfg.stateDir != "/from/flag" {
		t.Errorf("stateDir = %q: the command line must win over the environment", cfg.stateDir)
	}
	if cfg.metadata != "mini" || cfg.kubelet != "process" {
		t.Errorf("environment not applied: %+v", cfg)
	}
	if err := cfg.validate(); err != nil {
		t.Fatalf("validate() = %v", err)
	}
	if cfg.cgroupDriver != "cgroupfs" {
		t.Errorf("cgroupDriver = %q, want cgroupfs for a supervised kubelet", cfg.cgroupDriver)
	}
	if got := cfg.kubeletExtraArgs(); len(got) != 2 || got[0] != [2]string{"cgroup-root", "/node1"} {
		t.Errorf("kubeletExtraArgs() = %v", got)
	}
}

func TestValidateNamesEveryProblem(t *testing.T) {
	cfg := defaultConfig()
	cfg.metadata = "cloud"
	cfg.attestation = "tpm2"
	cfg.kubelet = "runit"
	cfg.stateDir = "relative"
	cfg.kubeletArgs = []string{"novalue"}
	err := cfg.validate()
	if err == nil {
		t.Fatal("validate() = nil")
	}
	for _, want := range []string{"--metadata", "--attestation", "--kubelet", "--state-dir", "--kubelet-extra-args"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not name %s: %v", want, err)
		}
	}
}

func TestBadEnvIsNamed(t *testing.T) {
	cfg := defaultConfig()
	flags := pflag.NewFlagSet("bootstrapper", pflag.ContinueOnError)
	cfg.register(flags)
	_ = flags.Parse(nil)
	err := applyEnv(flags, func(k string) string {
		if k == "BERTH_JOINSERVICE_PORT" {
			return "many"
		}
		return ""
	})
	if err == nil || !strings.Contains(err.Error(), "BERTH_JOINSERVICE_PORT") {
		t.Fatalf("applyEnv() = %v, want an error naming BERTH_JOINSERVICE_PORT", err)
	}
}

func TestValidateStateDisk(t *testing.T) {
	for _, tc := range []struct {
		name string
		set  func(*config)
		want string
	}{
		{"unknown backend", func(c *config) { c.diskBackend = "zfs" }, "--state-disk-backend"},
		{"backend without disk", func(c *config) { c.diskBackend = "fscrypt" }, "needs --state-disk"},
		{"relative mount", func(c *config) { c.diskBackend, c.stateDisk, c.stateMount = "luks", "/dev/vdb", "run/x" }, "--state-mount"},
		{"bad recovery address", func(c *config) { c.diskBackend, c.stateDisk, c.recoverListen = "fscrypt", "/s.img", "9001" }, "--recovery-listen"},
		{"lock PCR sealed", func(c *config) { c.sealPCRs = []uint{4, 15} }, "--seal-pcrs"},
		{"no such PCR", func(c *config) { c.sealPCRs = []uint{24} }, "--seal-pcrs"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := defaultConfig()
			cfg.metadata, cfg.metadataURL, cfg.attestation, cfg.tpm = "mini", "http://198.51.100.1", "tpm", "tcp:127.0.0.1:2321"
			if err := cfg.validate(); err != nil {
				t.Fatalf("valid base config: %v", err)
			}
			tc.set(cfg)
			if err := cfg.validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("validate() = %v, want an error naming %s", err, tc.want)
			}
		})
	}
}

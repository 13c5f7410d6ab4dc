package cli

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"github.com/spf13/cobra"

	"github.com/berth-k8s/berth/internal/attestation/policy/policyedit"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/uki"
)

func newPolicyMeasureCmd() *cobra.Command {
	var ukiPath, source string
	var events bool
	var phasePCR uint
	cmd := &cobra.Command{
		Use:   "measure --uki FILE",
		Short: "Compute the PCR values a unified kernel image will produce, as a policy",
		Long: `berth policy measure reads a unified kernel image (systemd-stub with the kernel, initrd, command
line and os-release as sections) and prints, as a policy file, the TPM PCR values (SHA-256 bank) it
will produce when UEFI firmware boots it directly as the first boot option:

  PCR 4   the firmware's boot-manager events and the Authenticode digests of the UKI and of the
          kernel the stub starts
  PCR 9   the kernel's measurement of its load options (the .cmdline section as systemd-stub passes
          it, UTF-16) and of the initrd
  PCR 11  systemd-stub's measurement of its sections (name, then content, in the stub's order)
  PCR 12  zero: systemd-stub measures a command line override from the boot option, and
          credentials, there; a boot with either does not match

Firmware PCRs (0-3, 5-7) depend on the firmware build and the machine and are not predicted. PCR 11
holds only while nothing measures into it after the stub (the Berth image masks systemd-pcrphase).
'make image' writes this file next to the image; 'berth policy merge' puts it into a cluster policy.
With --events the predicted events are listed on stderr. With --phase-pcr the boot phase register
the image's bootstrapper marks once its state disk is open is added: zero or that phase's value.`,
		Example: `  berth policy measure --uki image/mkosi.output/berth.efi > berth.measurements.yaml
  berth policy merge --policy cluster-policy.yaml --measurements berth.measurements.yaml > next-policy.yaml`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if ukiPath == "" {
				return usageErr("policy measure needs --uki")
			}
			img, err := os.ReadFile(ukiPath)
			if err != nil {
				return &exitError{code: exitUsage, err: fmt.Errorf("reading UKI: %w", err)}
			}
			p, err := uki.Predict(img)
			if err != nil {
				return &exitError{code: exitUsage, err: fmt.Errorf("%s: %w", ukiPath, err)}
			}
			if events {
				for _, e := range p.Events {
					_, _ = fmt.Fprintf(cmd.ErrOrStderr(), "PCR %2d  %x  %s\n", e.PCR, e.Digest, e.Description)
				}
			}
			if source == "" {
				source = filepath.Base(ukiPath)
			}
			var phase *policyedit.Phase
			if phasePCR != 0 {
				if phasePCR > 23 || slices.Contains(uki.Predicted, int(phasePCR)) {
					return usageErr("--phase-pcr %d: not a PCR free for the boot phase (1-23, none of %v)", phasePCR, uki.Predicted)
				}
				phase = &policyedit.Phase{PCR: int(phasePCR), Open: vtpm.ExpectedPhaseValue(vtpm.StateDiskOpenEvent)}
			}
			out, err := policyedit.Measurements(p, source, phase)
			if err != nil {
				return err
			}
			_, err = cmd.OutOrStdout().Write(out)
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&ukiPath, "uki", "", "unified kernel image (EFI binary)")
	f.StringVar(&source, "source", "", "where the values come from, written into each expectation's source (default: the file's name)")
	f.BoolVar(&events, "events", false, "list the predicted events on stderr")
	f.UintVar(&phasePCR, "phase-pcr", 0, "the nodes' boot phase PCR (the bootstrapper's --phase-pcr): expected zero before the state disk is open, the phase's value after; 0 leaves it out")
	return cmd
}

func newPolicyMergeCmd() *cobra.Command {
	var policyPath, measurementsPath string
	var keep bool
	cmd := &cobra.Command{
		Use:   "merge --policy FILE --measurements FILE",
		Short: "Put an image's expected measurements into a cluster policy",
		Long: `berth policy merge prints the cluster policy --policy with the expectations of --measurements
(for example what 'berth policy measure' computed for an image) in place of the expectations for
the same indices; everything else (other indices, trust roots, the tdx section, comments) stays.
With --keep the values the policy expected so far stay accepted too (anyOf), for a rolling update
from one image to the next; drop them with a merge without --keep once every node runs the new
image. Both files must name the same variant, and the result must be a valid policy.`,
		Example: `  berth policy merge --policy cluster-policy.yaml --measurements image/mkosi.output/berth.measurements.yaml > next-policy.yaml
  berth policy merge --policy cluster-policy.yaml --measurements new-image.yaml --keep > rolling-policy.yaml`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if policyPath == "" || measurementsPath == "" {
				return usageErr("policy merge needs --policy and --measurements")
			}
			out, err := policyedit.Merge(policyPath, measurementsPath, keep)
			if err != nil {
				return &exitError{code: exitUsage, err: err}
			}
			_, err = cmd.OutOrStdout().Write(out)
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&policyPath, "policy", "", "cluster policy file (YAML)")
	f.StringVar(&measurementsPath, "measurements", "", "policy file whose measurements are merged in")
	f.BoolVar(&keep, "keep", false, "keep the values the policy expected so far as accepted alternatives (anyOf)")
	return cmd
}

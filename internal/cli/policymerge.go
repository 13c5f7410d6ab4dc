package cli

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"

	"github.com/spf13/cobra"
	"go.yaml.in/yaml/v3"

	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/uki"
)

func newPolicyMeasureCmd() *cobra.Command {
	var ukiPath, source string
	var events bool
	cmd := &cobra.Command{
		Use:   "measure --uki FILE",
		Short: "Compute the PCR values a unified kernel image will produce, as a policy",
		Long: `berth policy measure reads a unified kernel image (systemd-stub with the kernel, initrd, command
line and os-release as sections) and prints, as a policy file, the TPM PCR values (SHA-256 bank) it
will produce when UEFI firmware boots it directly as the first boot option:

  PCR 4   the firmware's boot-manager events and the Authenticode digests of the UKI and of the
          kernel the stub starts
  PCR 11  systemd-stub's measurement of its sections (name, then content, in the stub's order)

Firmware PCRs (0-3, 5-7) depend on the firmware build and the machine and are not predicted. PCR 11
holds only while nothing measures into it after the stub (the Berth image masks systemd-pcrphase).
'make image' writes this file next to the image; 'berth policy merge' puts it into a cluster policy.
With --events the predicted events are listed on stderr.`,
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
			out, err := measurementPolicy(p, source)
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
	return cmd
}

// measurementPolicy renders a prediction as a tpm policy with one expectation per PCR.
func measurementPolicy(p *uki.Prediction, source string) ([]byte, error) {
	what := map[int]string{
		4:  "PCR 4: boot-manager events, Authenticode of the UKI and its kernel",
		11: "PCR 11: systemd-stub's measurement of the UKI's sections",
	}
	meas := &yaml.Node{Kind: yaml.MappingNode}
	var pcrs []int
	for pcr := range p.PCRs {
		pcrs = append(pcrs, pcr)
	}
	sort.Ints(pcrs)
	for _, pcr := range pcrs {
		v := p.PCRs[pcr]
		meas.Content = append(meas.Content, scalar(strconv.Itoa(pcr)), &yaml.Node{Kind: yaml.MappingNode, Content: []*yaml.Node{
			scalar("expected"), scalar(hex.EncodeToString(v[:])),
			scalar("source"), scalar(source + ", " + what[pcr]),
		}})
	}
	doc := &yaml.Node{Kind: yaml.MappingNode, Content: []*yaml.Node{scalar("variant"), scalar("tpm"), scalar("measurements"), meas}}
	doc.HeadComment = "Expected measurements of a unified kernel image, computed by berth policy measure.\n" +
		"Merge them into a cluster policy with berth policy merge; firmware PCRs are not covered."
	return encodeYAML(&yaml.Node{Kind: yaml.DocumentNode, Content: []*yaml.Node{doc}})
}

// encodeYAML writes a document with two-space indentation, as policy files are written by hand.
func encodeYAML(doc *yaml.Node) ([]byte, error) {
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(doc); err != nil {
		return nil, fmt.Errorf("encoding YAML: %w", err)
	}
	if err := enc.Close(); err != nil {
		return nil, fmt.Errorf("encoding YAML: %w", err)
	}
	return buf.Bytes(), nil
}

func scalar(v string) *yaml.Node { return &yaml.Node{Kind: yaml.ScalarNode, Value: v} }

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
			out, err := mergePolicy(policyPath, measurementsPath, keep)
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

// mergePolicy returns the policy at policyPath with the measurements of measurementsPath merged in.
func mergePolicy(policyPath, measurementsPath string, keep bool) ([]byte, error) {
	base, err := policy.Load(policyPath)
	if err != nil {
		return nil, err
	}
	add, err := policy.Load(measurementsPath)
	if err != nil {
		return nil, err
	}
	if base.Variant != add.Variant {
		return nil, fmt.Errorf("%s is for variant %s, %s for %s", policyPath, base.Variant, measurementsPath, add.Variant)
	}
	raw, err := os.ReadFile(policyPath)
	if err != nil {
		return nil, fmt.Errorf("reading policy: %w", err)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(raw, &doc); err != nil || len(doc.Content) != 1 || doc.Content[0].Kind != yaml.MappingNode {
		return nil, fmt.Errorf("%s is not a YAML mapping", policyPath)
	}
	root := doc.Content[0]
	var meas *yaml.Node
	for i := 0; i+1 < len(root.Content); i += 2 {
		if root.Content[i].Value == "measurements" {
			meas = root.Content[i+1]
		}
	}
	if meas == nil || meas.Kind != yaml.MappingNode {
		meas = &yaml.Node{Kind: yaml.MappingNode}
		root.Content = append(root.Content, scalar("measurements"), meas)
	}
	old := map[uint32]policy.Expectation{}
	for _, e := range base.Expectations {
		old[e.Index] = e
	}
	for _, e := range add.Expectations {
		values := e.AnyOf
		if prev, ok := old[e.Index]; keep && ok && !prev.NonZero && !e.NonZero {
			for _, v := range prev.AnyOf {
				if !containsBytes(values, v) {
					values = append(values, v)
				}
			}
		}
		val := &yaml.Node{Kind: yaml.MappingNode}
		switch {
		case e.NonZero:
			val.Content = append(val.Content, scalar("nonZero"), &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!bool", Value: "true"})
		case len(values) == 1:
			val.Content = append(val.Content, scalar("expected"), scalar(hex.EncodeToString(values[0])))
		default:
			list := &yaml.Node{Kind: yaml.SequenceNode}
			for _, v := range values {
				list.Content = append(list.Content, scalar(hex.EncodeToString(v)))
			}
			val.Content = append(val.Content, scalar("anyOf"), list)
		}
		if e.Mode == policy.Warn {
			val.Content = append(val.Content, scalar("mode"), scalar("warn"))
		}
		val.Content = append(val.Content, scalar("source"), scalar(e.Source))
		key := strconv.FormatUint(uint64(e.Index), 10)
		replaced := false
		for i := 0; i+1 < len(meas.Content); i += 2 {
			if meas.Content[i].Value == key {
				meas.Content[i+1], replaced = val, true
			}
		}
		if !replaced {
			meas.Content = append(meas.Content, scalar(key), val)
		}
	}
	out, err := encodeYAML(&doc)
	if err != nil {
		return nil, err
	}
	dir := filepath.Dir(policyPath)
	if _, err := policy.Parse(out, policyPath+" (merged)", func(name string) ([]byte, error) {
		if !filepath.IsAbs(name) {
			name = filepath.Join(dir, name)
		}
		return os.ReadFile(name)
	}); err != nil {
		return nil, fmt.Errorf("the merged policy is invalid: %w", err)
	}
	return out, nil
}

func containsBytes(list [][]byte, v []byte) bool {
	for _, x := range list {
		if bytes.Equal(x, v) {
			return true
		}
	}
	return false
}

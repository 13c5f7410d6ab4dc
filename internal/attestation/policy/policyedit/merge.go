package policyedit

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"

	"go.yaml.in/yaml/v3"

	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/uki"
)

// Measurements renders a unified kernel image's predicted PCR values as a tpm policy with one
// expectation per PCR; source says where the values come from (each expectation's source starts
// with it).
func Measurements(p *uki.Prediction, source string, phase *Phase) ([]byte, error) {
	what := map[int]string{
		4:  "PCR 4: boot-manager events, Authenticode of the UKI and its kernel",
		9:  "PCR 9: the kernel's measurement of its load options (.cmdline) and the initrd",
		11: "PCR 11: systemd-stub's measurement of the UKI's sections",
		12: "PCR 12: zero, no command line override, credentials or add-ons",
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
	if phase != nil {
		seq := &yaml.Node{Kind: yaml.SequenceNode, Content: []*yaml.Node{
			scalar(hex.EncodeToString(make([]byte, len(phase.Open)))), scalar(hex.EncodeToString(phase.Open)),
		}}
		meas.Content = append(meas.Content, scalar(strconv.Itoa(phase.PCR)), &yaml.Node{Kind: yaml.MappingNode, Content: []*yaml.Node{
			scalar("anyOf"), seq,
			scalar("source"), scalar(fmt.Sprintf("PCR %d: the node's boot phase, zero before its state disk is open (rejoin, recovery), the second value after (init, join, workloads)", phase.PCR)),
		}})
	}
	doc := &yaml.Node{Kind: yaml.MappingNode, Content: []*yaml.Node{scalar("variant"), scalar("tpm"), scalar("measurements"), meas}}
	doc.HeadComment = "Expected measurements of a unified kernel image, computed by berth policy measure.\n" +
		"Merge them into a cluster policy with berth policy merge; firmware PCRs are not covered."
	return encode(&yaml.Node{Kind: yaml.DocumentNode, Content: []*yaml.Node{doc}})
}

// Phase is the boot phase register of the image's nodes: PCR is zero until the boot stage opened the
// state disk and holds Open after (vtpm.ExpectedPhaseValue).
type Phase struct {
	PCR  int
	Open []byte
}

// Merge returns the policy at policyPath with the expectations of the policy at measurementsPath in
// place of its expectations for the same indices; everything else (other indices, trust roots, the
// tdx section, comments) stays. With keep the values the policy expected so far stay accepted too
// (anyOf), for a rolling update from one image to the next. Both must name the same variant, and the
// result must be a valid policy.
func Merge(policyPath, measurementsPath string, keep bool) ([]byte, error) {
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
	out, err := encode(&doc)
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

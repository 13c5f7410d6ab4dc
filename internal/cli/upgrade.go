package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/k8sversion"
	"github.com/berth-k8s/berth/internal/machines"
	"github.com/berth-k8s/berth/internal/upgradeplan"
)

func newUpgradeCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:     "upgrade",
		Short:   "Plan moving a running cluster to a new Kubernetes release or measurement policy",
		Example: `  berth upgrade plan --policy next-policy.yaml`,
		Args:    cobra.NoArgs,
		RunE:    groupHelp,
	}
	cmd.AddCommand(newUpgradePlanCmd())
	return cmd
}

func newUpgradePlanCmd() *cobra.Command {
	var kube kubeOptions
	var output outputFormat
	var target, policyPath, namespace string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "plan",
		Short: "Show what an upgrade would change, without changing anything",
		Long: `berth upgrade plan reads the cluster and shows what an upgrade would do. It changes nothing.

  versions  the API server's and every node's kubelet's Kubernetes version, the target release,
            the etcd and CoreDNS versions running and those the target's kubeadm names. A target
            Berth does not build, older than what runs, or more than one minor ahead of the API
            server or of a kubelet is refused (exit code 2).
  order     the control planes one at a time, each holding the control-plane slot (the Lease that
            control-plane joins and certificate renewals take), then the workers, drained first.
  policy    the cluster's measurement policy (the join ConfigMap's) and --policy, index by index,
            and the admitted machines the new policy would refuse, judged on the evidence the
            cluster recorded for each (kubectl get machines), as berth policy diff judges it.

Berth's own objects in berth-system are not compared: building them takes the cluster Secret,
which a plan does not read.

Supported Kubernetes versions: ` + k8sversion.SupportedList() + `.`,
		Example: `  berth upgrade plan
  berth upgrade plan --kubernetes-version v1.37 --policy next-policy.yaml
  berth upgrade plan --policy next-policy.yaml -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			opts := upgradeplan.Options{Namespace: namespace, Target: target}
			if _, err := k8sversion.Lookup(target); err != nil {
				return &exitError{code: exitUsage, err: err}
			}
			if policyPath != "" {
				p, err := policy.Load(policyPath)
				if err != nil {
					return &exitError{code: exitUsage, err: err}
				}
				opts.NewPolicy, opts.NewPolicySource = p, policyPath
			}
			client, rc, err := kube.clients()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			plan, err := upgradeplan.Plan(ctx, client, rc, opts)
			if errors.Is(err, upgradeplan.ErrDowngrade) || errors.Is(err, upgradeplan.ErrMinorSkip) || errors.Is(err, k8sversion.ErrUnsupported) {
				return &exitError{code: exitUsage, err: err}
			}
			if err != nil {
				return err
			}
			if output.structured() {
				return output.encode(cmd.OutOrStdout(), plan)
			}
			printUpgradePlan(cmd.OutOrStdout(), plan)
			return nil
		},
	}
	f := cmd.Flags()
	kube.addFlags(f)
	addOutputFlag(f, &output)
	f.StringVar(&target, "kubernetes-version", "", "the Kubernetes release or minor to move to (default "+k8sversion.Default().Kubernetes+")")
	f.StringVar(&policyPath, "policy", "", "the measurement policy the upgrade would put in force (default: keep the cluster's)")
	f.StringVarP(&namespace, "namespace", "n", joinconfig.Namespace, "namespace of Berth's components")
	f.DurationVar(&timeout, "timeout", 30*time.Second, "how long to wait for the API server")
	return cmd
}

func printUpgradePlan(out io.Writer, p upgradeplan.Report) {
	k := p.Kubernetes
	_, _ = fmt.Fprintf(out, "KUBERNETES: %s -> %s (%s)\n", printable(k.APIServer), k.Target, k.Change)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "  NODE\tROLE\tKUBELET\tTARGET")
	for _, n := range k.Nodes {
		_, _ = fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\n", printable(n.Node), n.Role, printable(n.Kubelet), k.Target)
	}
	_, _ = fmt.Fprintln(tw, "  COMPONENT\tRUNNING\tTARGET\t")
	for _, c := range k.Components {
		running := "not found"
		if len(c.Current) > 0 {
			running = printable(strings.Join(c.Current, ", "))
		}
		_, _ = fmt.Fprintf(tw, "  %s\t%s\t%s\t\n", c.Name, running, c.Target)
	}
	_ = tw.Flush()

	_, _ = fmt.Fprintf(out, "\nORDER: control planes one at a time, each holding the control-plane slot; then workers, drained first\n")
	for _, s := range p.Order {
		if s.Gate == upgradeplan.GateControlPlaneSlot {
			_, _ = fmt.Fprintf(out, "  %d. %s  control plane, alone: holds the Lease %s\n", s.Step, printable(s.Node), s.Lease)
			continue
		}
		_, _ = fmt.Fprintf(out, "  %d. %s  worker, drained first\n", s.Step, printable(s.Node))
	}

	pc := p.Policy
	switch {
	case pc.Source == "":
		_, _ = fmt.Fprintf(out, "\nMEASUREMENT POLICY: the cluster's is kept (variant %s)\n", pc.Variant)
	case !pc.Changed:
		_, _ = fmt.Fprintf(out, "\nMEASUREMENT POLICY: %s expects what the cluster's does (variant %s)\n", printable(pc.Source), pc.Variant)
	default:
		_, _ = fmt.Fprintf(out, "\nMEASUREMENT POLICY: the cluster's (variant %s) -> %s (variant %s)\n", pc.Variant, printable(pc.Source), pc.NewVariant)
	}
	tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "  INDEX\tCLUSTER\tNEW\t")
	for _, m := range pc.Measurements {
		mark := ""
		if m.Changed {
			mark = "changed"
		}
		_, _ = fmt.Fprintf(tw, "  %d\t%s\t%s\t%s\n", m.Index, orNone(m.Before), orNone(m.After), mark)
	}
	_ = tw.Flush()
	if pc.Machines == nil {
		return
	}
	d := *pc.Machines
	_, _ = fmt.Fprintf(out, "\nJudged the recorded evidence of %d admitted machines.\n", d.Judged)
	_, _ = fmt.Fprintf(out, "REFUSED BY THE NEW POLICY: %d\n", len(d.NewlyRefused))
	tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	for _, v := range d.NewlyRefused {
		_, _ = fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\n", printable(v.Node), machines.Short(v.Identity), printable(v.Role), printable(oneLine(v.Reason)))
	}
	_ = tw.Flush()
	_, _ = fmt.Fprintf(out, "ACCEPTED AGAIN BY THE NEW POLICY: %d\n", len(d.NewlyAccepted))
	tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	for _, v := range d.NewlyAccepted {
		_, _ = fmt.Fprintf(tw, "  %s\t%s\t%s\n", printable(v.Node), machines.Short(v.Identity), printable(v.Role))
	}
	_ = tw.Flush()
	_, _ = fmt.Fprintf(out, "NOT JUDGED: %d\n", len(d.Unjudged))
	tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	for _, v := range d.Unjudged {
		_, _ = fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\n", printable(v.Node), machines.Short(v.Identity), printable(v.Role), printable(oneLine(v.Reason)))
	}
	_ = tw.Flush()
}

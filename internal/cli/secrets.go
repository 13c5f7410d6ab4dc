package cli

import (
	"context"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/kmsplugin"
	"github.com/berth-k8s/berth/internal/kmsrotate"
	"github.com/berth-k8s/berth/internal/kmsstate"
)

func newSecretsCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "secrets",
		Short: "Secrets at rest: the control planes' KMS key and its rotation",
		Long: `Every control plane's API server encrypts Secrets in etcd through a KMS v2 plugin the
bootstrapper runs next to it; the plugin's key-encryption key is derived from the cluster's master
secret. These commands show the plugins' state and rotate the key.`,
		Example: `  berth secrets status
  berth secrets rotate-key`,
		Args: cobra.NoArgs,
		RunE: groupHelp,
	}
	cmd.AddCommand(newSecretsStatusCmd(), newRotateKeyCmd())
	return cmd
}

func newRotateKeyCmd() *cobra.Command {
	var kube kubeOptions
	var output outputFormat
	var stepTimeout, timeout time.Duration
	cmd := &cobra.Command{
		Use:   "rotate-key",
		Short: "Move the Secrets at rest to a new key-encryption key and retire the old one",
		Long: `berth secrets rotate-key moves the cluster to the next generation of the KMS plugins' key-encryption
key (derived from the master secret with its own label, so no earlier key tells anything about it):

  1. every control plane's plugin gets the new key; the old one stays active
  2. the new key becomes active: every API server encrypts new data under it
  3. every Secret still stored under an older key is rewritten (an update without a change, which
     the API server stores under its current key), until a scan of etcd finds none
  4. the old key is retired from every plugin

It waits at each step until every control plane reports that it got there (ConfigMap
berth-system/berth-kms). API servers keep serving throughout: they read under both keys until step
4. A rewrite changes a Secret's resourceVersion as any write does. Interrupted, the same command
resumes where it stopped. Progress goes to stderr, the result to stdout (-o json|yaml for scripts).`,
		Example: `  berth secrets rotate-key
  berth secrets rotate-key --kubeconfig admin.conf -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			client, err := kube.client()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			res, err := kmsrotate.Rotate(ctx, client, kmsrotate.Options{StepTimeout: stepTimeout, Progress: cmd.ErrOrStderr()})
			if err != nil {
				return fmt.Errorf("rotating the KMS key: %w", err)
			}
			if output.structured() {
				return output.encode(cmd.OutOrStdout(), rotateReport{
					From: res.From, To: res.To, FromKeyIDs: res.FromKeyIDs, ToKeyID: res.ToKeyID, ControlPlanes: res.ControlPlanes,
					Rewritten: res.Rewritten, Scans: res.Scans, Objects: res.Objects, NotEncrypted: res.NotEncrypted,
					TookSeconds: res.Took.Seconds(),
				})
			}
			_, _ = fmt.Fprintf(cmd.OutOrStdout(), "KMS key rotated to generation %d (%s) on %s in %s: %d Secrets rewritten, %d stored, none under an older key.\n",
				res.To, res.ToKeyID, strings.Join(res.ControlPlanes, ", "), res.Took.Round(100*time.Millisecond), res.Rewritten, res.Objects)
			return nil
		},
	}
	f := cmd.Flags()
	kube.addFlags(f)
	addOutputFlag(f, &output)
	f.DurationVar(&stepTimeout, "step-timeout", 3*time.Minute, "how long to wait for every control plane at each step")
	f.DurationVar(&timeout, "timeout", 20*time.Minute, "how long the whole rotation may take")
	return cmd
}

// rotateReport is what berth secrets rotate-key -o json|yaml prints. Its field names are stable.
type rotateReport struct {
	// From is the oldest generation the rotation retired, To the one now active.
	From uint32 `json:"from"`
	To   uint32 `json:"to"`
	// FromKeyIDs are the retired generations' key IDs, ToKeyID the active one's.
	FromKeyIDs []string `json:"fromKeyIDs"`
	ToKeyID    string   `json:"toKeyID"`
	// ControlPlanes are the nodes whose plugins followed.
	ControlPlanes []string `json:"controlPlanes"`
	// Rewritten counts the Secrets rewritten under the new key, Scans the etcd scans, Objects what the
	// last scan read (all under ToKeyID), NotEncrypted the stored Secrets the plugin did not encrypt.
	Rewritten    int     `json:"rewritten"`
	Scans        int     `json:"scans"`
	Objects      int     `json:"objects"`
	NotEncrypted int     `json:"notEncrypted"`
	TookSeconds  float64 `json:"tookSeconds"`
}

func newSecretsStatusCmd() *cobra.Command {
	var kube kubeOptions
	var output outputFormat
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the KMS plugins: health, key IDs, the key every API server encrypts under",
		Long: `berth secrets status prints the API server's kms-providers health check and what every control
plane's keeper reports about its KMS plugin (ConfigMap berth-system/berth-kms): whether its
self-test (encrypt and decrypt under the active key) passes, the key generations it holds, the key
ID it encrypts under and the one its API server writes under. berth status prints the same section.`,
		Example: `  berth secrets status
  berth secrets status -o json | jq '.controlPlanes[] | select(.healthy | not)'`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			client, err := kube.client()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			r, err := readEncryption(ctx, client, time.Now())
			if err != nil {
				return err
			}
			if output.structured() {
				return output.encode(cmd.OutOrStdout(), r)
			}
			printEncryption(cmd.OutOrStdout(), r, time.Now())
			return nil
		},
	}
	f := cmd.Flags()
	kube.addFlags(f)
	addOutputFlag(f, &output)
	f.DurationVar(&timeout, "timeout", 30*time.Second, "how long to wait for the API server")
	return cmd
}

// encryptionReport is the encryption-at-rest section of berth status and berth secrets status
// (-o json|yaml). Its field names are stable.
type encryptionReport struct {
	// Provider names the KMS v2 provider and what it encrypts.
	Provider  string   `json:"provider"`
	Resources []string `json:"resources"`
	// APIServerCheck is the API server's kms-providers readiness check: "ok", or why it fails.
	APIServerCheck string `json:"apiServerCheck"`
	// Healthy is true when that check passes and every control plane's plugin reports healthy.
	Healthy bool `json:"healthy"`
	// Generations and Active are the key spec; Rotating says a rotation has not finished.
	Generations []uint32 `json:"generations"`
	Active      uint32   `json:"active"`
	Rotating    bool     `json:"rotating"`
	// ControlPlanes are the keepers' reports, by node name.
	ControlPlanes []encryptionNode `json:"controlPlanes"`
}

type encryptionNode struct {
	Node         string    `json:"node"`
	Healthy      bool      `json:"healthy"`
	Generations  []uint32  `json:"generations"`
	ActiveKeyID  string    `json:"activeKeyID"`
	EncryptKeyID string    `json:"encryptKeyID"`
	Message      string    `json:"message,omitempty"`
	Updated      time.Time `json:"updated"`
}

// staleReport is how old a keeper's report may be before the section calls the plugin unhealthy: a
// keeper writes at least once a minute.
const staleReport = 3 * time.Minute

func readEncryption(ctx context.Context, client kubernetes.Interface, now time.Time) (encryptionReport, error) {
	st, err := kmsstate.Read(ctx, client)
	if err != nil {
		return encryptionReport{}, err
	}
	r := encryptionReport{
		Provider: "KMS v2 plugin " + kmsplugin.ProviderName, Resources: kmsplugin.EncryptedResources,
		Generations: st.Spec.Generations, Active: st.Spec.Active, Rotating: len(st.Spec.Generations) > 1,
		ControlPlanes: []encryptionNode{}, APIServerCheck: "ok",
	}
	if rc := client.Discovery().RESTClient(); rc == nil {
		r.APIServerCheck = "unknown (no REST client)"
	} else if _, err := rc.Get().AbsPath("/readyz/kms-providers").DoRaw(ctx); err != nil {
		r.APIServerCheck = "failing: " + oneLine(err.Error())
		if ctx.Err() != nil {
			return encryptionReport{}, fmt.Errorf("asking the API server's kms-providers check: %w", ctx.Err())
		}
	}
	r.Healthy = r.APIServerCheck == "ok"
	for name, ns := range st.Nodes {
		n := encryptionNode{Node: name, Healthy: ns.Healthy, Generations: ns.Generations, ActiveKeyID: ns.ActiveKeyID,
			EncryptKeyID: ns.EncryptKeyID, Message: ns.Message, Updated: ns.Updated}
		if n.Generations == nil {
			n.Generations = []uint32{}
		}
		if age := now.Sub(ns.Updated); age > staleReport {
			n.Healthy = false
			n.Message = strings.TrimPrefix(n.Message+"; no report for "+age.Round(time.Second).String(), "; ")
		}
		r.Healthy = r.Healthy && n.Healthy
		r.ControlPlanes = append(r.ControlPlanes, n)
	}
	sort.Slice(r.ControlPlanes, func(i, j int) bool { return r.ControlPlanes[i].Node < r.ControlPlanes[j].Node })
	if len(r.ControlPlanes) == 0 {
		r.Healthy = false
	}
	return r, nil
}

// printEncryption prints the section: one summary line, then a line per control plane.
func printEncryption(out io.Writer, r encryptionReport, now time.Time) {
	state := "healthy"
	if !r.Healthy {
		state = "UNHEALTHY"
	}
	rotation := fmt.Sprintf("key generation %d", r.Active)
	if r.Rotating {
		rotation = fmt.Sprintf("rotation in progress (generations %v, active %d)", r.Generations, r.Active)
	}
	_, _ = fmt.Fprintf(out, "Encryption at rest (%s through the %s): %s; API server kms-providers check %s; %s.\n",
		strings.Join(r.Resources, ", "), r.Provider, state, r.APIServerCheck, rotation)
	if len(r.ControlPlanes) == 0 {
		_, _ = fmt.Fprintln(out, "No control plane has reported its KMS plugin (ConfigMap berth-system/berth-kms).")
		return
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "NODE\tPLUGIN\tACTIVE KEY ID\tAPI SERVER WRITES UNDER\tGENERATIONS\tREPORTED\tMESSAGE")
	for _, n := range r.ControlPlanes {
		health := "healthy"
		if !n.Healthy {
			health = "UNHEALTHY"
		}
		gens := make([]string, 0, len(n.Generations))
		for _, g := range slices.Sorted(slices.Values(n.Generations)) {
			gens = append(gens, fmt.Sprint(g))
		}
		row := []string{n.Node, health, dash(n.ActiveKeyID), dash(n.EncryptKeyID), dash(strings.Join(gens, ",")),
			now.Sub(n.Updated).Round(time.Second).String() + " ago", dash(oneLine(n.Message))}
		for i := range row {
			row[i] = printable(row[i]) // keepers write these; escape them anyway
		}
		_, _ = fmt.Fprintln(tw, strings.Join(row, "\t"))
	}
	_ = tw.Flush()
}

// encryptionSection is berth status's encryption-at-rest section: the report, or nil and why it
// could not be read.
func encryptionSection(ctx context.Context, client kubernetes.Interface) (*encryptionReport, error) {
	r, err := readEncryption(ctx, client, time.Now())
	if err != nil {
		return nil, err
	}
	return &r, nil
}

// printEncryptionSection prints berth status's section, or why it is missing.
func printEncryptionSection(out io.Writer, r *encryptionReport, err error) {
	_, _ = fmt.Fprintln(out)
	if err != nil {
		_, _ = fmt.Fprintf(out, "Encryption at rest: cannot read its state: %s\n", printable(oneLine(err.Error())))
		return
	}
	printEncryption(out, *r, time.Now())
}

package supportbundle

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/records/clientset"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
)

// ErrNoOutput is returned by Collect without a writer.
var ErrNoOutput = errors.New("supportbundle: no output")

// Sources are the clients a bundle reads through.
type Sources struct {
	Kube kubernetes.Interface
	// Records is the record API's client; nil leaves Machines and JoinRecords out.
	Records clientset.Interface
}

// Options bound what a bundle holds.
type Options struct {
	// Namespace is Berth's namespace (berth-system).
	Namespace string
	// TailLines is how many of each container's latest log lines are kept (and of its previous
	// instance's, when it restarted).
	TailLines int64
	// Since, when positive, keeps only log lines younger than it.
	Since time.Duration
	// Now names the bundle's directory.
	Now time.Time
	// Extra are files the caller adds by name (berth status's report); a failing one is listed
	// in the manifest like any other problem.
	Extra map[string]func(io.Writer) error
}

// Summary is what a bundle holds.
type Summary struct {
	// Dir is the directory every file of the archive lies in.
	Dir string
	// Files are the files collected, in the archive's order after MANIFEST.txt.
	Files []string
	// Problems are what could not be collected, and why.
	Problems []string
	// LeftOut is what the bundle does not hold on purpose, and where it is.
	LeftOut []string
	// Redacted counts the values redaction replaced, by kind, and RedactedIn by file and kind.
	Redacted   map[string]int
	RedactedIn map[string]map[string]int
}

// listPage is how many objects one list request asks for.
const listPage = 500

// bundle gathers files in memory (redacted) before the archive is written, so that the manifest
// comes first.
type bundle struct {
	files    []file
	summary  Summary
	redacted map[string]int
}

type file struct {
	name string
	data []byte
}

func (b *bundle) add(name string, data []byte) {
	counts := map[string]int{}
	b.files = append(b.files, file{name: name, data: redact(data, counts)})
	for kind, n := range counts {
		b.redacted[kind] += n
		if b.summary.RedactedIn == nil {
			b.summary.RedactedIn = map[string]map[string]int{}
		}
		b.summary.RedactedIn[name] = counts
	}
}

func (b *bundle) addYAML(name string, obj any) {
	data, err := yaml.Marshal(obj)
	if err != nil {
		b.problem("%s: encoding: %v", name, err)
		return
	}
	b.add(name, data)
}

func (b *bundle) problem(format string, args ...any) {
	b.summary.Problems = append(b.summary.Problems, fmt.Sprintf(format, args...))
}

// Collect reads the cluster through src and writes the bundle to w as a gzipped tar archive. It
// fails only when the archive cannot be written; what it cannot read is listed in the summary and
// the manifest.
func Collect(ctx context.Context, w io.Writer, src Sources, opts Options) (Summary, error) {
	if w == nil {
		return Summary{}, ErrNoOutput
	}
	b := &bundle{redacted: map[string]int{}}
	b.summary.Dir = "berth-support-" + opts.Now.UTC().Format("20060102T150405Z")

	nodes, err := src.Kube.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		b.problem("nodes: %v", err)
	} else {
		b.addYAML("cluster/nodes.yaml", nodes)
	}
	if v, err := src.Kube.Discovery().ServerVersion(); err != nil {
		b.problem("the API server's version: %v", err)
	} else {
		b.add("cluster/version.txt", []byte(v.String()+"\n"))
	}
	for _, ns := range []string{opts.Namespace, metav1.NamespaceSystem} {
		b.configMaps(ctx, src.Kube, ns)
	}
	if src.Records != nil {
		b.records(ctx, src.Records, opts.Namespace, nodes)
	} else {
		b.summary.LeftOut = append(b.summary.LeftOut, "the record API (Machines, JoinRecords): no client")
	}
	b.events(ctx, src.Kube, opts.Namespace, "")
	b.events(ctx, src.Kube, metav1.NamespaceDefault, "regarding.kind=Node")
	for _, ns := range []string{opts.Namespace, metav1.NamespaceSystem} {
		b.pods(ctx, src.Kube, ns, opts)
	}
	for _, name := range slices.Sorted(maps.Keys(opts.Extra)) {
		var buf bytes.Buffer
		if err := opts.Extra[name](&buf); err != nil {
			b.problem("%s: %v", name, err)
			continue
		}
		b.add(name, buf.Bytes())
	}
	b.summary.LeftOut = append(b.summary.LeftOut,
		"Secrets of every namespace: never read (the cluster's keys, tokens and certificates' private keys)",
		"the operator's workspace (master-secret.json, admin.conf): never read",
		"each machine's own bootstrapper log (the boot stage, the join before a kubelet runs): the API server cannot reach it; on the machine: journalctl -u berth-bootstrapper (the image); for a mini cluster berth support --mini-dir adds them",
	)
	b.summary.Redacted = b.redacted
	for _, f := range b.files {
		b.summary.Files = append(b.summary.Files, f.name)
	}
	return b.summary, b.write(w, opts.Now)
}

// configMaps adds every ConfigMap of ns (Berth keeps no secret in one; kubeadm's hold its
// configuration). kube-system's are limited to kubeadm's and the kubelet's configuration.
func (b *bundle) configMaps(ctx context.Context, kube kubernetes.Interface, ns string) {
	list, err := kube.CoreV1().ConfigMaps(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		b.problem("ConfigMaps in %s: %v", ns, err)
		return
	}
	if ns == metav1.NamespaceSystem {
		keep := sets.New("kubeadm-config", "kubelet-config", "kube-proxy")
		list.Items = slices.DeleteFunc(list.Items, func(cm corev1.ConfigMap) bool { return !keep.Has(cm.Name) })
	}
	b.addYAML(ns+"/configmaps.yaml", list)
}

// records adds the Machines and JoinRecords, and names the machines the joinservice saw that are no
// node: their side of the story is only on the machine.
func (b *bundle) records(ctx context.Context, rc clientset.Interface, ns string, nodes *corev1.NodeList) {
	var machines v1alpha1.MachineList
	opts := metav1.ListOptions{Limit: listPage}
	for {
		page, err := rc.RecordsV1alpha1().Machines(ns).List(ctx, opts)
		if err != nil {
			b.problem("Machines: %v", err)
			return
		}
		machines.Items = append(machines.Items, page.Items...)
		if opts.Continue = page.Continue; opts.Continue == "" {
			break
		}
	}
	b.addYAML("records/machines.yaml", &machines)

	var joins v1alpha1.JoinRecordList
	opts = metav1.ListOptions{Limit: listPage}
	for {
		page, err := rc.RecordsV1alpha1().JoinRecords(ns).List(ctx, opts)
		if err != nil {
			b.problem("JoinRecords: %v", err)
			return
		}
		joins.Items = append(joins.Items, page.Items...)
		if opts.Continue = page.Continue; opts.Continue == "" {
			break
		}
	}
	b.addYAML("records/joinrecords.yaml", &joins)

	if nodes == nil {
		return
	}
	known := sets.New[string]()
	for _, n := range nodes.Items {
		known.Insert(n.Name)
	}
	never := sets.New[string]()
	for _, j := range joins.Items {
		if j.Spec.Node == "" || !known.Has(j.Spec.Node) {
			never.Insert(strings.TrimSpace(j.Spec.Peer + " " + j.Spec.Node))
		}
	}
	for _, m := range sets.List(never) {
		b.summary.LeftOut = append(b.summary.LeftOut, "the own log of "+m+", refused and not a node: records/joinrecords.yaml is what the joinservice saw of it")
	}
}

// events adds the Events of ns that match selector.
func (b *bundle) events(ctx context.Context, kube kubernetes.Interface, ns, selector string) {
	list, err := kube.EventsV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: selector})
	if err != nil {
		b.problem("Events in %s: %v", ns, err)
		return
	}
	b.addYAML("events/"+ns+".yaml", list)
}

// pods adds the pods of ns and each container's latest log lines (and its previous instance's).
func (b *bundle) pods(ctx context.Context, kube kubernetes.Interface, ns string, opts Options) {
	list, err := kube.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		b.problem("pods in %s: %v", ns, err)
		return
	}
	b.addYAML(ns+"/pods.yaml", list)
	for _, p := range list.Items {
		restarted := map[string]bool{}
		for _, s := range slices.Concat(p.Status.InitContainerStatuses, p.Status.ContainerStatuses) {
			restarted[s.Name] = s.RestartCount > 0
		}
		for _, c := range slices.Concat(p.Spec.InitContainers, p.Spec.Containers) {
			b.log(ctx, kube, p, c.Name, false, opts)
			if restarted[c.Name] {
				b.log(ctx, kube, p, c.Name, true, opts)
			}
		}
	}
}

func (b *bundle) log(ctx context.Context, kube kubernetes.Interface, p corev1.Pod, container string, previous bool, opts Options) {
	lo := &corev1.PodLogOptions{Container: container, Previous: previous, Timestamps: true}
	if opts.TailLines > 0 {
		lo.TailLines = &opts.TailLines
	}
	if opts.Since > 0 {
		s := int64(opts.Since.Seconds())
		lo.SinceSeconds = &s
	}
	name := fmt.Sprintf("logs/%s/%s/%s.log", p.Namespace, p.Name, container)
	if previous {
		name = fmt.Sprintf("logs/%s/%s/%s.previous.log", p.Namespace, p.Name, container)
	}
	data, err := kube.CoreV1().Pods(p.Namespace).GetLogs(p.Name, lo).DoRaw(ctx)
	if err != nil {
		b.problem("%s: %v", name, err)
		return
	}
	b.add(name, data)
}

// write writes the manifest and every file into a gzipped tar archive.
func (b *bundle) write(w io.Writer, now time.Time) error {
	gz := gzip.NewWriter(w)
	tw := tar.NewWriter(gz)
	put := func(name string, data []byte) error {
		hdr := &tar.Header{Name: b.summary.Dir + "/" + name, Mode: 0o600, Size: int64(len(data)), ModTime: now, Typeflag: tar.TypeReg}
		if err := tw.WriteHeader(hdr); err != nil {
			return fmt.Errorf("writing the archive: %w", err)
		}
		if _, err := tw.Write(data); err != nil {
			return fmt.Errorf("writing the archive: %w", err)
		}
		return nil
	}
	if err := put("MANIFEST.txt", Manifest(b.summary)); err != nil {
		return err
	}
	for _, f := range b.files {
		if err := put(f.name, f.data); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return fmt.Errorf("writing the archive: %w", err)
	}
	if err := gz.Close(); err != nil {
		return fmt.Errorf("writing the archive: %w", err)
	}
	return nil
}

// Manifest is the text of the bundle's MANIFEST.txt.
func Manifest(s Summary) []byte {
	var m bytes.Buffer
	fmt.Fprintf(&m, "Berth support bundle %s\n\nFiles (%d):\n", s.Dir, len(s.Files))
	for _, f := range s.Files {
		fmt.Fprintf(&m, "  %s\n", f)
	}
	fmt.Fprintf(&m, "\nCould not be collected (%d):\n", len(s.Problems))
	for _, p := range s.Problems {
		fmt.Fprintf(&m, "  %s\n", p)
	}
	fmt.Fprintf(&m, "\nLeft out on purpose:\n")
	for _, l := range s.LeftOut {
		fmt.Fprintf(&m, "  %s\n", l)
	}
	fmt.Fprintf(&m, "\nRedacted values (replaced by [REDACTED ...]):")
	if len(s.Redacted) == 0 {
		fmt.Fprintf(&m, " none\n")
	} else {
		m.WriteString("\n")
		for _, k := range slices.Sorted(maps.Keys(s.Redacted)) {
			fmt.Fprintf(&m, "  %s: %d\n", k, s.Redacted[k])
		}
		m.WriteString("in:\n")
		for _, f := range slices.Sorted(maps.Keys(s.RedactedIn)) {
			var kinds []string
			for _, k := range slices.Sorted(maps.Keys(s.RedactedIn[f])) {
				kinds = append(kinds, fmt.Sprintf("%s %d", k, s.RedactedIn[f][k]))
			}
			fmt.Fprintf(&m, "  %s: %s\n", f, strings.Join(kinds, ", "))
		}
	}
	return m.Bytes()
}

// TailFile is an Options.Extra file: the last n lines of the file at path (all of them when n is 0
// or less), for logs the API server cannot reach, such as a mini cluster's node logs.
func TailFile(path string, n int64) func(io.Writer) error {
	return func(w io.Writer) error {
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if n > 0 {
			lines := bytes.SplitAfter(data, []byte("\n"))
			if len(lines) > 0 && len(lines[len(lines)-1]) == 0 {
				lines = lines[:len(lines)-1]
			}
			if int64(len(lines)) > n {
				data = bytes.Join(lines[int64(len(lines))-n:], nil)
			}
		}
		_, err = w.Write(data)
		return err
	}
}

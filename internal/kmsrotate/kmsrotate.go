// Package kmsrotate rotates the control planes' KMS key-encryption key (`berth secrets rotate-key`):
// a new generation, every encrypted object rewritten under it, the old generation retired. It drives
// the key spec in berth-system/berth-kms (internal/kmsstate) and waits, at every step, for every
// control plane's keeper (bootstrapper/kmskeeper) to report that it got there:
//
//  1. prepare   spec {[N, N+1], N}: every plugin holds the new key, still encrypts under the old one.
//     Until every plugin can decrypt under N+1, no API server may write under it: another control
//     plane's API server must read what this one writes.
//  2. activate  spec {[N, N+1], N+1}: every plugin encrypts under N+1, and every API server has made
//     a data-encryption key under it (its plugin answered an Encrypt for N+1; the keeper asks the API
//     server's kms-providers check so that it notices within seconds).
//  3. rewrite   a control plane scans its etcd; every object still under an older key is updated
//     through the API without a change, which the API server stores again under its current key (it
//     marks a value read under an older key ID stale and writes it even when nothing changed). Scan
//     and rewrite repeat until the scan finds nothing under an older key.
//  4. retire    spec {[N+1], N+1}: every plugin drops N. A keeper scans its etcd once more first and
//     keeps a generation anything is still stored under.
//
// Clients keep working throughout: every API server reads under both keys until step 4, and a
// rewrite is an ordinary update (it changes the object's resourceVersion, as any write does, so a
// client that updates with a stale resourceVersion gets a conflict and retries, as it must anyway).
// Running it again after an interruption resumes where the spec stands.
package kmsrotate

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"

	"github.com/berth-k8s/berth/internal/etcdscan"
	"github.com/berth-k8s/berth/internal/kmsstate"
)

// ControlPlaneLabel marks the control-plane nodes (kubeadm sets it).
const ControlPlaneLabel = "node-role.kubernetes.io/control-plane"

// Named failures.
var (
	// ErrNoControlPlanes: no node carries ControlPlaneLabel.
	ErrNoControlPlanes = errors.New("no control-plane nodes")
	// ErrNotReached: a control plane did not report the step within the step timeout.
	ErrNotReached = errors.New("control planes did not get there in time")
	// ErrDisagree: control planes report different key IDs for one generation (their keys differ).
	ErrDisagree = errors.New("control planes disagree about a generation's key")
	// ErrStillStored: passes of scans and rewrites left objects under an older key.
	ErrStillStored = errors.New("objects are still stored under an older key")
)

// Options tune Rotate.
type Options struct {
	// StepTimeout bounds each wait for the control planes (default 3 minutes: an API server notices a
	// new key ID at the latest a minute after its plugin reports it).
	StepTimeout time.Duration
	// Poll is how often the spec's ConfigMap is read while waiting (default 1 s).
	Poll time.Duration
	// Passes bounds the scan-and-rewrite passes (default 5).
	Passes int
	// Progress receives one line per step; nil discards them.
	Progress io.Writer
}

// Result says what a rotation did.
type Result struct {
	// From and To are the retired and the new generation; FromKeyIDs may name several older ones
	// when an interrupted rotation is resumed.
	From, To   uint32
	FromKeyIDs []string
	ToKeyID    string
	// ControlPlanes are the nodes that followed.
	ControlPlanes []string
	// Rewritten counts the objects updated to move them under the new key; Scans the etcd scans.
	Rewritten int
	Scans     int
	// Objects is what the last scan read, all under ToKeyID.
	Objects int
	// NotEncrypted counts objects of encrypted resources that the scan found stored without the
	// plugin's encryption (none, unless something wrote etcd behind the API server's back).
	NotEncrypted int
	Took         time.Duration
}

type rotation struct {
	client kubernetes.Interface
	opts   Options
	res    Result
}

// Rotate moves the cluster's KMS key to a new generation (see the package documentation).
func Rotate(ctx context.Context, client kubernetes.Interface, opts Options) (Result, error) {
	if opts.StepTimeout == 0 {
		opts.StepTimeout = 3 * time.Minute
	}
	if opts.Poll == 0 {
		opts.Poll = time.Second
	}
	if opts.Passes == 0 {
		opts.Passes = 5
	}
	if opts.Progress == nil {
		opts.Progress = io.Discard
	}
	r := &rotation{client: client, opts: opts}
	start := time.Now()
	err := r.run(ctx)
	r.res.Took = time.Since(start)
	return r.res, err
}

func (r *rotation) say(format string, args ...any) {
	_, _ = fmt.Fprintf(r.opts.Progress, format+"\n", args...)
}

func (r *rotation) run(ctx context.Context) error {
	st, err := kmsstate.Read(ctx, r.client)
	if err != nil {
		return err
	}
	spec := st.Spec
	if len(spec.Generations) == 1 {
		from := spec.Active
		spec = kmsstate.Spec{Generations: []uint32{from, from + 1}, Active: from}
		r.say("[1/4] adding generation %d to every control plane's KMS plugin (generation %d stays active)", from+1, from)
		if err := kmsstate.ApplySpec(ctx, r.client, spec); err != nil {
			return err
		}
	} else {
		r.say("[1/4] resuming the rotation to generation %d (generations %v, active %d)", spec.Latest(), spec.Generations, spec.Active)
	}
	to := spec.Latest()
	r.res.From, r.res.To = spec.Generations[0], to
	// A plugin may hold more: a keeper keeps an older generation while anything is stored under it.
	if err := r.waitControlPlanes(ctx, "every plugin holds generations "+fmt.Sprint(spec.Generations), func(ns kmsstate.NodeStatus) bool {
		return ns.Healthy && holds(ns, spec.Generations)
	}); err != nil {
		return err
	}
	if err := r.keyIDs(ctx, spec); err != nil {
		return err
	}

	if spec.Active != to {
		spec.Active = to
		r.say("[2/4] activating generation %d: every API server encrypts new data under %s", to, r.res.ToKeyID)
		if err := kmsstate.ApplySpec(ctx, r.client, spec); err != nil {
			return err
		}
	} else {
		r.say("[2/4] generation %d is active", to)
	}
	if err := r.waitControlPlanes(ctx, "every API server encrypts under "+r.res.ToKeyID, func(ns kmsstate.NodeStatus) bool {
		return ns.Healthy && ns.Active == to && ns.ActiveKeyID == r.res.ToKeyID && ns.EncryptKeyID == r.res.ToKeyID
	}); err != nil {
		return err
	}

	r.say("[3/4] rewriting what is stored under another key than %s", r.res.ToKeyID)
	if err := r.rewrite(ctx, &spec); err != nil {
		return err
	}

	spec = kmsstate.Spec{Generations: []uint32{to}, Active: to}
	r.say("[4/4] retiring generations before %d", to)
	if err := kmsstate.ApplySpec(ctx, r.client, spec); err != nil {
		return err
	}
	return r.waitControlPlanes(ctx, "every plugin holds only generation "+strconv.FormatUint(uint64(to), 10), func(ns kmsstate.NodeStatus) bool {
		return ns.Healthy && slices.Equal(ns.Generations, spec.Generations)
	})
}

// holds reports whether ns holds every generation of gens.
func holds(ns kmsstate.NodeStatus, gens []uint32) bool {
	for _, g := range gens {
		if !slices.Contains(ns.Generations, g) {
			return false
		}
	}
	return true
}

// keyIDs reads the key IDs of the spec's generations from the reports, which must agree.
func (r *rotation) keyIDs(ctx context.Context, spec kmsstate.Spec) error {
	st, err := kmsstate.Read(ctx, r.client)
	if err != nil {
		return err
	}
	ids := map[uint32]string{}
	for node, ns := range st.Nodes {
		if !holds(ns, spec.Generations) {
			continue
		}
		for _, g := range spec.Generations {
			id := ns.KeyIDs[strconv.FormatUint(uint64(g), 10)]
			if have, ok := ids[g]; ok && have != id {
				return fmt.Errorf("%w: generation %d is %s on %s and %s elsewhere", ErrDisagree, g, id, node, have)
			}
			ids[g] = id
		}
	}
	r.res.ToKeyID = ids[spec.Latest()]
	r.res.FromKeyIDs = nil
	for _, g := range spec.Generations[:len(spec.Generations)-1] {
		r.res.FromKeyIDs = append(r.res.FromKeyIDs, ids[g])
	}
	if r.res.ToKeyID == "" {
		return fmt.Errorf("%w: no control plane reports the key ID of generation %d", ErrNotReached, spec.Latest())
	}
	return nil
}

// rewrite scans and rewrites until nothing is stored under an older key.
func (r *rotation) rewrite(ctx context.Context, spec *kmsstate.Spec) error {
	for pass := 1; pass <= r.opts.Passes; pass++ {
		rep, err := r.scan(ctx, spec)
		if err != nil {
			return err
		}
		r.res.Objects, r.res.NotEncrypted = rep.Objects, rep.NotEncrypted
		var stale []etcdscan.Object
		for _, o := range rep.Listed {
			if o.KeyID != "" && o.KeyID != r.res.ToKeyID {
				stale = append(stale, o)
			}
		}
		if len(stale) == 0 && !rep.Truncated {
			r.say("      pass %d: %d objects, all under %s", pass, rep.Objects, r.res.ToKeyID)
			if rep.NotEncrypted > 0 {
				r.say("      warning: %d objects of encrypted resources are stored unencrypted (not written through the API server)", rep.NotEncrypted)
			}
			return nil
		}
		r.say("      pass %d: %d of %d objects under an older key, rewriting them", pass, len(stale), rep.Objects)
		for _, o := range stale {
			if err := r.rewriteOne(ctx, o); err != nil {
				return err
			}
			r.res.Rewritten++
		}
	}
	return fmt.Errorf("%w after %d passes", ErrStillStored, r.opts.Passes)
}

// rewriteOne updates o without a change, so its API server stores it again under its current key.
func (r *rotation) rewriteOne(ctx context.Context, o etcdscan.Object) error {
	if o.Resource != "secrets" {
		return fmt.Errorf("rewriting %s: only Secrets are encrypted through the plugin", o.Key)
	}
	secrets := r.client.CoreV1().Secrets(o.Namespace)
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		s, err := secrets.Get(ctx, o.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		_, err = secrets.Update(ctx, s, metav1.UpdateOptions{})
		return err
	})
	if apierrors.IsNotFound(err) {
		return nil // deleted meanwhile: nothing left to move
	}
	if err != nil {
		return fmt.Errorf("rewriting Secret %s/%s: %w", o.Namespace, o.Name, err)
	}
	return nil
}

// scan asks the control planes for a scan of their etcd and returns the first answer.
func (r *rotation) scan(ctx context.Context, spec *kmsstate.Spec) (etcdscan.Report, error) {
	nonce := make([]byte, 8)
	if _, err := rand.Read(nonce); err != nil {
		return etcdscan.Report{}, fmt.Errorf("making a scan request: %w", err)
	}
	spec.Scan = hex.EncodeToString(nonce)
	if err := kmsstate.ApplySpec(ctx, r.client, *spec); err != nil {
		return etcdscan.Report{}, err
	}
	r.res.Scans++
	var res *kmsstate.ScanResult
	err := r.poll(ctx, func(st kmsstate.State) (bool, string) {
		for _, ns := range st.Nodes {
			if ns.Scan != nil && ns.Scan.Request == spec.Scan {
				res = ns.Scan
				return true, ""
			}
		}
		return false, "no control plane answered the scan request yet"
	})
	if err != nil {
		return etcdscan.Report{}, err
	}
	if res.Error != "" {
		return etcdscan.Report{}, fmt.Errorf("scanning etcd: %s", res.Error)
	}
	return res.Report, nil
}

// waitControlPlanes waits until every control-plane node's report satisfies ok.
func (r *rotation) waitControlPlanes(ctx context.Context, what string, ok func(kmsstate.NodeStatus) bool) error {
	var names []string
	err := r.poll(ctx, func(st kmsstate.State) (bool, string) {
		nodes, err := r.client.CoreV1().Nodes().List(ctx, metav1.ListOptions{LabelSelector: ControlPlaneLabel})
		if err != nil {
			return false, "listing control planes: " + err.Error()
		}
		names = names[:0]
		for _, n := range nodes.Items {
			names = append(names, n.Name)
		}
		sort.Strings(names)
		if len(names) == 0 {
			return false, ErrNoControlPlanes.Error()
		}
		var pending []string
		for _, n := range names {
			ns, found := st.Nodes[n]
			switch {
			case !found:
				pending = append(pending, n+" (no report)")
			case !ok(ns):
				p := fmt.Sprintf("%s (generations %v, active %d, healthy %v", n, ns.Generations, ns.Active, ns.Healthy)
				if ns.Message != "" {
					p += ": " + ns.Message
				}
				pending = append(pending, p+")")
			}
		}
		return len(pending) == 0, strings.Join(pending, "; ")
	})
	if err != nil {
		return fmt.Errorf("waiting until %s: %w", what, err)
	}
	r.res.ControlPlanes = names
	r.say("      %s: %s", what, strings.Join(names, ", "))
	return nil
}

// poll reads the ConfigMap until cond holds or the step timeout passes; the error then says what
// cond last reported.
func (r *rotation) poll(ctx context.Context, cond func(kmsstate.State) (bool, string)) error {
	last := ""
	err := wait.PollUntilContextTimeout(ctx, r.opts.Poll, r.opts.StepTimeout, true, func(ctx context.Context) (bool, error) {
		st, err := kmsstate.Read(ctx, r.client)
		if err != nil {
			last = err.Error()
			return false, nil
		}
		done, why := cond(st)
		last = why
		return done, nil
	})
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("%w (%s): %s", ErrNotReached, r.opts.StepTimeout, last)
	}
	return nil
}

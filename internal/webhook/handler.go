package webhook

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	admissionv1 "k8s.io/api/admission/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Path is where the handler serves admission reviews.
const Path = "/validate"

// MaxReviewBytes caps the size of an admission review body.
const MaxReviewBytes = 4 << 20

// Rule names of the decisions the handler makes without consulting the policy.
const (
	RuleExemptNamespace = "exempt-namespace"
	RuleExemptOperation = "exempt-operation"
	RuleTerminating     = "terminating-object"
	RuleSubresource     = "unhandled-subresource"
	RuleUnhandledKind   = "unhandled-kind"
	RuleNotReady        = "policy-not-loaded"
	RuleInternal        = "internal-error"
	RuleDeadline        = "deadline-exceeded"
)

// Handler answers validating admission reviews with the current image policy.
type Handler struct {
	log      *zap.Logger
	policy   atomic.Pointer[Policy]
	exempt   map[string]bool
	deadline time.Duration
	metrics  *Metrics
	// closing makes every response carry "Connection: close" (set while draining).
	closing atomic.Bool
}

// NewHandler returns a handler that exempts the given namespaces and answers within deadline.
// It denies everything it would check until SetPolicy was called.
func NewHandler(log *zap.Logger, exemptNamespaces []string, deadline time.Duration, metrics *Metrics) *Handler {
	h := &Handler{log: log, exempt: map[string]bool{}, deadline: deadline, metrics: metrics}
	for _, ns := range exemptNamespaces {
		h.exempt[ns] = true
	}
	return h
}

// SetPolicy makes p the policy of every following review.
func (h *Handler) SetPolicy(p *Policy) { h.policy.Store(p) }

// PolicyLoaded reports whether a policy was set.
func (h *Handler) PolicyLoaded() bool { return h.policy.Load() != nil }

// SetClosing makes responses ask the client to close the connection (during a drain).
func (h *Handler) SetClosing() { h.closing.Store(true) }

// ServeHTTP implements http.Handler.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	if h.closing.Load() {
		w.Header().Set("Connection", "close")
	}
	if r.Method != http.MethodPost {
		http.Error(w, "admission reviews are POSTed", http.StatusMethodNotAllowed)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.deadline)
	defer cancel()
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxReviewBytes))
	if err != nil {
		http.Error(w, "reading admission review failed", http.StatusBadRequest)
		return
	}
	var review admissionv1.AdmissionReview
	if err := json.Unmarshal(body, &review); err != nil || review.Request == nil {
		http.Error(w, "malformed admission review", http.StatusBadRequest)
		return
	}
	resp := h.decide(ctx, review.Request)
	if ctx.Err() != nil {
		resp = deny(RuleDeadline, "the image-policy webhook ran out of time; retry")
	}
	resp.UID = review.Request.UID
	apiVersion := review.APIVersion
	if apiVersion == "" {
		apiVersion = admissionv1.SchemeGroupVersion.String()
	}
	out := admissionv1.AdmissionReview{
		TypeMeta: metav1.TypeMeta{APIVersion: apiVersion, Kind: "AdmissionReview"},
		Response: resp,
	}
	data, err := json.Marshal(&out)
	if err != nil {
		http.Error(w, "encoding admission response failed", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(data)
	if h.metrics != nil {
		h.metrics.observe(resp.Allowed, ruleOf(resp), time.Since(start))
	}
}

// decide returns the response for one request; a panic becomes a denial (fail closed).
func (h *Handler) decide(ctx context.Context, req *admissionv1.AdmissionRequest) (resp *admissionv1.AdmissionResponse) {
	defer func() {
		if p := recover(); p != nil {
			h.log.Error("panic while deciding an admission review", zap.Any("panic", p), zap.String("uid", string(req.UID)))
			resp = deny(RuleInternal, "the image-policy webhook failed internally; retry or contact the cluster operator")
		}
	}()
	// Always allowed, before anything else and without a policy: exempt namespaces, deletes and
	// connects, updates of terminating objects, subresources other than ephemeralcontainers.
	switch {
	case h.exempt[req.Namespace]:
		return allow(RuleExemptNamespace)
	case req.Operation == admissionv1.Delete || req.Operation == admissionv1.Connect:
		return allow(RuleExemptOperation)
	case req.Operation == admissionv1.Update && terminating(req.OldObject.Raw):
		return allow(RuleTerminating)
	case req.SubResource != "" && req.SubResource != "ephemeralcontainers":
		return allow(RuleSubresource)
	}
	policy := h.policy.Load()
	if policy == nil {
		return deny(RuleNotReady, "the image policy is not loaded yet; retry in a few seconds")
	}
	containers, handled, err := containersOf(req.Kind.Kind, req.Object.Raw)
	if !handled {
		return allow(RuleUnhandledKind)
	}
	if err != nil {
		return deny(RuleInternal, fmt.Sprintf("the %s could not be read: %v", req.Kind.Kind, err))
	}
	var firstRule string
	for _, c := range containers {
		if ctx.Err() != nil {
			return deny(RuleDeadline, "the image-policy webhook ran out of time; retry")
		}
		v := policy.Check(c.Image)
		if !v.Allowed {
			return deny(v.Rule, fmt.Sprintf("image %q of container %q is not allowed by image policy rule %q: %s", c.Image, c.Name, v.Rule, v.Reason))
		}
		if firstRule == "" {
			firstRule = v.Rule
		}
	}
	return allow(firstRule)
}

func allow(rule string) *admissionv1.AdmissionResponse {
	return &admissionv1.AdmissionResponse{Allowed: true, AuditAnnotations: map[string]string{"rule": rule}}
}

func deny(rule, msg string) *admissionv1.AdmissionResponse {
	return &admissionv1.AdmissionResponse{
		Result:           &metav1.Status{Status: metav1.StatusFailure, Code: http.StatusForbidden, Reason: metav1.StatusReasonForbidden, Message: msg},
		AuditAnnotations: map[string]string{"rule": rule},
	}
}

func ruleOf(resp *admissionv1.AdmissionResponse) string {
	if r := resp.AuditAnnotations["rule"]; r != "" {
		return r
	}
	return "none"
}

// terminating reports whether the old object carries a deletionTimestamp.
func terminating(old []byte) bool {
	if len(old) == 0 {
		return false
	}
	var o struct {
		Metadata struct {
			DeletionTimestamp *string `json:"deletionTimestamp"`
		} `json:"metadata"`
	}
	return json.Unmarshal(old, &o) == nil && o.Metadata.DeletionTimestamp != nil
}

type container struct {
	Name  string `json:"name"`
	Image string `json:"image"`
}

type podSpec struct {
	Containers          []container `json:"containers"`
	InitContainers      []container `json:"initContainers"`
	EphemeralContainers []container `json:"ephemeralContainers"`
}

func (s podSpec) all() []container {
	out := make([]container, 0, len(s.Containers)+len(s.InitContainers)+len(s.EphemeralContainers))
	out = append(out, s.InitContainers...)
	out = append(out, s.Containers...)
	return append(out, s.EphemeralContainers...)
}

var errNoObject = errors.New("the review carries no object")

// containersOf returns the containers of a pod or of a workload's pod template; handled is false for
// kinds the webhook does not check.
func containersOf(kind string, raw []byte) (cs []container, handled bool, err error) {
	switch kind {
	case "Pod":
		var o struct {
			Spec podSpec `json:"spec"`
		}
		err = unmarshalObject(raw, &o)
		return o.Spec.all(), true, err
	case "Deployment", "ReplicaSet", "StatefulSet", "DaemonSet", "Job", "ReplicationController":
		var o struct {
			Spec struct {
				Template struct {
					Spec podSpec `json:"spec"`
				} `json:"template"`
			} `json:"spec"`
		}
		err = unmarshalObject(raw, &o)
		return o.Spec.Template.Spec.all(), true, err
	case "CronJob":
		var o struct {
			Spec struct {
				JobTemplate struct {
					Spec struct {
						Template struct {
							Spec podSpec `json:"spec"`
						} `json:"template"`
					} `json:"spec"`
				} `json:"jobTemplate"`
			} `json:"spec"`
		}
		err = unmarshalObject(raw, &o)
		return o.Spec.JobTemplate.Spec.Template.Spec.all(), true, err
	}
	return nil, false, nil
}

func unmarshalObject(raw []byte, v any) error {
	if len(strings.TrimSpace(string(raw))) == 0 {
		return errNoObject
	}
	return json.Unmarshal(raw, v)
}

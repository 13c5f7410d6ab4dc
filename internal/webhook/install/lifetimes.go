package install

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/berth-k8s/berth/internal/webhookconfig"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// Default validity periods of the webhook's certificates.
const (
	DefaultLeafValidity = 365 * 24 * time.Hour
	DefaultCAValidity   = 10 * 365 * 24 * time.Hour
	// DefaultCheckPeriod is how often the keeper checks the trust chain when nothing changes.
	DefaultCheckPeriod = time.Minute
)

// caMarginCap caps the margin a CA rotation starts before the CA's last leaf would outlive it.
const caMarginCap = 90 * 24 * time.Hour

// outlivesSlack: a certificate valid for more than its configured validity plus this fraction of it
// (validity/outlivesSlack) is re-issued, so that shortening a validity takes effect at once without a
// clock skew between two replicas of the keeper making it re-issue every time.
const outlivesSlack = 10

// Lifetimes are the validity periods of the webhook's CA and serving certificate and when each is
// renewed. The zero value means the defaults: a serving certificate of a year renewed at 2/3 of its
// life, a CA of ten years whose rotation starts a leaf's life plus 90 days before it expires.
type Lifetimes struct {
	// Leaf is the serving certificate's validity (default DefaultLeafValidity).
	Leaf time.Duration
	// CA is the CA's validity (default DefaultCAValidity).
	CA time.Duration
	// LeafRenewBefore renews the serving certificate when less than this is left (default a third
	// of Leaf: at 2/3 of its life).
	LeafRenewBefore time.Duration
	// CARenewBefore starts a CA rotation when less than this is left (default Leaf plus the smaller
	// of 90 days and a fortieth of CA, so that the old CA's last leaf never outlives it).
	CARenewBefore time.Duration
}

// WithDefaults returns l with every unset period set to its default.
func (l Lifetimes) WithDefaults() Lifetimes {
	if l.Leaf == 0 {
		l.Leaf = DefaultLeafValidity
	}
	if l.CA == 0 {
		l.CA = DefaultCAValidity
	}
	if l.LeafRenewBefore == 0 {
		l.LeafRenewBefore = l.Leaf / 3
	}
	if l.CARenewBefore == 0 {
		l.CARenewBefore = l.Leaf + min(caMarginCap, l.CA/40)
	}
	return l
}

// Validate reports a set of periods that cannot work (after WithDefaults).
func (l Lifetimes) Validate() error {
	switch {
	case l.Leaf <= 0 || l.CA <= 0 || l.LeafRenewBefore <= 0 || l.CARenewBefore <= 0:
		return errors.New("validity periods must be positive")
	case l.LeafRenewBefore >= l.Leaf:
		return fmt.Errorf("leafRenewBefore %s is not shorter than leafValidity %s", l.LeafRenewBefore, l.Leaf)
	case l.CARenewBefore >= l.CA:
		return fmt.Errorf("caRenewBefore %s is not shorter than caValidity %s", l.CARenewBefore, l.CA)
	case l.Leaf > l.CA:
		return fmt.Errorf("leafValidity %s is longer than caValidity %s", l.Leaf, l.CA)
	}
	return nil
}

// due reports whether a certificate valid until notAfter must be renewed at now: less than
// renewBefore is left, or it outlives validity (the validity was shortened since it was issued).
func due(notAfter, now time.Time, validity, renewBefore time.Duration) bool {
	left := notAfter.Sub(now)
	return left < renewBefore || left > validity+validity/outlivesSlack
}

// backdate is how far before its issue a certificate's validity starts, for clocks that are a little
// behind: an hour, or a tenth of a short validity.
func backdate(validity time.Duration) time.Duration { return min(time.Hour, validity/10) }

// Keys of webhookconfig.CertificatesConfigMap, the operator's settings for the webhook's certificates
// (Go durations such as "8760h" or "5m"):
//
//	leafValidity, caValidity, leafRenewBefore, caRenewBefore (see Lifetimes)
//	checkPeriod   how often the keeper checks the chain when nothing changes (default 1m)
const (
	keyLeafValidity    = "leafValidity"
	keyCAValidity      = "caValidity"
	keyLeafRenewBefore = "leafRenewBefore"
	keyCARenewBefore   = "caRenewBefore"
	keyCheckPeriod     = "checkPeriod"
)

// Settings are the operator's settings for the webhook's certificates.
type Settings struct {
	Lifetimes Lifetimes
	// CheckPeriod is how often the keeper checks when nothing changes (default DefaultCheckPeriod).
	CheckPeriod time.Duration
}

// ParseSettings reads Settings from the data of CertificatesConfigMap; unset keys take their defaults.
func ParseSettings(data map[string]string) (Settings, error) {
	var s Settings
	fields := map[string]*time.Duration{
		keyLeafValidity: &s.Lifetimes.Leaf, keyCAValidity: &s.Lifetimes.CA,
		keyLeafRenewBefore: &s.Lifetimes.LeafRenewBefore, keyCARenewBefore: &s.Lifetimes.CARenewBefore,
		keyCheckPeriod: &s.CheckPeriod,
	}
	for k, v := range data {
		f, ok := fields[k]
		if !ok {
			return Settings{}, fmt.Errorf("%w: ConfigMap %s has an unknown key %q (known: %s)", ErrInvalidConfiguration, webhookconfig.CertificatesConfigMap, k, strings.Join(settingKeys(), ", "))
		}
		d, err := time.ParseDuration(strings.TrimSpace(v))
		if err != nil || d <= 0 {
			return Settings{}, fmt.Errorf("%w: ConfigMap %s key %s: %q is not a positive duration", ErrInvalidConfiguration, webhookconfig.CertificatesConfigMap, k, v)
		}
		*f = d
	}
	s.Lifetimes = s.Lifetimes.WithDefaults()
	if s.CheckPeriod == 0 {
		s.CheckPeriod = DefaultCheckPeriod
	}
	if err := s.Lifetimes.Validate(); err != nil {
		return Settings{}, fmt.Errorf("%w: ConfigMap %s: %w", ErrInvalidConfiguration, webhookconfig.CertificatesConfigMap, err)
	}
	return s, nil
}

func settingKeys() []string {
	return []string{keyLeafValidity, keyCAValidity, keyLeafRenewBefore, keyCARenewBefore, keyCheckPeriod}
}

// ReadSettings reads CertificatesConfigMap from the cluster; without it the defaults apply.
func ReadSettings(ctx context.Context, kube kubernetes.Interface) (Settings, error) {
	cm, err := kube.CoreV1().ConfigMaps(namespace).Get(ctx, webhookconfig.CertificatesConfigMap, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return ParseSettings(nil)
	case err != nil:
		return Settings{}, fmt.Errorf("reading ConfigMap %s: %w", webhookconfig.CertificatesConfigMap, err)
	}
	return ParseSettings(cm.Data)
}

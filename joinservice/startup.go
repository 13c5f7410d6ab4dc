package joinservice

import (
	"context"
	"fmt"
	"math"
	"time"

	"go.uber.org/zap"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/joinconfig"
)

// startupPatience is how long the joinservice keeps trying to reach the API server at start. Right
// after init its host-network pod can start before kube-proxy has programmed the API server's
// Service address; exiting would cost a kubelet restart back-off (10 s and more) on the first joins.
const startupPatience = 2 * time.Minute

// secretsRetryInitial and secretsRetryCap bound the wait between attempts to read the cluster
// secrets; it doubles per attempt.
const (
	secretsRetryInitial = 200 * time.Millisecond
	secretsRetryCap     = 5 * time.Second
)

// loadKeysPatiently retries loadKeys with a capped backoff until it succeeds or patience runs out,
// logging each new reason once and passing every failure to report (unless it is nil). It returns the
// last reason when it gives up.
func loadKeysPatiently(ctx context.Context, client kubernetes.Interface, ns string, patience time.Duration, log *zap.Logger, report func(error)) (*clusterkeys.Keys, []byte, error) {
	ctx, cancel := context.WithTimeout(ctx, patience)
	defer cancel()
	retry, last := wait.Backoff{Duration: secretsRetryInitial, Factor: 2, Cap: secretsRetryCap, Steps: math.MaxInt32}, ""
	for {
		keys, salt, err := loadKeys(ctx, client, ns)
		if err == nil {
			return keys, salt, nil
		}
		if report != nil {
			report(err)
		}
		if msg := err.Error(); msg != last {
			log.Warn("waiting for the cluster secrets", zap.Error(err))
			last = msg
		}
		select {
		case <-ctx.Done():
			return nil, nil, err
		case <-time.After(retry.Step()):
		}
	}
}

func loadKeys(ctx context.Context, client kubernetes.Interface, ns string) (*clusterkeys.Keys, []byte, error) {
	sec, err := client.CoreV1().Secrets(ns).Get(ctx, joinconfig.SecretName, metav1.GetOptions{})
	if err != nil {
		return nil, nil, fmt.Errorf("reading cluster secrets: %w", err)
	}
	secrets, err := joinconfig.DecodeSecrets(sec.Data)
	if err != nil {
		return nil, nil, fmt.Errorf("cluster secrets: %w", err)
	}
	keys, err := clusterkeys.New(secrets.MasterSecret, secrets.Salt)
	if err != nil {
		return nil, nil, fmt.Errorf("cluster secrets: %w", err)
	}
	return keys, secrets.Salt, nil
}

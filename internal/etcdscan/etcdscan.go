// Package etcdscan reads the values the Kubernetes API server keeps in etcd as they are stored, and
// says under which KMS v2 key each one is encrypted. A key rotation uses it to find what still lies
// under an old key (bootstrapper/kmskeeper scans its control plane's etcd for `berth secrets
// rotate-key`), and the end-to-end tests use it to check what is at rest.
//
// A value the API server encrypted through a KMS v2 provider is the prefix "k8s:enc:kms:v2:<provider
// name>:" followed by an EncryptedObject protobuf (k8s.io/apiserver's kmsv2 API) whose field 2 is the
// plugin's key ID, in plaintext. Everything else is reported as not encrypted by that provider.
package etcdscan

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/berth-k8s/berth/internal/kmsstate"
)

// RegistryPrefix is where the API server keeps its objects in etcd (its --etcd-prefix default).
const RegistryPrefix = "/registry/"

// keyIDField is the field number of keyID in the EncryptedObject message.
const keyIDField = 2

// pageSize bounds each range read, so a scan of a large cluster never holds everything at once.
const pageSize = 200

// ErrNotKMS is returned by KeyIDOf for a value not encrypted by the provider.
var ErrNotKMS = errors.New("not a KMS v2 value of this provider")

// Prefix is the prefix of every value the API server stores through the KMS v2 provider named
// provider.
func Prefix(provider string) []byte { return []byte("k8s:enc:kms:v2:" + provider + ":") }

// KeyIDOf returns the key ID a stored value was encrypted under by the KMS v2 provider named
// provider, or ErrNotKMS.
func KeyIDOf(value []byte, provider string) (string, error) {
	rest, ok := bytes.CutPrefix(value, Prefix(provider))
	if !ok {
		return "", ErrNotKMS
	}
	for len(rest) > 0 {
		num, typ, n := protowire.ConsumeTag(rest)
		if n < 0 {
			return "", fmt.Errorf("%w: malformed encrypted object", ErrNotKMS)
		}
		rest = rest[n:]
		if num == keyIDField && typ == protowire.BytesType {
			id, n := protowire.ConsumeBytes(rest)
			if n < 0 {
				return "", fmt.Errorf("%w: malformed key ID", ErrNotKMS)
			}
			return string(id), nil
		}
		n = protowire.ConsumeFieldValue(num, typ, rest)
		if n < 0 {
			return "", fmt.Errorf("%w: malformed encrypted object", ErrNotKMS)
		}
		rest = rest[n:]
	}
	return "", fmt.Errorf("%w: no key ID", ErrNotKMS)
}

// ResourcePrefix is the etcd prefix of a core resource's objects ("secrets" -> "/registry/secrets/").
func ResourcePrefix(resource string) string { return RegistryPrefix + resource + "/" }

// Object names one stored object by its etcd key. Its format is the one the control planes' keepers
// report a scan in (kmsstate.StoredObject).
type Object = kmsstate.StoredObject

// ParseKey splits an etcd key of a core resource into resource, namespace and name.
func ParseKey(key string) (Object, bool) {
	rest, ok := strings.CutPrefix(key, RegistryPrefix)
	if !ok {
		return Object{}, false
	}
	parts := strings.Split(rest, "/")
	switch len(parts) {
	case 2:
		return Object{Key: key, Resource: parts[0], Name: parts[1]}, parts[0] != "" && parts[1] != ""
	case 3:
		return Object{Key: key, Resource: parts[0], Namespace: parts[1], Name: parts[2]}, parts[0] != "" && parts[1] != "" && parts[2] != ""
	}
	return Object{}, false
}

// Report is what a scan found, in the format the control planes' keepers report it in
// (kmsstate.ScanReport).
type Report = kmsstate.ScanReport

// Options tune Scan.
type Options struct {
	// Provider is the KMS v2 provider's name in the EncryptionConfiguration.
	Provider string
	// Prefixes are the etcd prefixes to read (ResourcePrefix of each encrypted resource).
	Prefixes []string
	// Keep are key IDs that need no rewrite: objects under any other key ID, and objects not
	// encrypted by the provider, are listed.
	Keep []string
	// Limit bounds Report.Listed (0: 1000).
	Limit int
}

// Scan reads every value under opts.Prefixes, page by page at one revision (so the report is one
// consistent view), and counts them by key ID.
func Scan(ctx context.Context, kv clientv3.KV, opts Options) (Report, error) {
	limit := opts.Limit
	if limit == 0 {
		limit = 1000
	}
	keep := map[string]bool{}
	for _, k := range opts.Keep {
		keep[k] = true
	}
	r := Report{ByKeyID: map[string]int{}}
	for _, prefix := range opts.Prefixes {
		end := clientv3.GetPrefixRangeEnd(prefix)
		key := prefix
		var rev int64
		for {
			ropts := []clientv3.OpOption{clientv3.WithRange(end), clientv3.WithLimit(pageSize)}
			if rev != 0 {
				ropts = append(ropts, clientv3.WithRev(rev))
			}
			resp, err := kv.Get(ctx, key, ropts...)
			if err != nil {
				return Report{}, fmt.Errorf("reading etcd under %s: %w", prefix, err)
			}
			if rev == 0 {
				rev = resp.Header.Revision
			}
			for _, item := range resp.Kvs {
				r.Objects++
				id, err := KeyIDOf(item.Value, opts.Provider)
				if err != nil {
					r.NotEncrypted++
				} else {
					r.ByKeyID[id]++
					if keep[id] {
						continue
					}
				}
				if len(r.Listed) == limit {
					r.Truncated = true
					continue
				}
				obj, ok := ParseKey(string(item.Key))
				if !ok {
					obj = Object{Key: string(item.Key)}
				}
				obj.KeyID = id
				r.Listed = append(r.Listed, obj)
			}
			if !resp.More || len(resp.Kvs) == 0 {
				break
			}
			key = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
		}
	}
	return r, nil
}

package vtpm_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
)

// TestBatchedQuotes: concurrent Issue calls share quotes, and every document still validates for
// exactly its own user data and nonce.
func TestBatchedQuotes(t *testing.T) {
	ca := vtpmtest.NewSwtpmCA(t) // skips without swtpm
	sw := vtpmtest.StartSwtpm(t, ca)
	issuer := vtpm.NewIssuer(sw.Open, zap.NewNop())
	v, err := vtpm.NewValidator(policyFor(t, [][]byte{ca.RootPEM(t), ca.IssuerPEM(t)}, ""), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	const callers, rounds = 12, 4
	docs := make([][]byte, callers*rounds)
	var wg sync.WaitGroup
	for c := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range rounds {
				k := c*rounds + r
				doc, err := issuer.Issue(ctx, []byte(fmt.Sprintf("user %d", k)), []byte(fmt.Sprintf("nonce %d", k)))
				if err != nil {
					t.Error(err)
					return
				}
				docs[k] = doc
			}
		}()
	}
	wg.Wait()
	var batched *vtpm.Document
	for k, raw := range docs {
		res, err := v.Validate(ctx, raw, []byte(fmt.Sprintf("nonce %d", k)))
		if err != nil || string(res.UserData) != fmt.Sprintf("user %d", k) {
			t.Fatalf("document %d: %v (user data %q)", k, err, res.UserData)
		}
		var d vtpm.Document
		if err := json.Unmarshal(raw, &d); err != nil {
			t.Fatal(err)
		}
		if len(d.Batch) > 0 && batched == nil {
			batched, docs[0] = &d, raw
		}
	}
	if batched == nil {
		t.Skip("no two calls overlapped on this machine; nothing batched to check") // timing-dependent, not a failure
	}
	t.Logf("a shared quote covered %d calls", len(batched.Batch))

	// A batched document proves nothing for a nonce outside its batch, nor with its batch changed.
	if _, err := v.Validate(ctx, docs[0], []byte("a nonce nobody quoted")); !errors.Is(err, attestation.ErrNonceMismatch) {
		t.Errorf("batched document with a foreign nonce: %v, want ErrNonceMismatch", err)
	}
	nonceOf := func(d *vtpm.Document) []byte {
		var k int
		_, _ = fmt.Sscanf(string(d.UserData), "user %d", &k)
		return []byte(fmt.Sprintf("nonce %d", k))
	}
	for name, mutate := range map[string]func(d *vtpm.Document){
		"a leaf replaced":   func(d *vtpm.Document) { d.Batch[len(d.Batch)-1] = make([]byte, 32) },
		"a leaf dropped":    func(d *vtpm.Document) { d.Batch = d.Batch[:len(d.Batch)-1] },
		"the batch removed": func(d *vtpm.Document) { d.Batch = nil },
	} {
		var d vtpm.Document
		_ = json.Unmarshal(docs[0], &d)
		mutate(&d)
		raw, _ := json.Marshal(d)
		if _, err := v.Validate(ctx, raw, nonceOf(&d)); err == nil {
			t.Errorf("%s: the document still validated", name)
		}
	}
}

package vtpm

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"time"
)

// Batched quotes. A TPM runs one command at a time, and a quote is its most frequent and one of its
// slowest commands (about 1 ms on swtpm, 10-50 ms on hardware), so an attesting server under load
// would otherwise queue one quote per connection. Instead, the Issue calls that arrive while a quote
// is in the TPM wait and are quoted together next, up to MaxBatch at a time: the quote's qualifying
// data is batchDigest over every waiting call's binding (extraData(userData, nonce), the "leaf"), and
// each call's document carries all leaves of its batch. A validator recomputes its own leaf from the
// user data and the nonce it chose, finds it in the batch and checks the batch against the quote.
//
// That keeps what a single quote proves: the quote was made after the validator's nonce existed (the
// leaf contains it), and the user data (aTLS: the TLS key) is bound by the same leaf. What a validator
// also learns are the other leaves of the batch: hashes of other connections' keys and nonces, which
// tell it nothing. A call alone is quoted alone, with the plain binding and no batch (the format
// before batching). No goroutine is started: the caller that finds the TPM idle quotes, and hands the
// turn to a waiting caller when more are queued.

// MaxBatch bounds how many calls share one quote (and the batch a document may carry).
const MaxBatch = 64

// batchQuoteTimeout bounds one batch's TPM work; it does not end with the context of the caller that
// happens to run it, because the others wait for it too.
const batchQuoteTimeout = 30 * time.Second

// batchDigest is the qualifying data of a quote over several leaves.
func batchDigest(leaves [][]byte) []byte {
	h := sha256.New()
	h.Write([]byte("berth tpm quote batch v1\x00"))
	var n [4]byte
	binary.BigEndian.PutUint32(n[:], uint32(len(leaves)))
	h.Write(n[:])
	for _, l := range leaves {
		h.Write(l)
	}
	return h.Sum(nil)
}

// quoteRequest is one Issue call waiting for a quote.
type quoteRequest struct {
	leaf []byte
	done chan quoteResult // buffered: a delivery never blocks, even to a caller that gave up
}

// quoteResult is the shared quote and, when it covers several calls, their leaves.
type quoteResult struct {
	doc   Document
	batch [][]byte
	err   error
}

// batched returns a quote covering leaf, possibly shared with concurrent calls.
func (i *Issuer) batched(ctx context.Context, leaf []byte) (quoteResult, error) {
	req := &quoteRequest{leaf: leaf, done: make(chan quoteResult, 1)}
	i.batchMu.Lock()
	i.pending = append(i.pending, req)
	lead := !i.quoting
	i.quoting = true
	i.batchMu.Unlock()
	if lead {
		i.quoteNextBatch(ctx)
	}
	for {
		select {
		case res := <-req.done:
			return res, res.err
		case <-i.turn:
			i.quoteNextBatch(ctx)
		case <-ctx.Done():
			return quoteResult{}, ctx.Err()
		}
	}
}

// quoteNextBatch quotes the oldest waiting calls; the caller holds the turn (quoting is true). It
// passes the turn on when more calls wait, and ends it otherwise.
func (i *Issuer) quoteNextBatch(ctx context.Context) {
	i.batchMu.Lock()
	n := min(len(i.pending), MaxBatch)
	batch := i.pending[:n:n]
	i.pending = i.pending[n:]
	if n == 0 {
		i.quoting = false
		i.batchMu.Unlock()
		return
	}
	i.batchMu.Unlock()

	res := quoteResult{}
	qualifying := batch[0].leaf
	if n > 1 {
		res.batch = make([][]byte, n)
		for k, r := range batch {
			res.batch[k] = r.leaf
		}
		qualifying = batchDigest(res.batch)
	}
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), batchQuoteTimeout)
	res.doc, res.err = i.quote(qctx, qualifying)
	cancel()
	for _, r := range batch {
		r.done <- res
	}

	i.batchMu.Lock()
	defer i.batchMu.Unlock()
	if len(i.pending) == 0 {
		i.quoting = false
		return
	}
	i.turn <- struct{}{} // capacity 1, and only the holder of the turn sends
}

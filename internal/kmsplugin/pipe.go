package kmsplugin

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
)

// The plugin process and the bootstrapper that supervises it talk over two pipes:
//
//   - the plugin's stdin carries key sets, each one frame: a 4-byte big-endian length and
//     MarshalKeySet's encoding. The plugin uses the newest; when stdin ends (the bootstrapper is
//     gone) the plugin exits, so a plugin never outlives the process that holds its keys.
//   - the plugin's stdout carries events, one JSON object per line. The only event is the key ID of
//     the last Encrypt it answered: the API server calls Encrypt only when it makes a new
//     data-encryption key, which it does when the plugin's key ID changed (and when it starts), so it
//     tells the bootstrapper that its API server writes under that key now.

// maxFrame bounds a key set frame (a key set of a few generations is a few hundred bytes).
const maxFrame = 64 << 10

// ErrFrameTooLarge is returned for a frame longer than maxFrame.
var ErrFrameTooLarge = errors.New("key set frame too large")

// WriteKeySet writes s as one frame to w.
func WriteKeySet(w io.Writer, s KeySet) error {
	b, err := MarshalKeySet(s)
	if err != nil {
		return err
	}
	frame := make([]byte, 4+len(b))
	binary.BigEndian.PutUint32(frame, uint32(len(b)))
	copy(frame[4:], b)
	if _, err := w.Write(frame); err != nil {
		return fmt.Errorf("writing key set: %w", err)
	}
	return nil
}

// ReadKeySet reads one frame from r. It returns io.EOF when r ended before a frame began.
func ReadKeySet(r io.Reader) (KeySet, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return KeySet{}, fmt.Errorf("reading key set: %w", err)
		}
		return KeySet{}, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > maxFrame {
		return KeySet{}, fmt.Errorf("%w: %d bytes", ErrFrameTooLarge, n)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return KeySet{}, fmt.Errorf("reading key set: %w", err)
	}
	return UnmarshalKeySet(b)
}

// Event is one line the plugin writes to its stdout.
type Event struct {
	// EncryptKeyID is the key ID of the Encrypt call the plugin answered last.
	EncryptKeyID string `json:"encryptKeyID,omitempty"`
}

// ReadEvents calls f with every event on r until r ends. A line that is not an event is skipped.
func ReadEvents(r io.Reader, f func(Event)) error {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		var e Event
		if json.Unmarshal(sc.Bytes(), &e) == nil {
			f(e)
		}
	}
	return sc.Err()
}

// eventWriter reports Encrypt key IDs on the plugin's stdout without ever blocking a request: the
// request path only records the newest key ID and wakes run, which writes it.
type eventWriter struct {
	mu     sync.Mutex
	latest string
	wake   chan struct{}
}

func newEventWriter() *eventWriter { return &eventWriter{wake: make(chan struct{}, 1)} }

func (e *eventWriter) encrypted(keyID string) {
	e.mu.Lock()
	e.latest = keyID
	e.mu.Unlock()
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// run writes the newest key ID to w each time it changed, until done is closed or w fails.
func (e *eventWriter) run(done <-chan struct{}, w io.Writer) error {
	written := ""
	for {
		select {
		case <-done:
			return nil
		case <-e.wake:
		}
		e.mu.Lock()
		id := e.latest
		e.mu.Unlock()
		if id == written {
			continue
		}
		b, err := json.Marshal(Event{EncryptKeyID: id})
		if err != nil {
			return fmt.Errorf("encoding event: %w", err)
		}
		if _, err := w.Write(append(b, '\n')); err != nil {
			return fmt.Errorf("writing event: %w", err)
		}
		written = id
	}
}

package recoveryserver

import (
	"bytes"
	"context"
	"crypto/pbkdf2"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/atls/atlstest"
	"github.com/berth-k8s/berth/recoverproto"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var (
	rightKey = bytes.Repeat([]byte{0x5a}, KeySize)
	wrongKey = bytes.Repeat([]byte{0xa5}, KeySize)
	testInfo = Info{DiskUUID: "0f8e4c2a-1b3d-4e5f-8a9b-0c1d2e3f4a5b", ClusterID: bytes.Repeat([]byte{0xc1}, 32), Binding: bytes.Repeat([]byte{0xb1}, 32)}
)

// errSecretDetail stands for what a disk backend may say about a wrong key; it must stay on the node.
var errSecretDetail = errors.New("keyslot 0: authentication tag mismatch at offset 4096")

// fakeDisk opens with rightKey only and records every key it was given.
type fakeDisk struct {
	mu    sync.Mutex
	tries [][]byte
	// gate, if set, holds every open until it is closed (or ctx ends).
	gate chan struct{}
	// entered receives once per open that started.
	entered chan struct{}
	// onOpen, if set, runs when the right key opened the disk, before open returns.
	onOpen func()
}

func (d *fakeDisk) open(ctx context.Context, key []byte) error {
	d.mu.Lock()
	d.tries = append(d.tries, append([]byte(nil), key...))
	gate, entered := d.gate, d.entered
	d.mu.Unlock()
	if entered != nil {
		entered <- struct{}{}
	}
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if !bytes.Equal(key, rightKey) {
		return errSecretDetail
	}
	if d.onOpen != nil {
		d.onOpen()
	}
	return nil
}

func (d *fakeDisk) triesCount() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.tries)
}

// served is a Serve running on an in-process listener.
type served struct {
	client recoverproto.RecoveryServiceClient
	done   chan error
	logs   *observer.ObservedLogs
}

func startServer(t *testing.T, ctx context.Context, disk *fakeDisk, dialOpt grpc.DialOption, serverOpts ...grpc.ServerOption) *served {
	t.Helper()
	core, logs := observer.New(zap.DebugLevel)
	lis := bufconn.Listen(1 << 16)
	done := make(chan error, 1)
	// Every call of these tests comes from one in-process peer: its limits are lifted
	// (TestRecoverThroughWrongKeyFlood checks them).
	srv := New(zap.New(core), serverOpts...).WithLimits(Limits{PerPeer: rate.Inf, Waiting: 1 << 20})
	go func() { done <- srv.Serve(ctx, lis, testInfo, disk.open) }()
	conn, err := grpc.NewClient("passthrough:///recovery",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		dialOpt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return &served{client: recoverproto.NewRecoveryServiceClient(conn), done: done, logs: logs}
}

func wantStatus(t *testing.T, err error, code codes.Code, msg string) {
	t.Helper()
	if st, _ := status.FromError(err); st.Code() != code || (msg != "" && st.Message() != msg) {
		t.Fatalf("got %v, want %s %q", err, code, msg)
	}
}

func TestRecover(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	disk := &fakeDisk{}
	s := startServer(t, ctx, disk, grpc.WithTransportCredentials(insecure.NewCredentials()))

	info, err := s.client.Info(ctx, &recoverproto.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.GetDiskUuid() != testInfo.DiskUUID || !bytes.Equal(info.GetClusterId(), testInfo.ClusterID) || !bytes.Equal(info.GetDiskBinding(), testInfo.Binding) {
		t.Fatalf("Info = %v", info)
	}

	// A key of the wrong size never reaches the disk.
	for _, k := range [][]byte{nil, rightKey[:16], append(rightKey, 0)} {
		_, err := s.client.Recover(ctx, &recoverproto.RecoverRequest{DiskKey: k})
		wantStatus(t, err, codes.InvalidArgument, "disk_key must be 32 bytes")
	}
	if n := disk.triesCount(); n != 0 {
		t.Fatalf("open called %d times for keys of the wrong size", n)
	}

	// A wrong key is refused with the one fixed message; the reason stays in the node's log.
	_, err = s.client.Recover(ctx, &recoverproto.RecoverRequest{DiskKey: wrongKey})
	wantStatus(t, err, codes.InvalidArgument, "the key does not open this node's state disk; nothing changed")
	if bytes.Contains([]byte(err.Error()), []byte("keyslot")) {
		t.Fatalf("the answer leaks the node's error: %v", err)
	}
	if got := s.logs.FilterMessage("recovery key does not open the state disk").Len(); got != 1 {
		t.Fatalf("%d log entries for the wrong key, want 1", got)
	}
	for _, e := range s.logs.All() {
		for _, f := range e.Context {
			if bytes.Contains([]byte(f.String), wrongKey) {
				t.Fatalf("log entry %q holds the key", e.Message)
			}
		}
	}
	// ... and Serve keeps serving.
	select {
	case err := <-s.done:
		t.Fatalf("Serve returned after a wrong key: %v", err)
	default:
	}
	if _, err := s.client.Info(ctx, &recoverproto.InfoRequest{}); err != nil {
		t.Fatalf("Info after a wrong key: %v", err)
	}

	// The right key opens the disk: the caller gets OK, and Serve returns nil.
	if _, err := s.client.Recover(ctx, &recoverproto.RecoverRequest{DiskKey: rightKey}); err != nil {
		t.Fatalf("Recover with the right key: %v", err)
	}
	if err := <-s.done; err != nil {
		t.Fatalf("Serve after the right key: %v", err)
	}
	if got := s.logs.FilterMessage("state disk opened by berth recover").Len(); got != 1 {
		t.Fatalf("%d success log entries, want 1", got)
	}
	if n := disk.triesCount(); n != 2 {
		t.Fatalf("open called %d times, want 2", n)
	}
}

// TestRecoverOneAtATime: a second Recover waits while one runs; once the first opened the disk,
// the second is refused without calling open again.
func TestRecoverOneAtATime(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	disk := &fakeDisk{gate: make(chan struct{}), entered: make(chan struct{}, 2)}
	arrived := make(chan struct{}, 2)
	s := startServer(t, ctx, disk, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			arrived <- struct{}{}
			return h(ctx, req)
		}))

	first := make(chan error, 1)
	go func() {
		_, err := s.client.Recover(ctx, &recoverproto.RecoverRequest{DiskKey: rightKey})
		first <- err
	}()
	<-arrived
	<-disk.entered // the first call is inside open
	second := make(chan error, 1)
	go func() {
		_, err := s.client.Recover(ctx, &recoverproto.RecoverRequest{DiskKey: rightKey})
		second <- err
	}()
	<-arrived // the second call reached the server while the first is inside open
	select {
	case <-disk.entered:
		t.Fatal("a second open started while the first was running")
	case err := <-second:
		t.Fatalf("the second call ended while the first was running: %v", err)
	case err := <-first:
		t.Fatalf("the first call ended before the disk opened: %v", err)
	default:
	}
	close(disk.gate)
	if err := <-first; err != nil {
		t.Fatalf("first Recover: %v", err)
	}
	wantStatus(t, <-second, codes.FailedPrecondition, "")
	if err := <-s.done; err != nil {
		t.Fatalf("Serve: %v", err)
	}
	if n := disk.triesCount(); n != 1 {
		t.Fatalf("open called %d times, want 1", n)
	}
}

// TestServeCancel: Serve returns ctx.Err() promptly when ctx ends, also while a Recover call is in
// open, and leaves no goroutine behind (goleak).
func TestServeCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	disk := &fakeDisk{gate: make(chan struct{}), entered: make(chan struct{}, 1)}
	s := startServer(t, ctx, disk, grpc.WithTransportCredentials(insecure.NewCredentials()))

	call := make(chan error, 1)
	go func() {
		_, err := s.client.Recover(t.Context(), &recoverproto.RecoverRequest{DiskKey: rightKey})
		call <- err
	}()
	<-disk.entered
	cancel()
	if err := <-s.done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Serve after cancel = %v, want context.Canceled", err)
	}
	if err := <-call; err == nil {
		t.Fatal("a Recover interrupted by the end of Serve succeeded")
	}
}

// TestRecoverAnsweredWhenTheCallerStopsAtOnce: the boot stage ends Serve's context as soon as the
// disk is open, before the handler answered; berth recover still gets its answer (it got EOF when
// Serve stopped at once) and Serve reports the open.
func TestRecoverAnsweredWhenTheCallerStopsAtOnce(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	disk := &fakeDisk{onOpen: cancel}
	s := startServer(t, ctx, disk, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if _, err := s.client.Recover(t.Context(), &recoverproto.RecoverRequest{DiskKey: rightKey}); err != nil {
		t.Fatalf("Recover with the right key, its caller ending Serve at once: %v", err)
	}
	if err := <-s.done; err != nil {
		t.Fatalf("Serve = %v, want nil (the disk was opened)", err)
	}
}

// TestServeAttested: with the node's attested TLS server credentials, a client that validates the
// node gets its answer, and one that does not speak attested TLS gets nothing.
func TestServeAttested(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	serverCreds, err := atls.NewCredentials(atlstest.Issuer{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	clientCreds, err := atls.NewCredentials(nil, atlstest.Validator{})
	if err != nil {
		t.Fatal(err)
	}
	disk := &fakeDisk{}
	s := startServer(t, ctx, disk, grpc.WithTransportCredentials(clientCreds), grpc.Creds(serverCreds))
	if info, err := s.client.Info(ctx, &recoverproto.InfoRequest{}); err != nil || info.GetDiskUuid() != testInfo.DiskUUID {
		t.Fatalf("Info over attested TLS: %v, %v", info, err)
	}

	plain := startServer(t, ctx, &fakeDisk{}, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.Creds(serverCreds))
	if _, err := plain.client.Recover(ctx, &recoverproto.RecoverRequest{DiskKey: rightKey}); err == nil {
		t.Fatal("a plaintext client reached the attested recovery server")
	}

	if _, err := s.client.Recover(ctx, &recoverproto.RecoverRequest{DiskKey: rightKey}); err != nil {
		t.Fatalf("Recover over attested TLS: %v", err)
	}
	if err := <-s.done; err != nil {
		t.Fatalf("Serve: %v", err)
	}
	cancel()
	if err := <-plain.done; !errors.Is(err, context.Canceled) {
		t.Fatalf("second Serve after cancel = %v", err)
	}
}

// kdfDisk opens with the key whose PBKDF2 digest it holds: each try costs a few milliseconds of CPU,
// as a state disk's key slot does. It records the order of the keys it was given.
type kdfDisk struct {
	want []byte

	mu    sync.Mutex
	tries []bool // true: the right key
	first chan struct{}
}

const kdfRounds = 20000

func newKDFDisk(t *testing.T, key []byte) *kdfDisk {
	want, err := pbkdf2.Key(sha256.New, string(key), []byte("salt"), kdfRounds, 32)
	if err != nil {
		t.Fatal(err)
	}
	return &kdfDisk{want: want, first: make(chan struct{})}
}

func (d *kdfDisk) open(_ context.Context, key []byte) error {
	got, err := pbkdf2.Key(sha256.New, string(key), []byte("salt"), kdfRounds, 32)
	if err != nil {
		return err
	}
	right := subtle.ConstantTimeCompare(got, d.want) == 1
	d.mu.Lock()
	d.tries = append(d.tries, right)
	if len(d.tries) == 1 {
		close(d.first)
	}
	d.mu.Unlock()
	if !right {
		return errSecretDetail
	}
	return nil
}

func (d *kdfDisk) count() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.tries)
}

// recoverFrom calls Info and Recover with key from ip over its own connection, as berth recover does;
// beforeRecover runs between the two.
func recoverFrom(ctx context.Context, addr, ip string, key []byte, beforeRecover func()) error {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) { return d.DialContext(ctx, "tcp", a) }))
	if err != nil {
		return err
	}
	defer conn.Close()
	client := recoverproto.NewRecoveryServiceClient(conn)
	if _, err := client.Info(ctx, &recoverproto.InfoRequest{}); err != nil {
		return err
	}
	beforeRecover()
	_, err = client.Recover(ctx, &recoverproto.RecoverRequest{DiskKey: key})
	return err
}

// TestRecoverThroughWrongKeyFlood: 2,000 Recover calls with wrong keys, sent at once over 8
// connections from 8 loopback addresses, are in the node's hands when berth recover sends the right
// key from another address. Each address has at most one call waiting or running, the rest are
// refused at once: the operator's key waits for at most one open per flooding address. (Queued one
// after the other, as they were, the operator's key waited for every wrong key before it.) The time
// of berth recover alone and under the flood are printed.
func TestRecoverThroughWrongKeyFlood(t *testing.T) {
	const addresses, calls = 8, 2000
	run := func(flood bool) (took time.Duration, ahead, refused int) {
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute) // berth recover's default timeout
		defer cancel()
		disk := newKDFDisk(t, rightKey)
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- New(zap.NewNop()).Serve(ctx, lis, testInfo, disk.open) }()
		addr := lis.Addr().String()
		var wg sync.WaitGroup
		var answered, limited atomic.Int64
		if flood {
			conns := make([]*grpc.ClientConn, addresses)
			for i := range conns {
				d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 30, byte(i+1))}}
				conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
					grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) { return d.DialContext(ctx, "tcp", a) }))
				if err != nil {
					t.Fatal(err)
				}
				defer conn.Close()
				conns[i] = conn
			}
			for i := range calls {
				wg.Add(1)
				go func() {
					defer wg.Done()
					_, err := recoverproto.NewRecoveryServiceClient(conns[i%addresses]).Recover(ctx, &recoverproto.RecoverRequest{DiskKey: wrongKey})
					answered.Add(1)
					if status.Code(err) == codes.ResourceExhausted {
						limited.Add(1)
					}
				}()
			}
			// The flood is in the node's hands once its first key was tried.
			<-disk.first
		}
		var before int
		start := time.Now()
		if err := recoverFrom(ctx, addr, "127.0.30.100", rightKey, func() { before = disk.count() }); err != nil {
			t.Fatalf("berth recover (flood: %v): %v", flood, err)
		}
		took = time.Since(start)
		if err := <-done; err != nil {
			t.Fatalf("Serve() = %v", err)
		}
		cancel()
		wg.Wait()
		disk.mu.Lock()
		defer disk.mu.Unlock()
		for _, right := range disk.tries[before:] {
			if right {
				break
			}
			ahead++
		}
		return took, ahead, int(limited.Load())
	}
	alone, _, _ := run(false)
	flooded, ahead, refused := run(true)
	t.Logf("berth recover alone: %s; under %d wrong keys from %d addresses: %s, %d wrong keys tried ahead of it, %d calls refused at once",
		alone.Round(time.Millisecond), calls, addresses, flooded.Round(time.Millisecond), ahead, refused)
	// Ahead of the operator's key: the key being tried when it arrived, and at most one waiting per
	// flooding address.
	if ahead > addresses+1 {
		t.Errorf("%d wrong keys were tried ahead of the operator's, want at most one per flooding address and the one being tried (%d)", ahead, addresses+1)
	}
}

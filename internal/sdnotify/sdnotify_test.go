package sdnotify

import (
	"net"
	"path/filepath"
	"testing"
)

func TestNotify(t *testing.T) {
	t.Setenv("NOTIFY_SOCKET", "")
	if sent, err := Ready(); sent || err != nil {
		t.Fatalf("Ready() without socket = %v, %v; want false, nil", sent, err)
	}
	path := filepath.Join(t.TempDir(), "notify.sock")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	t.Setenv("NOTIFY_SOCKET", path)
	if sent, err := Ready(); !sent || err != nil {
		t.Fatalf("Ready() = %v, %v; want true, nil", sent, err)
	}
	buf := make([]byte, 64)
	n, err := conn.Read(buf)
	if err != nil {
		t.Fatal(err)
	}
	if got := string(buf[:n]); got != "READY=1" {
		t.Fatalf("received %q, want READY=1", got)
	}
}

// Package sdnotify tells systemd about the daemon's state (the sd_notify protocol). Without
// NOTIFY_SOCKET in the environment, as on hosts without systemd, every call is a no-op.
package sdnotify

import (
	"fmt"
	"net"
	"os"
)

// Notify sends state (e.g. "READY=1") to the socket named by NOTIFY_SOCKET. It returns false, nil
// when there is no socket to notify.
func Notify(state string) (bool, error) {
	path := os.Getenv("NOTIFY_SOCKET")
	if path == "" {
		return false, nil
	}
	if path[0] == '@' {
		path = "\x00" + path[1:] // abstract socket
	}
	conn, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		return false, fmt.Errorf("dialing notify socket: %w", err)
	}
	defer func() { _ = conn.Close() }() // the datagram is sent or its error returned
	if _, err := conn.Write([]byte(state)); err != nil {
		return false, fmt.Errorf("writing to notify socket: %w", err)
	}
	return true, nil
}

// Ready tells systemd the service is up.
func Ready() (bool, error) { return Notify("READY=1") }

// Stopping tells systemd the service is shutting down.
func Stopping() (bool, error) { return Notify("STOPPING=1") }

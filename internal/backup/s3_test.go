package backup_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/berth-k8s/berth/internal/backup"
	"github.com/berth-k8s/berth/internal/backup/s3test"
)

func TestS3Store(t *testing.T) {
	cfg := s3test.Start(t)
	s, err := backup.NewS3(cfg)
	if err != nil {
		t.Fatal(err)
	}
	backup.TestStore(t, s)

	t.Run("wrong credentials", func(t *testing.T) {
		bad := cfg
		bad.SecretKey += "x"
		s, err := backup.NewS3(bad)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.List(context.Background()); err == nil {
			t.Error("List with a wrong secret key succeeded")
		}
		name := backup.Name(time.Now())
		if err := s.Put(context.Background(), name, bytes.NewReader([]byte("x")), 1); err == nil {
			t.Error("Put with a wrong secret key succeeded")
		}
		if _, err := s.Get(context.Background(), name); err == nil || errors.Is(err, backup.ErrNotFound) {
			t.Errorf("Get with a wrong secret key = %v, want an access error", err)
		}
	})
}

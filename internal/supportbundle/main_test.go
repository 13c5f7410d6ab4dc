package supportbundle

import (
	"os"
	"testing"

	"github.com/berth-k8s/berth/internal/apiservertest"
)

// TestMain stops the API server the tests share (apiservertest.Shared) and removes its directory.
func TestMain(m *testing.M) { os.Exit(apiservertest.StoppingShared(m).Run()) }

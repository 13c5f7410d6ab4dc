package buildinfo

import (
	"runtime"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/berth-k8s/berth/internal/version"
)

func TestRegister(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	if err := Register(reg); err != nil {
		t.Fatal(err)
	}
	want := `# HELP berth_build_info Always 1; the labels say which build of Berth this is.
# TYPE berth_build_info gauge
berth_build_info{commit="` + version.Commit() + `",go_version="` + runtime.Version() + `",version="` + version.Version + `"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), Name); err != nil {
		t.Fatal(err)
	}
	// Registered twice in one registry is an error, not a second series.
	if err := Register(reg); err == nil {
		t.Fatal("a second Register succeeded")
	}
}

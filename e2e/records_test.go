//go:build e2e

package e2e

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// checkRecordAPI: kubectl get lists the record API's Machines of the workers that joined, with the
// printer columns (node, role, state, last join), and berth status w1 shows w1's machine with its
// latest join and evidence. The joinservice writes Machines within its flush interval, so the check
// polls for them.
func checkRecordAPI(t testing.TB, c *cluster) {
	t.Helper()
	var out string
	_ = wait.PollUntilContextTimeout(context.Background(), time.Second, time.Minute, true, func(context.Context) (bool, error) {
		got, err := c.run(30*time.Second, c.kubectl, "--kubeconfig", filepath.Join(c.dir, "admin.conf"), "-n", "berth-system", "get", "machines")
		out = got
		return err == nil && strings.Contains(got, " w1 ") && strings.Contains(got, " w2 "), nil
	})
	t.Logf("kubectl get machines:\n%s", out)
	header := strings.Fields(strings.SplitN(out, "\n", 2)[0])
	if strings.Join(header, " ") != "NAME NODE ROLE STATE LAST JOIN AGE" {
		t.Errorf("kubectl get machines columns = %q", header)
	}
	for _, n := range []string{"w1", "w2"} {
		found := false
		for _, line := range strings.Split(out, "\n") {
			f := strings.Fields(line)
			found = found || len(f) >= 4 && f[1] == n && f[2] == "worker" && f[3] == "Admitted"
		}
		if !found {
			t.Errorf("kubectl get machines has no admitted worker %s", n)
		}
	}
	t.Logf("kubectl get joinrecords:\n%s", c.kube("-n", "berth-system", "get", "joinrecords"))
	status := c.must(time.Minute, c.berth, "status", "w1", "--kubeconfig", filepath.Join(c.dir, "admin.conf"))
	t.Logf("berth status w1:\n%s", status)
	for _, want := range []string{"Node w1: machine", "Admitted", "last join", "evidence sha256:"} {
		if !strings.Contains(status, want) {
			t.Errorf("berth status w1 lacks %q", want)
		}
	}
}

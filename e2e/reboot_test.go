//go:build e2e

package e2e

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/machines"
)

// checkDayTwo runs on TestMiniCluster's cluster (1 control plane, 2 workers) after its power cut of
// every node, and covers every boot after the first: the joinservice passes the join policy again
// (lock register re-extended), a node added afterwards joins, a worker whose boot changed cannot
// unseal and is refused on rejoin, a worker whose TPM was cleared rejoins, the master secret, init secret and disk keys are nowhere in the
// nodes' backing files, and a control plane whose sealed key died comes back through berth recover.
func checkDayTwo(t testing.TB, c *cluster, restartOut string) {
	if m := regexp.MustCompile(`power cut -> all Ready: [0-9.]+s`).FindString(restartOut); m != "" {
		t.Logf("all nodes at once: %s", m)
	} else {
		t.Errorf("berth mini restart did not print the time from power cut to all Ready:\n%s", restartOut)
	}
	joinPolicy := filepath.Join(c.dir, "join-policy.yaml")
	cpIP := nodeIP(t, c.dir, "cp1")

	// 1. The rebooted control plane re-extended its lock register: a joining node's check passes.
	var out string
	var err error
	if werr := wait.PollUntilContextTimeout(context.Background(), 2*time.Second, 3*time.Minute, true, func(context.Context) (bool, error) {
		out, err = c.run(time.Minute, c.berth, "verify", "--endpoint", cpIP+":"+strconv.Itoa(joinconfig.JoinPort), "--policy", joinPolicy)
		return err == nil && strings.Contains(out, "verdict: ACCEPTED"), nil
	}); werr != nil {
		t.Fatalf("berth verify against the rebooted joinservice: %v\n%s", err, out)
	}
	t.Logf("berth verify after the power cut: ACCEPTED (lock register re-extended)")
	// w3 is created after berth init: it gets the cluster's join policy (with the attestation-key
	// CA), takes the joinservice's session proof, and its join costs the joinservice's TPM nothing.
	q0, a0 := tpmWork(t, cpIP)
	joins := func() float64 {
		return joinserviceMetrics(t, cpIP)[`berth_joinservice_attempts_total{outcome="accepted",reason="",rpc="join"}`]
	}
	j0 := joins()
	start := time.Now()
	out = c.must(10*time.Minute, c.berth, "mini", "add", "--dir", c.dir, "--workers", "1")
	t.Logf("berth mini add --workers 1 (%.1fs):\n%s", time.Since(start).Seconds(), out)
	c.kube("wait", "--for=condition=Ready", "node/w3", "--timeout=120s")
	q1, a1 := tpmWork(t, cpIP)
	if j1 := joins(); j1 <= j0 || q1 != q0 || a1 != a0 {
		t.Errorf("w3's join: %v joins accepted, which cost the joinservice's TPM %v quotes and %v activations for connections; want a join and none",
			j1-j0, q1-q0, a1-a0)
	} else {
		t.Logf("w3 joined through the session proof: %v join(s), no quote or activation of the joinservice's TPM for it", j1-j0)
	}

	// 2. A worker whose boot measures differently cannot unseal and is refused on rejoin.
	w1IP := nodeIP(t, c.dir, "w1")
	logW1 := filepath.Join(c.dir, "nodes", "w1", "logs", "bootstrapper.log")
	mark := logSize(t, logW1)
	c.must(5*time.Minute, c.berth, "mini", "restart", "--dir", c.dir, "w1", "--tamper-boot", "w1")
	waitLog(t, logW1, mark, "rejoin refused", 2*time.Minute)
	tail := logSince(t, logW1, mark)
	if !strings.Contains(tail, "the TPM refused the sealed disk key") || !strings.Contains(tail, "MEASUREMENT_MISMATCH") {
		t.Errorf("tampered w1's log does not show the refused unseal and the rejoin refusal:\n%s", tail)
	}
	if strings.Contains(tail, `"msg":"state disk open"`) {
		t.Errorf("tampered w1 opened its state disk:\n%s", tail)
	}
	if !statusHasRejection(t, c, w1IP, "MEASUREMENT_MISMATCH") {
		t.Errorf("berth status does not list w1 (%s) as rejected with MEASUREMENT_MISMATCH", w1IP)
	}
	if got := nodeMount(t, c, "w1", "/etc/kubernetes"); !strings.Contains(got, "berth-no-state-disk") {
		t.Errorf("tampered w1's /etc/kubernetes is not the locked placeholder: %s", got)
	}
	out = c.must(5*time.Minute, c.berth, "mini", "restart", "--dir", c.dir, "w1", "--genuine-boot", "w1")
	t.Logf("w1 rebooted genuine again:\n%s", out)

	// A worker whose TPM was cleared (sealed key gone, boot unchanged) gets its disk key from a
	// rejoin ticket and comes back by itself.
	logW2 := filepath.Join(c.dir, "nodes", "w2", "logs", "bootstrapper.log")
	mark = logSize(t, logW2)
	out = c.must(5*time.Minute, c.berth, "mini", "restart", "--dir", c.dir, "w2", "--clear-tpm", "w2")
	t.Logf("w2 rebooted with a cleared TPM:\n%s", out)
	waitLog(t, logW2, mark, `"source":"rejoin"`, time.Minute)
	t.Logf("w2's boot stage:\n%s", grepLines(logSince(t, logW2, mark), `"logger":"bootstage"`))

	// 4. At rest: nothing secret in any node's backing files; a marker on a state disk is readable
	// through the node's mounts and not in the backing files, a marker outside it is (control).
	checkAtRest(t, c)

	// 3. Recovery: cp1's sealed key dies (TPM cleared), no other joinservice exists.
	logCP := filepath.Join(c.dir, "nodes", "cp1", "logs", "bootstrapper.log")
	mark = logSize(t, logCP)
	c.must(5*time.Minute, c.berth, "mini", "restart", "--dir", c.dir, "cp1", "--clear-tpm", "cp1", "--no-wait")
	waitLog(t, logCP, mark, "recovery server waiting for berth recover", 2*time.Minute)
	t.Logf("cp1 waits in its recovery server:\n%s", grepLines(logSince(t, logCP, mark), "bootstage", "recovery"))
	wrong := filepath.Join(t.TempDir(), "wrong-master-secret.json")
	writeWrongMasterSecret(t, filepath.Join(c.dir, "master-secret.json"), wrong)
	recoverArgs := []string{"recover", "--endpoint", cpIP + ":9001", "--policy", filepath.Join(c.dir, "policy.yaml"), "--master-secret"}
	out, err = c.run(2*time.Minute, c.berth, append(recoverArgs, wrong)...)
	t.Logf("berth recover with a wrong master secret (%v):\n%s", err, out)
	if err == nil || !strings.Contains(out, "nothing was sent") {
		t.Errorf("berth recover with a wrong master secret was not refused")
	}
	if strings.Contains(logSince(t, logCP, mark), `"msg":"state disk open"`) {
		t.Errorf("cp1 opened its state disk after a wrong master secret")
	}
	start = time.Now()
	out = c.must(2*time.Minute, c.berth, append(recoverArgs, filepath.Join(c.dir, "master-secret.json"))...)
	t.Logf("berth recover (%.2fs):\n%s", time.Since(start).Seconds(), out)
	waitLog(t, logCP, mark, `"source":"recovery"`, time.Minute)
	// The API server comes back with cp1; a worker added now joins through cp1's joinservice.
	start = time.Now()
	out = c.must(10*time.Minute, c.berth, "mini", "add", "--dir", c.dir, "--workers", "1")
	t.Logf("berth mini add after recovery (%.1fs from berth recover's answer):\n%s", time.Since(start).Seconds(), out)
	c.kube("wait", "--for=condition=Ready", "node/w4", "node/cp1", "--timeout=120s")
}

func logSize(t testing.TB, path string) int64 {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Size()
}

func logSince(t testing.TB, path string, off int64) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.NewSectionReader(f, off, 1<<30))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func waitLog(t testing.TB, path string, off int64, want string, timeout time.Duration) {
	t.Helper()
	if err := wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, timeout, true, func(context.Context) (bool, error) {
		return strings.Contains(logSince(t, path, off), want), nil
	}); err != nil {
		t.Fatalf("%s never logged %q:\n%s", path, want, logSince(t, path, off))
	}
}

func grepLines(s string, subs ...string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		for _, sub := range subs {
			if strings.Contains(l, sub) {
				out = append(out, l)
				break
			}
		}
	}
	return strings.Join(out, "\n")
}

// statusHasRejection polls berth status until its REJECTED table lists peer with reason.
func statusHasRejection(t testing.TB, c *cluster, peer, reason string) bool {
	t.Helper()
	var status string
	err := wait.PollUntilContextTimeout(context.Background(), time.Second, time.Minute, true, func(context.Context) (bool, error) {
		var err error
		status, err = c.run(time.Minute, c.berth, "status", "--kubeconfig", filepath.Join(c.dir, "admin.conf"))
		if err != nil {
			return false, nil
		}
		rejected, _, _ := strings.Cut(status, "ACCEPTED")
		for _, line := range strings.Split(rejected, "\n") {
			if f := strings.Fields(line); len(f) > 5 && f[1] == peer && strings.Contains(line, reason) {
				return true, nil
			}
		}
		return false, nil
	})
	t.Logf("berth status:\n%s", status)
	return err == nil
}

// nodeMount is the mount table line of path inside node n's mount namespace.
func nodeMount(t testing.TB, c *cluster, n, path string) string {
	t.Helper()
	return c.must(time.Minute, "nsenter", "--mount="+filepath.Join(c.dir, "ns", n+".mnt"), "--", "findmnt", "-n", "-o", "SOURCE,FSTYPE,OPTIONS", path)
}

func writeWrongMasterSecret(t testing.TB, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	var f map[string]string
	if err := json.Unmarshal(b, &f); err != nil {
		t.Fatal(err)
	}
	f["masterSecret"] = base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{0x5a}, 32))
	b, _ = json.Marshal(f)
	if err := os.WriteFile(to, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// checkAtRest searches every file the nodes keep (state disk images, containerd roots, logs, TPM
// state: everything under the cluster directory but the operator's master-secret.json and
// init-secret) for the master secret, the init secret and every node's disk key, raw, hex and
// base64.
func checkAtRest(t testing.TB, c *cluster) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(c.dir, "master-secret.json"))
	if err != nil {
		t.Fatal(err)
	}
	var ms struct{ MasterSecret, Salt string }
	if err := json.Unmarshal(b, &ms); err != nil {
		t.Fatal(err)
	}
	master, _ := base64.StdEncoding.DecodeString(ms.MasterSecret)
	salt, _ := base64.StdEncoding.DecodeString(ms.Salt)
	keys, err := clusterkeys.New(master, salt)
	if err != nil {
		t.Fatal(err)
	}
	initHex, err := os.ReadFile(filepath.Join(c.dir, "init-secret"))
	if err != nil {
		t.Fatal(err)
	}
	initSecret, err := hex.DecodeString(strings.TrimSpace(string(initHex)))
	if err != nil {
		t.Fatal(err)
	}
	// The KMS keys (generations 1 and 2: TestMiniCluster rotated once) live on cp1's state disk only.
	secrets := map[string][]byte{"master secret": master, "init secret": initSecret,
		"KMS key of generation 1": keys.KMSKey(1), "KMS key of generation 2": keys.KMSKey(2)}
	logs, _ := filepath.Glob(filepath.Join(c.dir, "nodes", "*", "logs", "bootstrapper.log"))
	uuidRE := regexp.MustCompile(`"msg":"state disk open".*?"diskUUID":"([0-9a-f-]{36})"`)
	// A disk key names the disk's machine: every UUID with every machine identity the record knows
	// (and the legacy per-UUID key, which must not appear either).
	record, err := machines.Decode(c.kube("get", "configmap", machines.ConfigMapName, "-n", joinconfig.Namespace, "-o", "jsonpath={.data.machines\\.json}"))
	if err != nil {
		t.Fatal(err)
	}
	uuids := 0
	for _, l := range logs {
		b, _ := os.ReadFile(l)
		for _, m := range uuidRE.FindAllSubmatch(b, -1) {
			uuids++
			secrets["legacy disk key of "+string(m[1])] = keys.LegacyDiskKey(string(m[1]))
			for _, r := range record {
				if id, err := hex.DecodeString(r.Identity); err == nil {
					secrets["disk key of "+string(m[1])+" on "+r.Node] = keys.DiskKey(string(m[1]), id)
				}
			}
		}
	}
	if uuids < 4 {
		t.Fatalf("found disk UUIDs of fewer than 4 nodes in their logs: %v", uuids)
	}
	marker := []byte("berth-at-rest-marker-" + hex.EncodeToString(keys.LegacyDiskKey("marker"))[:24])
	control := []byte("berth-at-rest-control-" + hex.EncodeToString(keys.LegacyDiskKey("control"))[:24])
	ns := "--mount=" + filepath.Join(c.dir, "ns", "w2.mnt")
	c.must(time.Minute, "nsenter", ns, "--", "sh", "-c", "echo "+string(marker)+" > /var/lib/berth/at-rest-marker && sync -f /var/lib/berth/at-rest-marker")
	// The control goes where a node still sees a host directory: its containerd configuration
	// (everything its cluster components write is on the state disk).
	c.must(time.Minute, "nsenter", ns, "--", "sh", "-c", "echo "+string(control)+" > /etc/containerd/at-rest-control && sync -f /etc/containerd/at-rest-control")
	if got := c.must(time.Minute, "nsenter", ns, "--", "cat", "/var/lib/berth/at-rest-marker"); !strings.Contains(got, string(marker)) {
		t.Fatalf("marker not readable through w2's mounts: %q", got)
	}
	needles := map[string][]byte{"marker": marker, "control marker": control}
	for name, s := range secrets {
		needles[name+" (raw)"] = s
		needles[name+" (hex)"] = []byte(hex.EncodeToString(s))
		needles[name+" (HEX)"] = []byte(strings.ToUpper(hex.EncodeToString(s)))
		needles[name+" (base64)"] = []byte(base64.StdEncoding.EncodeToString(s))
		needles[name+" (base64url)"] = []byte(base64.RawURLEncoding.EncodeToString(s))
	}
	start := time.Now()
	hits, scanned := searchTree(t, c.dir, map[string]bool{
		filepath.Join(c.dir, "master-secret.json"): true, filepath.Join(c.dir, "init-secret"): true,
	}, needles)
	t.Logf("at rest: searched %d MiB of backing files for %d needles in %.1fs", scanned>>20, len(needles), time.Since(start).Seconds())
	if len(hits["control marker"]) == 0 {
		t.Errorf("the control marker written outside the state disk was not found: the search cannot see node files")
	}
	if len(hits["marker"]) != 0 {
		t.Errorf("the marker written to w2's state disk is in plaintext in %v", hits["marker"])
	}
	for name, files := range hits {
		if name != "marker" && name != "control marker" {
			t.Errorf("%s found at rest in %v", name, files)
		}
	}
}

// searchTree reads every regular file under dir (only the data extents of sparse files) and
// returns, by needle name, the files holding it, and the bytes read.
func searchTree(t testing.TB, dir string, skip map[string]bool, needles map[string][]byte) (map[string][]string, int64) {
	t.Helper()
	hits := map[string][]string{}
	var total int64
	maxLen := 0
	for _, n := range needles {
		maxLen = max(maxLen, len(n))
	}
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return nil // a file of a running node may vanish
		}
		if !d.Type().IsRegular() || skip[p] {
			return nil
		}
		n, found := searchFile(p, needles, maxLen)
		total += n
		for _, name := range found {
			hits[name] = append(hits[name], p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return hits, total
}

func searchFile(path string, needles map[string][]byte, overlap int) (int64, []string) {
	f, err := os.Open(path)
	if err != nil {
		return 0, nil
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return 0, nil
	}
	found := map[string]bool{}
	buf := make([]byte, 4<<20)
	var total int64
	fd := int(f.Fd())
	for off := int64(0); off < st.Size(); {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if err != nil {
			break // ENXIO: no data after off
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			hole = st.Size()
		}
		var carry []byte
		for pos := data; pos < hole; {
			n, err := f.ReadAt(buf[:min(int64(len(buf)), hole-pos)], pos)
			if n == 0 {
				if err != nil && !errors.Is(err, io.EOF) {
					return total, names(found)
				}
				break
			}
			chunk := append(carry, buf[:n]...)
			for name, nd := range needles {
				if !found[name] && bytes.Contains(chunk, nd) {
					found[name] = true
				}
			}
			carry = append([]byte(nil), chunk[max(0, len(chunk)-overlap):]...)
			pos += int64(n)
			total += int64(n)
		}
		off = hole
	}
	return total, names(found)
}

func names(m map[string]bool) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

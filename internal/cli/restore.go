package cli

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"

	"github.com/berth-k8s/berth/initproto"
	"github.com/berth-k8s/berth/internal/backup"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/initclient"
	"github.com/berth-k8s/berth/internal/workspace"
)

// restoreChunk is the size of the snapshot's messages (the node accepts at most 1 MiB each).
const restoreChunk = 1 << 20

// restoreSource is a snapshot checked on the operator's machine, with the master secret that opens it.
type restoreSource struct {
	path         string
	master, salt []byte
	manifest     backup.Manifest
	size         int64
}

func newRestoreCmd() *cobra.Command {
	o := initOptions{workspace: ".", connectTimeout: 5 * time.Minute, timeout: 30 * time.Minute}
	var from, masterSecret string
	cmd := &cobra.Command{
		Use:   "restore --from SNAPSHOT --master-secret FILE --endpoint HOST:PORT --config FILE",
		Short: "Build a cluster from a snapshot on a fresh first control plane",
		Long: `restore is berth init with a snapshot: it makes a fresh node the first control plane of the cluster
a sealed etcd snapshot (berth backup) holds, with its objects, its Secrets and its master secret.

Before any node is contacted, restore opens the snapshot with master-secret.json (the one berth init
wrote for the cluster) and reads it to its end: a snapshot of another cluster ("does not open with
this master secret") or a damaged one ("the snapshot is damaged") stops it there. It then attests the
node as berth init does, writes the master secret into the workspace (a new one, or one holding the
same secret) and sends the request and the sealed snapshot over the attested channel. The node opens
the snapshot again before it takes its node lock, restores etcd's data as its own one-member cluster
(revision moved on, so that no cache takes old data for new), runs kubeadm init on it with new
certificates, starts its KMS plugin with the snapshot's key generations, deletes the old machines'
Node objects and machine record, and applies Berth's components again.

What changes: every certificate, kubeconfig and service-account token of the old cluster stops
working (new PKI; the workspace gets a new admin.conf). What stays: the cluster ID, the master
secret and so the disk keys of new nodes, the KMS keys, every object in etcd. Nodes join as usual:
workers and further control planes created for the cluster (with its join policy) attest to the
restored joinservice and join it.

The config file is the cluster's (berth init's): its name, version and networks should be those of
the snapshot's cluster. A failed restore resumes like init: run the same command again.`,
		Example: `  berth backup list
  berth restore --from etcd-20300101T000000.000Z.berth-snapshot --master-secret old/master-secret.json \
    --endpoint 198.51.100.20:9000 --config cluster.yaml --workspace ./restored`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if from == "" || masterSecret == "" {
				return usageErr("restore needs --from and --master-secret")
			}
			src, err := checkSnapshot(from, masterSecret)
			if err != nil {
				return err
			}
			_, _ = fmt.Fprintf(cmd.ErrOrStderr(), "Snapshot of cluster %s taken %s: %s, KMS generation %d active; it opens with %s\n",
				src.manifest.ClusterID, src.manifest.Taken.UTC().Format(time.RFC3339), byteSize(src.size), src.manifest.KMS.Active, masterSecret)
			if err := checkRestoreWorkspace(o.workspace, src); err != nil {
				return err
			}
			o.restore = src
			return runInit(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), o)
		},
	}
	addInitFlags(cmd, &o)
	cmd.Flags().StringVar(&from, "from", "", "the sealed snapshot file (berth backup list; a local store's file or one fetched from the object store) (required)")
	cmd.Flags().StringVar(&masterSecret, "master-secret", "", "the cluster's master-secret.json, as berth init wrote it (required)")
	return cmd
}

// checkSnapshot opens the snapshot at path with the master secret at secretPath and reads it to its
// end; its errors name the file and what is wrong.
func checkSnapshot(path, secretPath string) (*restoreSource, error) {
	master, salt, err := workspace.ReadSecretFile(secretPath)
	if err != nil {
		return nil, usageErr("%w", err)
	}
	keys, err := clusterkeys.New(master, salt)
	if err != nil {
		return nil, usageErr("%s: %w", secretPath, err)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, usageErr("%w", err)
	}
	defer f.Close()
	m, r, err := backup.Open(f, keys)
	if err != nil {
		return nil, usageErr("%s: %w", path, err)
	}
	if _, err := io.Copy(io.Discard, r); err != nil {
		return nil, usageErr("%s: %w", path, err)
	}
	if m.ClusterID != hex.EncodeToString(keys.ClusterID()) {
		return nil, usageErr("%s: its manifest names cluster %s, the master secret's is %x", path, m.ClusterID, keys.ClusterID())
	}
	size, err := f.Seek(0, io.SeekCurrent)
	if err != nil {
		return nil, err
	}
	return &restoreSource{path: path, master: master, salt: salt, manifest: m, size: size}, nil
}

// checkRestoreWorkspace refuses, before the node is contacted, a workspace that holds another
// master secret than the snapshot's.
func checkRestoreWorkspace(dir string, src *restoreSource) error {
	master, salt, ok, err := workspace.ReadSecret(dir)
	if err != nil {
		return usageErr("%w", err)
	}
	if ok && (!bytes.Equal(master, src.master) || !bytes.Equal(salt, src.salt)) {
		return usageErr("workspace %s holds another cluster's %s; use another --workspace", dir, workspace.MasterSecret)
	}
	return nil
}

// adoptWorkspace makes the snapshot's master secret the workspace's, before anything is sent.
func adoptWorkspace(dir string, src *restoreSource, out io.Writer) (master, salt []byte, err error) {
	resumed, err := workspace.AdoptSecret(dir, src.master, src.salt)
	if errors.Is(err, workspace.ErrOtherSecret) {
		return nil, nil, usageErr("workspace %s holds another cluster's %s; use another --workspace", dir, workspace.MasterSecret)
	}
	if err != nil {
		return nil, nil, workspaceErr(dir, err)
	}
	path := filepath.Join(dir, workspace.MasterSecret)
	if resumed {
		_, _ = fmt.Fprintf(out, "Resuming with the master secret in %s\n", path)
	} else {
		_, _ = fmt.Fprintf(out, "Wrote the restored cluster's master secret to %s\n", path)
	}
	return src.master, src.salt, nil
}

// sendRestore starts the Restore call: the request, then the snapshot in chunks. The node may end
// the call early (a refusal); its answer is then in the returned stream.
func sendRestore(ctx context.Context, client initproto.InitServiceClient, req *initproto.InitRequest, src *restoreSource, errOut io.Writer) (initclient.Stream, error) {
	f, err := os.Open(src.path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	stream, err := client.Restore(ctx)
	if err != nil {
		return nil, err
	}
	if err := stream.Send(&initproto.RestoreRequest{Kind: &initproto.RestoreRequest_Init{Init: req}}); err != nil {
		if errors.Is(err, io.EOF) {
			return stream, nil
		}
		return nil, err
	}
	start := time.Now()
	_, _ = fmt.Fprintf(errOut, "Sending the snapshot (%s) ...\n", byteSize(src.size))
	buf := make([]byte, restoreChunk)
	var sent int64
	for {
		n, err := io.ReadFull(f, buf)
		if n > 0 {
			if err := stream.Send(&initproto.RestoreRequest{Kind: &initproto.RestoreRequest_Snapshot{Snapshot: buf[:n]}}); err != nil {
				if errors.Is(err, io.EOF) {
					return stream, nil // the node answered early
				}
				return nil, err
			}
			sent += int64(n)
		}
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("reading %s: %w", src.path, err)
		}
	}
	if err := stream.CloseSend(); err != nil {
		return nil, err
	}
	_, _ = fmt.Fprintf(errOut, "Sent the snapshot (%s) in %s\n", byteSize(sent), time.Since(start).Round(time.Millisecond))
	return stream, nil
}

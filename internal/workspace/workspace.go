// Package workspace owns the operator's workspace: the directory `berth init` writes a cluster's
// files to and `berth recover` and `berth policy join` read them from.
//
//	master-secret.json  the cluster's master secret and salt (base64, JSON; mode 0600), written
//	                    before anything is sent to the node; never overwritten
//	admin.conf          the admin kubeconfig, written once init succeeded; never overwritten (its
//	                    presence marks a finished cluster)
//	cluster-id          the cluster ID, hex (mode 0600)
//	init.log            the node's init output, appended (mode 0600)
//	join-policy.yaml    the join policy for the cluster's new nodes (public: mode 0644)
//
// A workspace with a master secret and no admin.conf holds an unfinished init, which `berth init`
// resumes with the same secret. Files that may be replaced are written through atomicfile (a reader
// sees the old or the new content); the secret and the kubeconfig are created exclusively.
package workspace

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/spf13/afero"

	"github.com/berth-k8s/berth/internal/atomicfile"
	"github.com/berth-k8s/berth/internal/clusterkeys"
)

// The workspace's file names.
const (
	AdminConf    = "admin.conf"
	MasterSecret = "master-secret.json"
	ClusterID    = "cluster-id"
	InitLog      = "init.log"
	JoinPolicy   = "join-policy.yaml"
)

// ErrFinished is returned by Create for a workspace that holds a finished cluster's admin.conf.
var ErrFinished = errors.New("the workspace holds a finished cluster")

// secretFile is the format of master-secret.json.
type secretFile struct {
	MasterSecret string `json:"masterSecret"`
	Salt         string `json:"salt"`
}

// secretSize is the length of the master secret and of the salt.
const secretSize = 32

// EncodeSecret returns master-secret.json's content for master and salt.
func EncodeSecret(master, salt []byte) []byte {
	data, _ := json.MarshalIndent(secretFile{
		MasterSecret: base64.StdEncoding.EncodeToString(master),
		Salt:         base64.StdEncoding.EncodeToString(salt),
	}, "", "  ")
	return append(data, '\n')
}

// Create creates the workspace dir (mode 0700) and refuses, with ErrFinished, one that holds a
// finished cluster.
func Create(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("creating workspace: %w", err)
	}
	if finished(dir) {
		return ErrFinished
	}
	return nil
}

func finished(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, AdminConf))
	return err == nil
}

// ReadSecret reads the workspace's master secret and salt; ok is false when there is none.
func ReadSecret(dir string) (master, salt []byte, ok bool, err error) {
	path := filepath.Join(dir, MasterSecret)
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil, false, nil
	}
	if err != nil {
		return nil, nil, false, fmt.Errorf("reading %s: %w", path, err)
	}
	var f secretFile
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, nil, false, fmt.Errorf("parsing %s: %w", path, err)
	}
	master, err1 := base64.StdEncoding.DecodeString(f.MasterSecret)
	salt, err2 := base64.StdEncoding.DecodeString(f.Salt)
	if err1 != nil || err2 != nil || len(master) != secretSize || len(salt) != secretSize {
		return nil, nil, false, fmt.Errorf("%s is damaged: want a 32-byte master secret and salt", path)
	}
	return master, salt, true, nil
}

// LoadKeys reads a master-secret.json at path (a workspace's, or a copy of it) and derives the
// cluster's keys from it. Its errors say what is wrong with the file.
func LoadKeys(path string) (*clusterkeys.Keys, error) {
	master, salt, err := ReadSecretFile(path)
	if err != nil {
		return nil, err
	}
	keys, err := clusterkeys.New(master, salt)
	if err != nil {
		return nil, fmt.Errorf("%s is damaged: want a 32-byte master secret and salt", path)
	}
	return keys, nil
}

// ReadSecretFile reads the master secret and salt of a master-secret.json at path. Its errors say
// what is wrong with the file and never hold its content.
func ReadSecretFile(path string) (master, salt []byte, err error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, fmt.Errorf("reading the master secret: %w", err)
	}
	var f secretFile
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, nil, fmt.Errorf("%s is not a master-secret.json as berth init writes it", path)
	}
	master, err1 := base64.StdEncoding.DecodeString(f.MasterSecret)
	salt, err2 := base64.StdEncoding.DecodeString(f.Salt)
	if err1 != nil || err2 != nil {
		return nil, nil, fmt.Errorf("%s is damaged: masterSecret and salt must be base64", path)
	}
	if len(master) != secretSize || len(salt) != secretSize {
		return nil, nil, fmt.Errorf("%s is damaged: want a 32-byte master secret and salt", path)
	}
	return master, salt, nil
}

// ErrOtherSecret is returned by AdoptSecret for a workspace that holds another master secret.
var ErrOtherSecret = errors.New("the workspace holds another master secret")

// AdoptSecret makes master and salt the workspace's (a restore's: the restored cluster keeps its
// master secret): written to dir when it holds none, accepted when it holds the same (resumed is
// true), refused with ErrOtherSecret when it holds another. Like Create, it refuses a finished
// workspace.
func AdoptSecret(dir string, master, salt []byte) (resumed bool, err error) {
	if err := Create(dir); err != nil {
		return false, err
	}
	have, haveSalt, ok, err := ReadSecret(dir)
	if err != nil {
		return false, err
	}
	if ok {
		if subtle.ConstantTimeCompare(have, master) != 1 || subtle.ConstantTimeCompare(haveSalt, salt) != 1 {
			return false, ErrOtherSecret
		}
		return true, nil
	}
	return false, writeExclusive(filepath.Join(dir, MasterSecret), EncodeSecret(master, salt))
}

// Unfinished returns the keys of the workspace's unfinished init (a master secret and no
// admin.conf), or nil when the workspace holds none.
func Unfinished(dir string) (*clusterkeys.Keys, error) {
	if finished(dir) {
		return nil, nil
	}
	master, salt, ok, err := ReadSecret(dir)
	if err != nil || !ok {
		return nil, err
	}
	keys, err := clusterkeys.New(master, salt)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(dir, MasterSecret), err)
	}
	return keys, nil
}

// PrepareSecret returns the master secret and salt of the workspace dir: those of an earlier,
// unfinished attempt (resumed is true), or new ones, written to dir before they are returned. Like
// Create, it refuses a finished workspace.
func PrepareSecret(dir string) (master, salt []byte, resumed bool, err error) {
	if err := Create(dir); err != nil {
		return nil, nil, false, err
	}
	master, salt, ok, err := ReadSecret(dir)
	if err != nil {
		return nil, nil, false, err
	}
	if ok {
		return master, salt, true, nil
	}
	master, salt = make([]byte, secretSize), make([]byte, secretSize)
	if _, err := rand.Read(master); err != nil {
		return nil, nil, false, fmt.Errorf("generating master secret: %w", err)
	}
	if _, err := rand.Read(salt); err != nil {
		return nil, nil, false, fmt.Errorf("generating salt: %w", err)
	}
	if err := writeExclusive(filepath.Join(dir, MasterSecret), EncodeSecret(master, salt)); err != nil {
		return nil, nil, false, err
	}
	return master, salt, false, nil
}

// WriteResult writes what a finished init leaves: the admin kubeconfig (created exclusively: a
// finished cluster's is never overwritten) and the cluster ID. It returns the kubeconfig's path.
func WriteResult(dir string, kubeconfig, clusterID []byte) (string, error) {
	adminPath := filepath.Join(dir, AdminConf)
	if err := writeExclusive(adminPath, kubeconfig); err != nil {
		return "", err
	}
	idHex := fmt.Sprintf("%x\n", clusterID)
	if err := atomicfile.Write(afero.NewOsFs(), filepath.Join(dir, ClusterID), []byte(idHex), 0o600); err != nil {
		return "", fmt.Errorf("writing cluster ID: %w", err)
	}
	return adminPath, nil
}

// OpenInitLog opens the workspace's init log for appending.
func OpenInitLog(dir string) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(dir, InitLog), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		return nil, fmt.Errorf("opening init log: %w", err)
	}
	return f, nil
}

// WriteJoinPolicy writes the cluster's join policy into the workspace (public data: mode 0644),
// replacing the file whole, so that a node reading it meanwhile sees the old or the new one. It
// returns the file's path.
func WriteJoinPolicy(dir string, data []byte) (string, error) {
	path := filepath.Join(dir, JoinPolicy)
	if err := atomicfile.Write(afero.NewOsFs(), path, data, 0o644); err != nil {
		return "", fmt.Errorf("writing join policy: %w", err)
	}
	return path, nil
}

// writeExclusive creates path with mode 0600 and fails if it exists.
func writeExclusive(path string, data []byte) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("creating %s: %w", path, err)
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("writing %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("syncing %s: %w", path, err)
	}
	return f.Close()
}

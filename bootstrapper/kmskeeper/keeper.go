// Package kmskeeper is the control plane's side of encryption at rest: it holds the KMS plugin's key
// set, persists it on the node's encrypted state disk, writes the API server's
// EncryptionConfiguration, hands the keys to the plugin (kmsplugin.Supervisor), and follows the
// cluster's key spec (internal/kmsstate) through rotations.
//
// Where the keys come from, in the order a node meets them:
//
//	init        generation 1, derived from the master secret of the init request (Install)
//	join        every generation of the spec, in the control-plane join ticket (Install)
//	every boot  the file on the state disk (Restore): the disk opens with its sealed key, else a
//	            rejoin ticket, else berth recover, so the keys come back the same way
//	rotation    generations the spec adds, derived from the master secret in the cluster Secret,
//	            which the API server decrypts with the generation the plugin already holds
//
// The key set is kept in memory, in StateDir/kms-keys.json (0600; StateDir is a directory of the
// encrypted state disk) and in the plugin process's memory; never in etcd, a Secret, a log or an error.
//
// Run, once the node has keys and an admin kubeconfig, watches berth-system/berth-kms and:
//   - makes the plugin hold exactly the spec's generations with its active one; before it drops a
//     generation it scans its etcd and keeps the generation while any object is stored under it;
//   - answers the spec's scan requests with a scan of its etcd (etcdscan);
//   - asks its plugin for its status every few seconds and its local API server's kms-providers
//     check while that API server has not yet encrypted under the active key, which makes the API
//     server notice a new key ID within seconds instead of a minute;
//   - reports all of it as node.<name> (kmsstate.NodeStatus), when it changed and every minute.
package kmskeeper

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/spf13/afero"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/berth-k8s/berth/internal/atomicfile"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/etcdscan"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/kmsplugin"
	"github.com/berth-k8s/berth/internal/kmsstate"
	"github.com/berth-k8s/berth/internal/kubeadm"
	"github.com/berth-k8s/berth/internal/kubeclient"
)

// KeysFileName is the key set's file in the state directory.
const KeysFileName = "kms-keys.json"

// encryptKeyIDFile remembers the key ID the node's API server encrypts under (not a secret: the
// same ID is stored next to every object), for a restarted daemon whose API server kept running and
// so makes no new data-encryption key to tell it again.
const encryptKeyIDFile = "kms-encrypt-key-id"

// Config configures a Keeper.
type Config struct {
	// StateDir is the bootstrapper's state directory, on the encrypted state disk.
	StateDir string
	// KubernetesDir is kubeadm's directory (admin.conf, pki/); the EncryptionConfiguration goes to
	// its berth/ subdirectory.
	KubernetesDir string
	// Socket is the plugin's socket (kmsplugin.DefaultSocket).
	Socket string
	// EtcdEndpoint is the control plane's etcd (default https://127.0.0.1:2379).
	EtcdEndpoint string
}

// Intervals of Run.
const (
	// checkInterval is how often Run asks the plugin for its status and re-reads what it reports.
	checkInterval = 3 * time.Second
	// heartbeat is how often Run writes its report when nothing changed.
	heartbeat = time.Minute
	// statusTimeout bounds a call to the plugin.
	statusTimeout = 5 * time.Second
	// kubeconfigPoll is how often Run looks for the admin kubeconfig kubeadm writes.
	kubeconfigPoll = time.Second
	// retireRescan is how long a scan that kept a generation counts before etcd is scanned again.
	retireRescan = 30 * time.Second
)

// Plugin is the plugin process as the keeper drives it (kmsplugin.Supervisor).
type Plugin interface {
	// SetKeys hands the plugin a key set (and starts it the first time).
	SetKeys(set kmsplugin.KeySet) error
	// EncryptKeyID is the key ID of the plugin's last Encrypt ("" before the first).
	EncryptKeyID() string
}

// Self tells the keeper which node it runs on.
type Self func(ctx context.Context) (name, ip string, err error)

// Keeper holds a control plane's KMS keys. The zero value is not usable; create it with New.
type Keeper struct {
	cfg    Config
	fs     afero.Fs
	log    *zap.Logger
	plugin Plugin
	self   Self

	once      sync.Once
	installed chan struct{}
	mu        sync.Mutex
	set       kmsplugin.KeySet

	// Seams for tests; New sets the real ones.
	connect func(kubeconfig string) (*rest.Config, error)
	etcd    func(ctx context.Context) (clientv3.KV, func(), error)
}

// New returns a Keeper.
func New(cfg Config, fsys afero.Fs, log *zap.Logger, plugin Plugin, self Self) *Keeper {
	if cfg.Socket == "" {
		cfg.Socket = kmsplugin.DefaultSocket
	}
	if cfg.KubernetesDir == "" {
		cfg.KubernetesDir = "/etc/kubernetes"
	}
	if cfg.EtcdEndpoint == "" {
		cfg.EtcdEndpoint = "https://127.0.0.1:2379"
	}
	k := &Keeper{cfg: cfg, fs: fsys, log: log, plugin: plugin, self: self}
	k.connect = kubeclient.FromFile
	k.etcd = k.dialEtcd
	return k
}

func (k *Keeper) init() { k.once.Do(func() { k.installed = make(chan struct{}) }) }

// EncryptionConfigPath is where the API server's EncryptionConfiguration lies on every control plane.
func EncryptionConfigPath(kubernetesDir string) string {
	return filepath.Join(kubernetesDir, "berth", "encryption-config.yaml")
}

// Encryption is what kubeadm must give the API server (its flag and mounts) to encrypt through the
// plugin.
func (k *Keeper) Encryption() kubeadm.Encryption {
	return kubeadm.Encryption{ConfigFile: EncryptionConfigPath(k.cfg.KubernetesDir), SocketDir: filepath.Dir(k.cfg.Socket)}
}

func (k *Keeper) keysPath() string { return filepath.Join(k.cfg.StateDir, KeysFileName) }

// Install makes set the node's key set: on the state disk, in the EncryptionConfiguration's place
// and in the plugin. Init and control-plane joins call it before kubeadm starts the API server.
func (k *Keeper) Install(_ context.Context, set kmsplugin.KeySet) error {
	if err := set.Validate(); err != nil {
		return err
	}
	b, err := kmsplugin.MarshalKeySet(set)
	if err != nil {
		return err
	}
	if err := k.fs.MkdirAll(k.cfg.StateDir, 0o700); err != nil {
		return fmt.Errorf("creating state directory: %w", err)
	}
	if err := atomicfile.Write(k.fs, k.keysPath(), b, 0o600); err != nil {
		return fmt.Errorf("saving the KMS key set: %w", err)
	}
	return k.load(set)
}

// Restore loads the key set the node saved, if any: a control plane's boot after the first. It
// reports whether there was one (workers have none).
func (k *Keeper) Restore() (bool, error) {
	b, err := afero.ReadFile(k.fs, k.keysPath())
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("reading the KMS key set: %w", err)
	}
	set, err := kmsplugin.UnmarshalKeySet(b)
	if err != nil {
		return false, fmt.Errorf("reading the KMS key set %s: %w", k.keysPath(), err)
	}
	return true, k.load(set)
}

// load writes the EncryptionConfiguration (when it differs) and gives set to the plugin.
func (k *Keeper) load(set kmsplugin.KeySet) error {
	cfg, err := kmsplugin.EncryptionConfig(k.cfg.Socket)
	if err != nil {
		return err
	}
	path := EncryptionConfigPath(k.cfg.KubernetesDir)
	if old, err := afero.ReadFile(k.fs, path); err != nil || !bytes.Equal(old, cfg) {
		if err := k.fs.MkdirAll(filepath.Dir(path), 0o700); err != nil {
			return fmt.Errorf("creating the encryption configuration's directory: %w", err)
		}
		if err := atomicfile.Write(k.fs, path, cfg, 0o600); err != nil {
			return fmt.Errorf("writing the encryption configuration: %w", err)
		}
	}
	if err := k.plugin.SetKeys(set); err != nil {
		return err
	}
	k.init()
	k.mu.Lock()
	k.set = set
	k.mu.Unlock()
	select {
	case <-k.installed:
	default:
		close(k.installed)
		k.log.Info("KMS keys loaded", zap.Uint32s("generations", set.Generations()), zap.Uint32("active", set.Active),
			zap.String("activeKeyID", set.ActiveKeyID()))
	}
	return nil
}

// Keys returns the node's key set, if it has one.
func (k *Keeper) Keys() (kmsplugin.KeySet, bool) {
	k.init()
	select {
	case <-k.installed:
	default:
		return kmsplugin.KeySet{}, false
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.set, true
}

// Run follows the cluster's key spec and reports until ctx ends (see the package documentation). A
// node that never gets keys (a worker) waits for nothing and returns when ctx ends.
func (k *Keeper) Run(ctx context.Context) error {
	k.init()
	select {
	case <-ctx.Done():
		return nil
	case <-k.installed:
	}
	kubeconfig := filepath.Join(k.cfg.KubernetesDir, "admin.conf")
	if err := wait.PollUntilContextCancel(ctx, kubeconfigPoll, true, func(context.Context) (bool, error) {
		_, err := k.fs.Stat(kubeconfig)
		return err == nil, nil
	}); err != nil {
		return nil //nolint:nilerr // ctx ended while waiting: a clean stop
	}
	restCfg, err := k.connect(kubeconfig)
	if err != nil {
		return fmt.Errorf("reading %s: %w", kubeconfig, err)
	}
	client, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		return fmt.Errorf("creating a Kubernetes client: %w", err)
	}
	var name, ip string
	if err := wait.PollUntilContextCancel(ctx, time.Second, true, func(ctx context.Context) (bool, error) {
		var err error
		name, ip, err = k.self(ctx)
		if err != nil {
			k.log.Warn("asking metadata for this node", zap.Error(err))
		}
		return err == nil, nil
	}); err != nil {
		return nil //nolint:nilerr // ctx ended while waiting: a clean stop
	}
	plugin, err := kmsplugin.NewClient(k.cfg.Socket)
	if err != nil {
		return err
	}
	defer func() { _ = plugin.Close() }() // a close error leaves nothing to clean up
	local, err := localAPIServer(restCfg, ip)
	if err != nil {
		return err
	}
	r := &run{k: k, log: k.log.With(zap.String("node", name)), client: client, node: name, plugin: plugin, local: local}
	return r.loop(ctx)
}

// localAPIServer is a client of this node's own API server (the admin kubeconfig may name a load
// balancer), for its health checks.
func localAPIServer(cfg *rest.Config, ip string) (rest.Interface, error) {
	u, err := url.Parse(cfg.Host)
	if err != nil {
		return nil, fmt.Errorf("parsing the API server address: %w", err)
	}
	port := u.Port()
	if port == "" {
		port = "443"
	}
	local := rest.CopyConfig(cfg)
	local.Host = "https://" + net.JoinHostPort(ip, port)
	local.Timeout = statusTimeout
	cs, err := kubernetes.NewForConfig(local)
	if err != nil {
		return nil, fmt.Errorf("creating a client of the local API server: %w", err)
	}
	return cs.Discovery().RESTClient(), nil
}

// dialEtcd connects to the control plane's etcd with the API server's etcd client certificate.
func (k *Keeper) dialEtcd(ctx context.Context) (clientv3.KV, func(), error) {
	pki := filepath.Join(k.cfg.KubernetesDir, "pki")
	cert, err := tls.LoadX509KeyPair(filepath.Join(pki, "apiserver-etcd-client.crt"), filepath.Join(pki, "apiserver-etcd-client.key"))
	if err != nil {
		return nil, nil, fmt.Errorf("loading the etcd client certificate: %w", err)
	}
	ca, err := os.ReadFile(filepath.Join(pki, "etcd", "ca.crt"))
	if err != nil {
		return nil, nil, fmt.Errorf("reading the etcd CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return nil, nil, errors.New("reading the etcd CA: no certificate")
	}
	c, err := clientv3.New(clientv3.Config{
		Endpoints: []string{k.cfg.EtcdEndpoint}, DialTimeout: 10 * time.Second, Context: ctx,
		TLS: &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, MinVersion: tls.VersionTLS12},
		// The etcd client logs through zap on its own; keep it quiet.
		Logger: zap.NewNop(),
	})
	if err != nil {
		return nil, nil, fmt.Errorf("connecting to etcd: %w", err)
	}
	return c, func() { _ = c.Close() }, nil
}

// run is one Run's state.
type run struct {
	k      *Keeper
	log    *zap.Logger
	client kubernetes.Interface
	node   string
	plugin *kmsplugin.Client
	local  rest.Interface

	message    string // why the keeper does not follow the spec fully, or ""
	scan       *kmsstate.ScanResult
	written    *kmsstate.NodeStatus
	writtenAt  time.Time
	keysFailed string // the spec digest the keeper last failed to follow, so it logs once
	// recordedEncrypt is the key ID last written to encryptKeyIDFile.
	recordedEncrypt string
	// retireScan is the last scan before retiring generations, for the key set retireDigest names.
	retireScan   *etcdscan.Report
	retireDigest string
	retireAt     time.Time
}

func (r *run) loop(ctx context.Context) error {
	changed := make(chan struct{}, 1)
	notify := func() {
		select {
		case changed <- struct{}{}:
		default:
		}
	}
	factory := informers.NewSharedInformerFactoryWithOptions(r.client, 10*time.Minute,
		informers.WithNamespace(joinconfig.Namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", kmsstate.ConfigMapName).String()
		}))
	inf := factory.Core().V1().ConfigMaps()
	if _, err := inf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { notify() },
		UpdateFunc: func(any, any) { notify() },
		DeleteFunc: func(any) { notify() },
	}); err != nil {
		return fmt.Errorf("watching %s: %w", kmsstate.ConfigMapName, err)
	}
	factory.Start(ctx.Done())
	defer factory.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), inf.Informer().HasSynced) {
		return nil
	}
	r.log.Info("KMS keeper following the key spec")
	t := time.NewTicker(checkInterval)
	defer t.Stop()
	for {
		cm, err := inf.Lister().ConfigMaps(joinconfig.Namespace).Get(kmsstate.ConfigMapName)
		var data map[string]string
		if err == nil {
			data = cm.Data
		}
		r.step(ctx, data)
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		case <-t.C:
		}
	}
}

// step follows the spec in data once, checks the plugin and reports.
func (r *run) step(ctx context.Context, data map[string]string) {
	st, err := kmsstate.Decode(data)
	if err != nil {
		r.message = "the key spec does not decode: " + err.Error()
	} else {
		r.follow(ctx, st.Spec)
		if st.Spec.Scan != "" && (r.scan == nil || r.scan.Request != st.Spec.Scan) {
			r.scan = r.runScan(ctx, st.Spec.Scan)
		}
	}
	r.report(ctx)
}

// follow makes the plugin hold the spec's generations, keeping any generation objects are still
// stored under.
func (r *run) follow(ctx context.Context, spec kmsstate.Spec) {
	cur, _ := r.k.Keys()
	if spec.Holds(cur.Generations(), cur.Active) {
		r.message = ""
		return
	}
	next, msg, err := r.nextKeySet(ctx, cur, spec)
	if err != nil {
		r.message = err.Error()
		if digest := fmt.Sprint(spec.Generations, spec.Active); r.keysFailed != digest {
			r.keysFailed = digest
			r.log.Error("following the KMS key spec", zap.Uint32s("generations", spec.Generations), zap.Uint32("active", spec.Active), zap.Error(err))
		}
		return
	}
	r.message = msg
	if next.Equal(cur) {
		return
	}
	if err := r.k.Install(ctx, next); err != nil {
		r.message = "installing the key set: " + err.Error()
		r.log.Error("installing the KMS key set", zap.Error(err))
		return
	}
	r.keysFailed = ""
	r.log.Info("KMS key set changed", zap.Uint32s("generations", next.Generations()), zap.Uint32("active", next.Active),
		zap.String("activeKeyID", next.ActiveKeyID()), zap.Uint32s("was", cur.Generations()), zap.Uint32("wasActive", cur.Active))
}

// nextKeySet is the key set that follows spec from cur: new generations derived from the master
// secret, generations the spec dropped removed unless etcd still holds objects under them.
func (r *run) nextKeySet(ctx context.Context, cur kmsplugin.KeySet, spec kmsstate.Spec) (kmsplugin.KeySet, string, error) {
	next := kmsplugin.KeySet{Active: spec.Active}
	var missing []uint32
	for _, g := range spec.Generations {
		if k, ok := cur.Key(g); ok {
			next.Keys = append(next.Keys, k)
		} else {
			missing = append(missing, g)
		}
	}
	if len(missing) > 0 {
		keys, err := r.clusterKeys(ctx)
		if err != nil {
			return kmsplugin.KeySet{}, "", err
		}
		// The keys this node holds must be the cluster's: a master secret that derives others is
		// another cluster's, and its keys would decrypt nothing here.
		for _, k := range cur.Keys {
			if !bytes.Equal(keys.KMSKey(k.Generation), k.KEK) {
				return kmsplugin.KeySet{}, "", fmt.Errorf("the cluster Secret's master secret does not derive this node's key of generation %d: not adding generations %v", k.Generation, missing)
			}
		}
		for _, g := range missing {
			next.Keys = append(next.Keys, kmsplugin.Key{Generation: g, KEK: keys.KMSKey(g)})
		}
	}
	var dropped []kmsplugin.Key
	for _, k := range cur.Keys {
		if !slices.Contains(spec.Generations, k.Generation) {
			dropped = append(dropped, k)
		}
	}
	msg := ""
	if len(dropped) > 0 {
		kept, err := r.stillStored(ctx, next, dropped)
		if err != nil {
			return kmsplugin.KeySet{}, "", fmt.Errorf("checking etcd before retiring generations: %w", err)
		}
		var parts []string
		for _, k := range kept {
			next.Keys = append(next.Keys, k.key)
			parts = append(parts, fmt.Sprintf("keeping generation %d: %d objects are still stored under it", k.key.Generation, k.objects))
		}
		msg = strings.Join(parts, "; ")
	}
	return next, msg, next.Validate()
}

type keptKey struct {
	key     kmsplugin.Key
	objects int
}

// stillStored scans etcd for objects under the dropped keys. While the answer is the same spec's
// and younger than retireRescan, it is not asked again: a keeper that keeps a generation checks
// again after a while, not at every step.
func (r *run) stillStored(ctx context.Context, next kmsplugin.KeySet, dropped []kmsplugin.Key) ([]keptKey, error) {
	digest := fmt.Sprint(next.Generations(), next.Active, len(dropped))
	if r.retireScan != nil && r.retireDigest == digest && time.Since(r.retireAt) < retireRescan {
		return r.keptFrom(*r.retireScan, dropped), nil
	}
	rep, err := r.etcdScan(ctx, next)
	if err != nil {
		return nil, err
	}
	r.retireScan, r.retireDigest, r.retireAt = &rep, digest, time.Now()
	return r.keptFrom(rep, dropped), nil
}

// keptFrom lists the dropped keys rep finds objects under.
func (r *run) keptFrom(rep etcdscan.Report, dropped []kmsplugin.Key) []keptKey {
	var kept []keptKey
	for _, k := range dropped {
		if n := rep.ByKeyID[kmsplugin.KeyID(k.Generation, k.KEK)]; n > 0 {
			kept = append(kept, keptKey{k, n})
		}
	}
	return kept
}

// etcdScan scans the encrypted resources, listing what is not under set's active key.
func (r *run) etcdScan(ctx context.Context, set kmsplugin.KeySet) (etcdscan.Report, error) {
	kv, closeKV, err := r.k.etcd(ctx)
	if err != nil {
		return etcdscan.Report{}, err
	}
	defer closeKV()
	var prefixes []string
	for _, res := range kmsplugin.EncryptedResources {
		prefixes = append(prefixes, etcdscan.ResourcePrefix(res))
	}
	return etcdscan.Scan(ctx, kv, etcdscan.Options{Provider: kmsplugin.ProviderName, Prefixes: prefixes, Keep: []string{set.ActiveKeyID()}})
}

func (r *run) runScan(ctx context.Context, request string) *kmsstate.ScanResult {
	set, _ := r.k.Keys()
	res := &kmsstate.ScanResult{Request: request, Time: time.Now().UTC()}
	rep, err := r.etcdScan(ctx, set)
	if err != nil {
		res.Error = err.Error()
		r.log.Error("scanning etcd", zap.String("request", request), zap.Error(err))
		return res
	}
	res.Report = rep
	r.log.Info("etcd scanned", zap.String("request", request), zap.Int("objects", rep.Objects),
		zap.Any("byKeyID", rep.ByKeyID), zap.Int("notEncrypted", rep.NotEncrypted), zap.Int("listed", len(rep.Listed)))
	return res
}

// clusterKeys reads the master secret from the cluster Secret.
func (r *run) clusterKeys(ctx context.Context) (*clusterkeys.Keys, error) {
	sec, err := r.client.CoreV1().Secrets(joinconfig.Namespace).Get(ctx, joinconfig.SecretName, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("reading the cluster Secret: %w", err)
	}
	cs, err := joinconfig.DecodeSecrets(sec.Data)
	if err != nil {
		return nil, fmt.Errorf("reading the cluster Secret: %w", err)
	}
	keys, err := clusterkeys.New(cs.MasterSecret, cs.Salt)
	if err != nil {
		return nil, fmt.Errorf("reading the cluster Secret: %w", err)
	}
	return keys, nil
}

// report asks the plugin for its status, pokes the local API server while it has not encrypted under
// the active key during a rotation, and writes the report when it changed or is a minute old.
func (r *run) report(ctx context.Context) {
	set, _ := r.k.Keys()
	st := kmsstate.NodeStatus{Generations: set.Generations(), Active: set.Active, KeyIDs: map[string]string{},
		Message: r.message, EncryptKeyID: r.encryptKeyID(), Scan: r.scan}
	for id, g := range set.KeyIDs() {
		st.KeyIDs[strconv.FormatUint(uint64(g), 10)] = id
	}
	sctx, cancel := context.WithTimeout(ctx, statusTimeout)
	resp, err := r.plugin.Status(sctx)
	cancel()
	switch {
	case err != nil:
		st.Message = joinMessages("the plugin does not answer: "+err.Error(), st.Message)
	case resp.GetHealthz() != kmsplugin.Healthy:
		st.Message = joinMessages("the plugin is unhealthy: "+resp.GetHealthz(), st.Message)
		st.ActiveKeyID = resp.GetKeyId()
	case resp.GetKeyId() != set.ActiveKeyID():
		st.Message = joinMessages("the plugin reports key ID "+resp.GetKeyId()+", not the active "+set.ActiveKeyID(), st.Message)
		st.ActiveKeyID = resp.GetKeyId()
	default:
		st.Healthy = true
		st.ActiveKeyID = resp.GetKeyId()
	}
	if len(set.Keys) > 1 && st.EncryptKeyID != set.ActiveKeyID() {
		// A rotation is under way and this API server still encrypts under an older key: its
		// kms-providers check asks the plugin's Status (at most every 20 s), which makes it notice.
		pctx, cancel := context.WithTimeout(ctx, statusTimeout)
		_, _ = r.local.Get().AbsPath("/readyz/kms-providers").DoRaw(pctx)
		cancel()
	}
	if r.written != nil && time.Since(r.writtenAt) < heartbeat {
		prev := *r.written
		prev.Updated = time.Time{}
		if reflect.DeepEqual(prev, st) {
			return
		}
	}
	st.Updated = time.Now().UTC().Truncate(time.Second)
	if err := kmsstate.ApplyNodeStatus(ctx, r.client, r.node, st); err != nil {
		r.log.Warn("writing the KMS report", zap.Error(err))
		return
	}
	if r.written == nil || r.written.Healthy != st.Healthy {
		r.log.Info("KMS plugin status", zap.Bool("healthy", st.Healthy), zap.String("activeKeyID", st.ActiveKeyID), zap.String("message", st.Message))
	}
	st.Updated = time.Time{}
	r.written, r.writtenAt = &st, time.Now()
}

// encryptKeyID is the key ID the API server encrypts under: what the plugin last answered an Encrypt
// for, else what an earlier daemon recorded.
func (r *run) encryptKeyID() string {
	path := filepath.Join(r.k.cfg.StateDir, encryptKeyIDFile)
	id := r.k.plugin.EncryptKeyID()
	if id == "" {
		b, _ := afero.ReadFile(r.k.fs, path)
		return string(b)
	}
	if id != r.recordedEncrypt {
		if err := atomicfile.Write(r.k.fs, path, []byte(id), 0o600); err != nil {
			r.log.Warn("recording the API server's key ID", zap.Error(err))
		}
		r.recordedEncrypt = id
	}
	return id
}

func joinMessages(a, b string) string {
	if b == "" {
		return a
	}
	return a + "; " + b
}

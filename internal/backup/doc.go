// Package backup takes, seals, stores and opens the cluster's etcd snapshots.
//
// A sealed snapshot is one age file (filippo.io/age: a header, then the payload in authenticated
// 64 KiB chunks, so that a cut or changed file is refused, never half read). Its file key is wrapped
// by one stanza of type "berth-backup" under clusterkeys.BackupKey, the key the master secret and
// salt derive for backups and nothing else: whoever holds them opens every snapshot of the cluster;
// without them the file tells nothing but its own length. The payload is
//
//	"berth-snapshot v1\n"
//	4 bytes big-endian length, then the manifest (JSON): cluster ID, time taken, etcd revision,
//	    the KMS key spec (generations, active) and every generation's key-encryption key
//	the etcd snapshot as etcd's Snapshot call streamed it (a bbolt file, Secrets in it still
//	    encrypted by the KMS plugin under those keys)
//
// The manifest carries the KMS keys themselves, not only their generations: a restore does not
// depend on deriving them again from the same master secret generation, so a snapshot taken before
// a master secret rotation still restores with the secret that was current when it was taken.
//
// Stores (Dir, a local directory; S3, any S3-compatible object store) keep sealed snapshots under
// names that sort by the time they were taken (Name). Schedule takes one every interval on the
// control plane that holds the Lease berth-backup, writes it to every store, keeps the newest
// Keep, and reports its health as metrics (berth_backup_*) and in the ConfigMap berth-backup
// (Status), which `berth status` reads.
package backup

// Package supportbundle collects what an operator sends when asking for help with a cluster into one
// gzipped tar archive: the cluster's records of its machines and join attempts, Berth's ConfigMaps,
// the Nodes, the Events of berth-system and of the Nodes, and the recent logs of every pod in
// berth-system and kube-system, redacted. Secrets are never read. A MANIFEST at the top of the
// archive lists every file, what could not be collected and why, what is left out on purpose, and
// how many values redaction replaced. berth support is its face.
package supportbundle

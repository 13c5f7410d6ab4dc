// Command etcd is etcd 3.6.8's server, built from the Go module through etcdmain for Berth's mini
// cluster images.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }

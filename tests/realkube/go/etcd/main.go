// Command etcd is etcd's own server (etcdmain), built at the release go.mod pins, for the
// test suite's kube-apiserver.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}

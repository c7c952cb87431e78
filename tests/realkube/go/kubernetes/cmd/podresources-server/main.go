// Command podresources-server serves the kubelet's own pod-resources v1 gRPC server
// (NewV1PodResourcesServer behind the kubelet's rate limiter, 100 qps with a burst of 10) on a
// unix socket, answering from a JSON file the tests write: pods as the API serves them, the
// devices and dynamic resources the kubelet's managers would hold, and the allocatable devices.
// The file is read again whenever its identity, size or modification time changes.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"

	"google.golang.org/grpc"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	podresourcesapi "k8s.io/kubelet/pkg/apis/podresources/v1"
	apisgrpc "k8s.io/kubernetes/pkg/kubelet/apis/grpc"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
)

func main() {
	socket := flag.String("socket", "", "unix socket to serve on (replaced if present)")
	statePath := flag.String("state", "", "JSON file with pods, devices, dynamic resources and allocatable devices")
	gates := flag.String("feature-gates", "", "kubelet feature gates, as the kubelet's flag takes them")
	flag.Parse()
	if *socket == "" || *statePath == "" {
		fmt.Fprintln(os.Stderr, "usage: podresources-server --socket PATH --state FILE [--feature-gates A=true,B=false]")
		os.Exit(2)
	}
	if *gates != "" {
		if err := utilfeature.DefaultMutableFeatureGate.Set(*gates); err != nil {
			fmt.Fprintln(os.Stderr, "feature gates:", err)
			os.Exit(2)
		}
	}
	if err := serve(*socket, *statePath); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func serve(socket, statePath string) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	state := &stateFile{path: statePath}
	if err := state.refresh(); err != nil {
		return err
	}
	providers := podresources.PodResourcesProviders{
		Pods: state, Devices: state, Cpus: state, Memory: state, DynamicResources: state,
	}
	// The kubelet's own limiter comes first, as in the kubelet; the file is read again after it,
	// so a rejected call costs nothing, like the kubelet's.
	server := grpc.NewServer(
		apisgrpc.WithRateLimiter(ctx, "podresources", podresources.DefaultQPS, podresources.DefaultBurstTokens),
		grpc.ChainUnaryInterceptor(state.refreshInterceptor),
	)
	podresourcesapi.RegisterPodResourcesListerServer(server, podresources.NewV1PodResourcesServer(ctx, providers))
	if err := os.Remove(socket); err != nil && !os.IsNotExist(err) {
		return err
	}
	listener, err := net.Listen("unix", socket)
	if err != nil {
		return err
	}
	go func() {
		<-ctx.Done()
		server.Stop()
	}()
	fmt.Println("serving", socket)
	return server.Serve(listener)
}

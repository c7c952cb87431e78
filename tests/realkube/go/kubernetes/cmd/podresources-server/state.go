package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sync"
	"syscall"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	podresourcesapi "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// nodeState is the file's content: what the kubelet's pod manager, device manager and DRA
// manager would hold. Devices and dynamic resources are keyed "podUID/containerName".
type nodeState struct {
	Pods             []*v1.Pod                                      `json:"pods"`
	Devices          map[string][]*podresourcesapi.ContainerDevices `json:"devices"`
	DynamicResources map[string][]*podresourcesapi.DynamicResource  `json:"dynamicResources"`
	Allocatable      []*podresourcesapi.ContainerDevices            `json:"allocatable"`
}

type fileIdentity struct {
	dev, ino  uint64
	size      int64
	mtimeNsec int64
}

// stateFile implements every provider the pod-resources server asks, from the last good read.
type stateFile struct {
	path  string
	mu    sync.RWMutex
	seen  fileIdentity
	state nodeState
}

func (s *stateFile) refresh() error {
	info, err := os.Stat(s.path)
	if err != nil {
		return err
	}
	sys, ok := info.Sys().(*syscall.Stat_t)
	if !ok {
		return fmt.Errorf("%s: no stat", s.path)
	}
	identity := fileIdentity{uint64(sys.Dev), sys.Ino, info.Size(), info.ModTime().UnixNano()}
	s.mu.RLock()
	unchanged := identity == s.seen
	s.mu.RUnlock()
	if unchanged {
		return nil
	}
	raw, err := os.ReadFile(s.path)
	if err != nil {
		return err
	}
	var next nodeState
	if err := json.Unmarshal(raw, &next); err != nil {
		return fmt.Errorf("%s: %w", s.path, err)
	}
	s.mu.Lock()
	s.seen, s.state = identity, next
	s.mu.Unlock()
	return nil
}

func (s *stateFile) refreshInterceptor(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if err := s.refresh(); err != nil {
		return nil, status.Error(codes.Unavailable, err.Error())
	}
	return handler(ctx, req)
}

func (s *stateFile) snapshot() nodeState {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.state
}

func terminal(pod *v1.Pod) bool {
	return pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed
}

func (s *stateFile) GetPods() []*v1.Pod { return s.snapshot().Pods }

func (s *stateFile) GetActivePods() []*v1.Pod {
	var active []*v1.Pod
	for _, pod := range s.snapshot().Pods {
		if !terminal(pod) {
			active = append(active, pod)
		}
	}
	return active
}

func (s *stateFile) GetPodByName(namespace, name string) (*v1.Pod, bool) {
	for _, pod := range s.snapshot().Pods {
		if pod.Namespace == namespace && pod.Name == name {
			return pod, true
		}
	}
	return nil, false
}

func (s *stateFile) UpdateAllocatedDevices() {}

func (s *stateFile) GetDevices(podUID, containerName string) []*podresourcesapi.ContainerDevices {
	return s.snapshot().Devices[podUID+"/"+containerName]
}

func (s *stateFile) GetAllocatableDevices() []*podresourcesapi.ContainerDevices {
	return s.snapshot().Allocatable
}

func (s *stateFile) GetDynamicResources(pod *v1.Pod, container *v1.Container) []*podresourcesapi.DynamicResource {
	return s.snapshot().DynamicResources[string(pod.UID)+"/"+container.Name]
}

// No CPU or memory manager: the agent reads devices only.
func (s *stateFile) GetCPUs(string, string) []int64 { return nil }

func (s *stateFile) GetAllocatableCPUs() []int64 { return nil }

func (s *stateFile) GetMemory(string, string) []*podresourcesapi.ContainerMemory { return nil }

func (s *stateFile) GetAllocatableMemory() []*podresourcesapi.ContainerMemory { return nil }

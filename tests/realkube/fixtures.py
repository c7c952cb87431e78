"""pytest fixtures over the real control plane: one cluster per session with the chart
installed (own-node policy in Deny mode), a fresh node and agent identity per test, and the
kubelet's own pod-resources server per test."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.realkube import build
from tests.realkube.chart import (
    AgentIdentity,
    Installed,
    agent_identity,
    chart_values,
    install,
    render_for,
)
from tests.realkube.cluster import KubeCluster
from tests.realkube.kubelet import KubeletServer
from tests.realkube.objects import unique


@pytest.fixture(scope="session")
def kube_cluster() -> Iterator[KubeCluster]:
    try:
        build.ensure_built("etcd")
        build.ensure_built("kubernetes")
    except build.BuildError as exc:
        pytest.fail(f"the real control plane could not be built: {exc}")
    cluster = KubeCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def chart_installed(kube_cluster: KubeCluster) -> Installed:
    """The chart's ServiceAccount, RBAC and own-node policy (Deny), as `helm install` applies
    them with default values, rendered for this cluster's version and APIs."""
    return install(kube_cluster.admin, render_for(kube_cluster, chart_values()))


@pytest.fixture(scope="session")
def chart_with_conditions(kube_cluster: KubeCluster) -> Installed:
    """A second release (its own namespace, ServiceAccount and ClusterRole) with
    health.nodeConditions on, which adds `patch nodes/status` to its role."""
    values = chart_values(health={"nodeConditions": True})
    chart = render_for(kube_cluster, values, release="gpuid-health", namespace="gpu-health")
    return install(kube_cluster.admin, chart)


@pytest.fixture
def agent_node(
    kube_cluster: KubeCluster, chart_installed: Installed, tmp_path: Path
) -> AgentIdentity:
    """A new Node and the chart's agent pod on it, with the token bound to that pod."""
    return agent_identity(kube_cluster, chart_installed, unique("node"), tmp_path / "agent")


@pytest.fixture
def real_kubelet() -> Iterator[KubeletServer]:
    """The kubelet's own pod-resources server on a short private socket path, serving no pods
    until the test sets `pods` and calls `publish()`."""
    directory = tempfile.mkdtemp(prefix="kubelet-", dir="/tmp")
    server = KubeletServer(str(Path(directory) / "kubelet.sock"))
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)

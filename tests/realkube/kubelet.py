"""The kubelet's own pod-resources server (go/kubernetes/cmd/podresources-server) on a unix
socket, fed the same pods the Python stand-in (`gpuid_agent.simulate.kubelet.FakeKubelet`)
takes, so a test reads the same node through Go's grpc and protobuf.

The pods are written as v1 Pods (one uid each) and the devices and claims as the kubelet's
device and DRA managers hold them; `publish()` replaces the file atomically and the server reads
it again at its next call.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpuid_agent.simulate.pods import Devices, KubeletClaim, KubeletPod
from tests.realkube import build
from tests.realkube.cluster import end_process


def _devices(devices: Devices) -> list[dict[str, Any]]:
    return [{"resource_name": r, "device_ids": list(ids)} for r, ids in devices]


def _claim(claim: KubeletClaim) -> dict[str, Any]:
    return {
        "claim_name": claim.name,
        "claim_namespace": claim.namespace,
        "claim_resources": [
            {
                "cdi_devices": [{"name": n} for n in d.cdi_devices],
                "driver_name": d.driver,
                "pool_name": d.pool,
                "device_name": d.device,
                **({"share_id": d.share_id} if d.share_id is not None else {}),
            }
            for d in claim.devices
        ],
    }


def node_state(
    pods: Iterable[KubeletPod], allocatable: Devices | None, uids: dict[tuple[str, str], str]
) -> dict[str, Any]:
    """The server's file for `pods` (uids kept per pod across publishes, as a pod keeps its)."""
    listed: list[dict[str, Any]] = []
    devices: dict[str, Any] = {}
    claims: dict[str, Any] = {}
    for p in pods:
        uid = uids.setdefault((p.namespace, p.name), str(uuid.uuid4()))
        listed.append(
            {
                "metadata": {"name": p.name, "namespace": p.namespace, "uid": uid},
                "spec": {"containers": [{"name": c.name} for c in p.containers]},
                "status": {"phase": "Running"},
            }
        )
        for c in p.containers:
            if c.devices:
                devices[f"{uid}/{c.name}"] = _devices(c.devices)
            if c.claims:
                claims[f"{uid}/{c.name}"] = [_claim(k) for k in c.claims]
    return {
        "pods": listed,
        "devices": devices,
        "dynamicResources": claims,
        "allocatable": _devices(allocatable or ()),
    }


class KubeletServer:
    """`pods` and `allocatable` may be replaced at any time; `publish()` makes them served."""

    def __init__(
        self,
        socket_path: str,
        pods: Iterable[KubeletPod] = (),
        allocatable: Devices | None = (),
        *,
        feature_gates: str = "",
    ) -> None:
        self.socket_path = os.path.abspath(socket_path)
        self.pods: list[KubeletPod] = list(pods)
        self.allocatable = allocatable
        self.state_path = Path(self.socket_path).with_name("podresources-state.json")
        self._feature_gates = feature_gates
        self._uids: dict[tuple[str, str], str] = {}
        self._process: subprocess.Popen[bytes] | None = None
        self.log = Path(self.socket_path).with_name("podresources-server.log")

    def uid(self, namespace: str, name: str) -> str:
        return self._uids[(namespace, name)]

    def publish(self) -> None:
        state = node_state(self.pods, self.allocatable, self._uids)
        fd, temporary = tempfile.mkstemp(dir=self.state_path.parent, prefix=".state-")
        with os.fdopen(fd, "w") as out:
            json.dump(state, out)
        os.replace(temporary, self.state_path)

    def start(self) -> None:
        self.publish()
        args = [
            str(build.program("podresources-server")),
            f"--socket={self.socket_path}",
            f"--state={self.state_path}",
        ]
        if self._feature_gates:
            args.append(f"--feature-gates={self._feature_gates}")
        with open(self.log, "ab") as log:
            self._process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.socket_path):
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"podresources-server did not start: {self.log.read_text()[-2000:]}"
                )
            time.sleep(0.02)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            end_process(process)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

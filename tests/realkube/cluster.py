"""A real Kubernetes control plane on loopback: etcd and kube-apiserver built from Go modules
(tests/realkube/build.py), RBAC authorization, ServiceAccount tokens signed by a key of our own,
and an admin client certificate (group system:masters).

No controllers run: tests create Nodes, Namespaces (with their `default` ServiceAccount, which the
ServiceAccount admission plugin needs), Pods with `spec.nodeName`, ResourceSlices and
ResourceClaims themselves, and patch pod status as a kubelet would.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from tests.realkube import build
from tests.realkube.pki import Authority, key_pem

ISSUER = "https://kubernetes.default.svc"
# The serving certificate names the host's loopback as a podman pod reaches it (slirp4netns'
# 10.0.2.2) beside 127.0.0.1: the chart's pod in tests/image talks to this API server.
SERVING_IPS = ("127.0.0.1", "10.0.2.2")
START_TIMEOUT = 120.0  # a cold kube-apiserver on two busy cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ApiError(RuntimeError):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"{status}: {body.get('message', body)}")
        self.status = status
        self.body = body


@dataclass
class Client:
    """A small synchronous client of the API server: JSON in, JSON out, with whatever
    credentials `context` (TLS) and `token` carry. Warnings the server returns are kept."""

    url: str
    context: ssl.SSLContext
    token: str | None = None
    warnings: list[str] = field(default_factory=list)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: dict[str, Any] | None = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> Any:
        url = self.url + path + (f"?{urlencode(query)}" if query else "")
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, context=self.context, timeout=timeout) as resp:
                self.warnings += resp.headers.get_all("Warning") or []
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            self.warnings += exc.headers.get_all("Warning") or []
            raw = exc.read()
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = {"message": raw[:300].decode("utf-8", "replace")}
            raise ApiError(exc.code, parsed) from None
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:  # /readyz and friends answer plain text
            return raw.decode("utf-8", "replace")

    def get(self, path: str, **query: Any) -> Any:
        return self.request("GET", path, query=query or None)

    def create(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    def merge_patch(self, path: str, patch: Any) -> Any:
        return self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    def strategic_patch(self, path: str, patch: Any) -> Any:
        return self.request(
            "PATCH", path, patch, content_type="application/strategic-merge-patch+json"
        )

    def apply(self, obj: dict[str, Any]) -> Any:
        """Create `obj` (cluster-scoped or namespaced) at its collection path."""
        return self.create(collection_path(obj), obj)


def collection_path(obj: dict[str, Any]) -> str:
    group_version = obj["apiVersion"]
    base = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
    plural = _PLURALS.get(obj["kind"], obj["kind"].lower() + "s")
    namespace = obj.get("metadata", {}).get("namespace")
    if namespace and obj["kind"] not in _CLUSTER_SCOPED:
        return f"{base}/namespaces/{quote(namespace, safe='')}/{plural}"
    return f"{base}/{plural}"


_PLURALS = {
    "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
    "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
}
_CLUSTER_SCOPED = {
    "Node",
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "ResourceSlice",
    "DeviceClass",
}


class KubeCluster:
    """etcd and kube-apiserver in a private directory; `start()`, then `admin` (a Client),
    `url`, `ca_path`; `stop()` removes everything."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="realkube-"))
        self.ca = Authority("gpuid test cluster CA")
        self.ca_path = self.root / "ca.crt"
        self.etcd_port = free_port()
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        self._processes: list[subprocess.Popen[bytes]] = []
        self.admin: Client

    def start(self) -> None:
        etcd = build.program("etcd")
        apiserver = build.program("kube-apiserver")
        self.ca_path.write_bytes(self.ca.pem)
        serving = self.ca.write(self.root, "apiserver", "kube-apiserver", ips=SERVING_IPS)
        admin_cert, admin_key = self.ca.write(
            self.root, "admin", "gpuid-test-admin", organizations=("system:masters",)
        )
        sa_key = ec.generate_private_key(ec.SECP256R1())
        (self.root / "sa.key").write_bytes(key_pem(sa_key))
        (self.root / "sa.pub").write_bytes(
            sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        peer = free_port()
        self._spawn(
            "etcd",
            [
                str(etcd),
                "--name=test",
                f"--data-dir={self.root / 'etcd'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=test=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",  # a throwaway store: durability costs time, buys nothing
                "--log-level=warn",
            ],
        )
        self.apiserver_args = [
            str(apiserver),
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--tls-cert-file={serving[0]}",
            f"--tls-private-key-file={serving[1]}",
            f"--client-ca-file={self.ca_path}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer={ISSUER}",
            f"--service-account-key-file={self.root / 'sa.pub'}",
            f"--service-account-signing-key-file={self.root / 'sa.key'}",
            "--service-cluster-ip-range=10.96.0.0/24",
            # The `kubernetes` Service's Endpoints may not hold a loopback address; nothing here
            # reaches the API server through that Service.
            "--endpoint-reconciler-type=none",
            # Compaction is the tests' to make (compact()), at a moment they choose.
            "--etcd-compaction-interval=0",
            "--profiling=false",
            "--v=0",
        ]
        self._spawn("kube-apiserver", [*self.apiserver_args, f"--secure-port={self.port}"])
        context = ssl.create_default_context(cafile=str(self.ca_path))
        context.load_cert_chain(admin_cert, admin_key)
        self.admin_context = context
        self.admin = Client(self.url, context)
        self.admin_cert = (admin_cert, admin_key)
        self.wait_ready(self.admin)

    def api_versions(self) -> list[str]:
        """What Helm's discovery reports as Capabilities.APIVersions: every served
        group/version, and group/version/Kind for each of its kinds."""
        found: list[str] = []
        versions = ["v1"]
        for group in self.admin.get("/apis")["groups"]:
            versions += [v["groupVersion"] for v in group["versions"]]
        for version in versions:
            found.append(version)
            base = "/api/v1" if version == "v1" else f"/apis/{version}"
            for resource in self.admin.get(base)["resources"]:
                if "/" not in resource["name"]:
                    found.append(f"{version}/{resource['kind']}")
        return found

    def as_token(self, token: str) -> Client:
        """A client that trusts the cluster's CA and authenticates with `token` only."""
        return Client(self.url, ssl.create_default_context(cafile=str(self.ca_path)), token)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 (kept open by the child)
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.root)
        log.close()
        self._processes.append(process)
        return process

    @contextlib.contextmanager
    def second_apiserver(self, *extra: str) -> Iterator[Client]:
        """Another kube-apiserver on the same etcd (an HA pair) with `extra` flags, while in
        the block: the way to see behaviour that depends on a flag without touching the main
        one."""
        port = free_port()
        process = self._spawn(
            f"kube-apiserver-{port}", [*self.apiserver_args, f"--secure-port={port}", *extra]
        )
        try:
            client = Client(f"https://127.0.0.1:{port}", self.admin_context)
            self.wait_ready(client)
            yield client
        finally:
            self._processes.remove(process)
            end_process(process)

    def wait_ready(self, client: Client) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        last: object = None
        while time.monotonic() < deadline:
            for process in self._processes:
                if process.poll() is not None:
                    raise RuntimeError(f"{process.args[0]} exited: {self.log_tail()}")
            try:
                client.request("GET", "/readyz", timeout=5)
                return
            except (OSError, ApiError, ValueError) as exc:
                last = exc
            time.sleep(0.3)
        raise RuntimeError(
            f"kube-apiserver not ready after {START_TIMEOUT:.0f} s ({last}): {self.log_tail()}"
        )

    def log_tail(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}"
            for log in self.root.glob("*.log")
        )

    def compact(self) -> int:
        """Compact etcd up to its current revision (as the API server does every 5 minutes by
        default); the revision compacted to."""
        status = _post_json(f"{self.etcd_url}/v3/kv/range", {"key": "AA==", "limit": 1})
        revision = int(status["header"]["revision"])
        _post_json(f"{self.etcd_url}/v3/kv/compaction", {"revision": revision, "physical": True})
        return revision

    def stop(self) -> None:
        for process in reversed(self._processes):
            end_process(process)
        self._processes.clear()
        shutil.rmtree(self.root, ignore_errors=True)


def end_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 2 s: kube-apiserver drains for over 10 s on SIGTERM, and
    nothing of these throwaway servers needs that."""
    with contextlib.suppress(ProcessLookupError):
        process.terminate()
    try:
        process.wait(timeout=2)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _post_json(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())

"""A kubeconfig file pointing at a fake API server, loaded by kubernetes_asyncio as if it were
a real cluster's (KUBECONFIG=<path>)."""

from __future__ import annotations

import json
from pathlib import Path


def kubeconfig_dict(
    server: str, *, token: str | None = "fake-token", namespace: str = "default"
) -> dict[str, object]:
    user: dict[str, str] = {"token": token} if token else {}
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "fake", "user": user}],
        "contexts": [
            {
                "name": "fake",
                "context": {"cluster": "fake", "user": "fake", "namespace": namespace},
            }
        ],
        "current-context": "fake",
        "preferences": {},
    }


def write_kubeconfig(
    path: str | Path,
    server: str,
    *,
    token: str | None = "fake-token",
    namespace: str = "default",
) -> Path:
    """Write the kubeconfig (JSON is valid YAML) and return its path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(kubeconfig_dict(server, token=token, namespace=namespace)))
    target.chmod(0o600)
    return target
